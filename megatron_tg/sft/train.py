"""SFT through the RL trainer's own megatron model, optimizer and checkpoints.

:class:`~megatron_tg.train.trainer.Trainer` builds the policy (``model.*``: the stock HF or a
converted megatron checkpoint, any TP/EP/PP layout), its optimizer and checkpointer; this
module replaces only the loss: token-mean cross-entropy on the assistant tokens, computed by
the fused vocab-parallel log-prob op on the hidden states of the loss rows (no logits are
materialised and the vocabulary is never gathered). Transcripts are packed into rows of
``optimizer.micro_batch_tokens`` like RL micro-batches. Checkpoints are the trainer's
(``checkpoint.dir``; a run resumes from the newest). At the end the policy alone is exported
as a megatron torch_dist checkpoint in the converter's layout, ``RUN_DIR/model/dist`` (a
trainer checkpoint also holds optimizer state, which the RL trainer's initial-weight loader
does not take): RL starts from it with ``model.megatron_checkpoint=RUN_DIR/model``, and the
engines get it as HF weights with ``megatron-tg convert megatron-to-hf --megatron-dir
RUN_DIR/model/dist --hf-config-dir BASE_HF_DIR --out-dir HF_DIR``.
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_tg.parallel.dims import Axis
from megatron_tg.sft.data import SFTExample, load_transcripts


def schedule(n: int, epochs: int, batch_size: int, seed: int, shuffle: bool) -> list[list[int]]:
    """Example indices per optimizer step: ``epochs`` passes, each (optionally) shuffled."""
    order: list[int] = []
    for e in range(epochs):
        idx = list(range(n))
        if shuffle:
            random.Random(seed * 1_000_003 + e).shuffle(idx)
        order += idx
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def micro_groups(examples: Sequence[SFTExample], budget: int) -> list[list[SFTExample]]:
    """Consecutive examples grouped so each group's tokens fit one packed row budget."""
    groups: list[list[SFTExample]] = []
    used = budget + 1
    for ex in examples:
        if used + len(ex.token_ids) > budget:
            groups.append([])
            used = 0
        groups[-1].append(ex)
        used += len(ex.token_ids)
    return groups


def group_loss(trainer, group: Sequence[SFTExample], denom: float) -> tuple[torch.Tensor, float]:
    """Summed assistant-token NLL of ``group`` divided by ``denom`` (the step's token count),
    and the unscaled sum (for logging)."""
    from megatron_tg.ops.vocab_parallel import fused_vocab_parallel_logprob
    from megatron_tg.train.batching import pack
    from megatron_tg.train.policy import forward_hidden

    packed = pack([ex.token_ids for ex in group], row_tokens=trainer.cfg.optimizer.micro_batch_tokens,
                  pad_multiple=trainer.ctx.dims.tp, pad_id=trainer.tokenizer.pad_token_id or 0)
    rows, targets = [], []
    for i, ex in enumerate(group):
        for p in range(1, len(ex.token_ids)):
            if ex.loss_mask[p]:  # the logits at p - 1 predict token p
                rows.append(packed.flat(i, p - 1))
                targets.append(ex.token_ids[p])
    out = forward_hidden(trainer.model, packed)
    hidden = out.hidden.reshape(-1, out.hidden.shape[-1])[torch.tensor(rows, dtype=torch.long)]
    logp = fused_vocab_parallel_logprob(hidden, out.output_weight, torch.tensor(targets),
                                        trainer.ctx.group(Axis.TP), vocab_size=trainer.arch.vocab_size,
                                        reduce_hidden_grad=out.reduce_hidden_grad)
    nll = -logp.sum()
    return nll / denom, float(nll.detach())


def export_model(trainer, out_dir) -> Path:
    """Collective: the policy's weights alone, as a torch_dist checkpoint ``out_dir/dist``
    (written beside, then renamed, so a crash never leaves a partial export)."""
    import shutil

    from megatron.core import dist_checkpointing

    from megatron_tg.convert.common import HF_CONFIG_SUBDIR
    from megatron_tg.train.policy import unwrap

    out = Path(out_dir)
    tmp = out.with_name(f".tmp-{out.name}")
    if trainer.ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "dist").mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(unwrap(trainer.model).sharded_state_dict(), str(tmp / "dist"))
    dist.barrier()
    if trainer.ctx.rank == 0:
        # config and tokenizer files beside it, as in the trainer's checkpoints: the export
        # to HF (convert megatron-to-hf) then needs no --hf-config-dir
        trainer.checkpointer.copy_hf_files(tmp / HF_CONFIG_SUBDIR)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    dist.barrier()
    return out


def run_sft(cfg, *, log_every: int = 1) -> dict[str, float]:
    """Collective over the trainer's ranks. Returns the last step's metrics."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_tg.config.base import ConfigError
    from megatron_tg.train.metrics import MetricsLogger
    from megatron_tg.train.trainer import Trainer

    s = cfg.sft
    if not s.data:
        raise ConfigError("sft.data: empty; name a JSONL of transcripts ({\"messages\": [...]} per line)")
    if cfg.parallel.pp > 1:  # before any rank starts: its loss calls the model directly
        raise ConfigError(f"parallel.pp={cfg.parallel.pp}: the SFT warm start runs at pp=1 only "
                          "(the RL trainer's step runs through the pipeline schedules)")
    trainer = Trainer(cfg)
    trainer.resume()
    dp, dp_rank = trainer.ctx.dims.dp, trainer.ctx.rank_in(Axis.DP)
    if s.batch_size < dp:
        raise ConfigError(f"sft.batch_size: must be >= the {dp} data-parallel ranks; got {s.batch_size}")
    examples = load_transcripts(s.data, trainer.tokenizer, cfg.model.seq_length)
    if max(len(e.token_ids) for e in examples) > cfg.optimizer.micro_batch_tokens:
        raise ConfigError(f"optimizer.micro_batch_tokens: {cfg.optimizer.micro_batch_tokens} cannot "
                          f"hold the longest transcript ({max(len(e.token_ids) for e in examples)} tokens)")
    steps = schedule(len(examples), s.epochs, s.batch_size, cfg.seed, s.shuffle)
    rank0 = trainer.ctx.rank == 0
    log = MetricsLogger(cfg.logging, cfg.logging.run_dir, enabled=rank0, total_steps=len(steps),
                        start_step=trainer.step)
    o = cfg.optimizer
    metrics: dict[str, float] = {}
    try:
        while trainer.step < len(steps):
            t0 = time.perf_counter()
            batch = [examples[i] for i in steps[trainer.step]]
            mine = batch[dp_rank::dp]
            tokens = float(sum(sum(ex.loss_mask[1:]) for ex in batch))  # the whole step's
            trainer.optimizer.zero_grad()
            nll = 0.0
            for group in micro_groups(mine, o.micro_batch_tokens):
                loss, part = group_loss(trainer, group, tokens / dp)  # DDP averages over DP
                loss.backward()
                nll += part
            finalize_model_grads([trainer.model])
            lr = o.lr * min(1.0, (trainer.step + 1) / o.warmup_steps) if o.warmup_steps else o.lr
            trainer.optimizer.lr = lr
            opt = trainer.optimizer.step()
            trainer.step += 1
            # on the device: the DP group is NCCL on GPU, which refuses host tensors
            total = torch.tensor([nll], device=trainer.ctx.device)
            dist.all_reduce(total, group=trainer.ctx.group(Axis.DP))
            metrics = {"sft/loss": float(total) / tokens, "sft/tokens": tokens,
                       "sft/examples": float(len(batch)), "optim/lr": lr,
                       **{f"optim/{k}": v for k, v in opt.items()},
                       "time/step": time.perf_counter() - t0}
            if trainer.step % log_every == 0 or trainer.step == len(steps):
                log.log(trainer.step, metrics)
            if trainer.step % cfg.checkpoint.interval == 0 or trainer.step == len(steps):
                trainer.save({"sft": {"data": s.data, "steps": len(steps)}})
            trainer.checkpointer.finalize()  # completes the async saves every rank has written
        trainer.checkpointer.finalize(blocking=True)  # the last save completes before the exit
        export_model(trainer, Path(cfg.logging.run_dir) / "model")
    finally:
        log.close()
    if not math.isfinite(metrics.get("sft/loss", 0.0)):
        raise RuntimeError(f"SFT loss is not finite at step {trainer.step}: {metrics}")
    return metrics
