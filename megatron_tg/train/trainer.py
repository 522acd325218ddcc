"""The trainer's state and its verbs: ``train_step``, ``save`` and ``resume``.

Weight sync to the engines is not a trainer verb: the loop calls
:func:`megatron_tg.weight_sync.sync.sync_to_engines` with the trainer's model after each step.

Everything here is collective over the trainer's ranks; the rollout side (engines, manager,
judge) lives on global rank 0 and hands each DP rank its share of judged samples.

Micro-batching: a DP rank's samples are packed into micro-batches of at most
``optimizer.micro_batch_tokens`` tokens (a rollout is never split); each micro-batch's loss
uses the whole step's rollout count as its denominator, so the accumulated gradient is the
gradient of the mean over the step's rollouts, whatever the split.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_tg.config.schema import TGConfig
from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
from megatron_tg.objectives import TGObjective
from megatron_tg.parallel.dims import Axis
from megatron_tg.parallel.state import LaunchEnv, init_parallel
from megatron_tg.sampling.train_sample import TrainSample
from megatron_tg.train.batching import build_micro_batch
from megatron_tg.train.checkpoint import Checkpointer
from megatron_tg.train.ema import ShardedEMA
from megatron_tg.train.ema_gather import GatheredEMA
from megatron_tg.train.optim import build_optimizer
from megatron_tg.train.policy import unwrap
from megatron_tg.train.pass_plan import build_pass_plan
from megatron_tg.train.routing import clear_replay
from megatron_tg.train.samples import TurnStats, TurnStatsAccumulator
from megatron_tg.train.update_stats import UpdateStats
from megatron_tg.train.step import ops_reduce_hidden_grad, run_step

_EXTREMA = ("_max", "_min")  # metric keys combined by max/min, not averaged
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def split_by_tokens(samples: Sequence[TrainSample], budget: int) -> list[list[TrainSample]]:
    """Consecutive groups of samples whose token total stays within ``budget``."""
    out: list[list[TrainSample]] = []
    cur: list[TrainSample] = []
    used = 0
    for s in samples:
        n = s.num_tokens
        if n > budget:
            raise ValueError(f"rollout {s.rollout.rollout_id!r} has {n} tokens, more than "
                             f"optimizer.micro_batch_tokens={budget}")
        if cur and used + n > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += n
    if cur:
        out.append(cur)
    return out


class Trainer:
    def __init__(self, cfg: TGConfig, tokenizer=None, before_build: Callable[[Any], None] | None = None) -> None:
        """``before_build(ctx)``: collective, run once the process group exists and before any
        model, gradient or optimizer memory is allocated (colocated engines release theirs)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from transformers import AutoTokenizer

        self.cfg = cfg
        p = cfg.parallel
        # One layout object from the config (checked against the model's shape), passed on.
        self.ctx = init_parallel(cfg.layout(LaunchEnv.from_env().world_size), seed=cfg.seed,
                                 backend=p.backend, timeout_s=cfg.timeouts.collective_s)
        if before_build is not None:
            before_build(self.ctx)
        self.arch = Qwen3Arch.from_hf(cfg.model.hf_config)
        dtype = _DTYPES[cfg.model.params_dtype]
        # Routing replay: the policy's routers get megatron's RouterReplay; the expert copy
        # below is built without it (megatron's global instance list must hold only these).
        self.routing_replay = bool(cfg.rollout.routing_replay and self.arch.is_moe)
        model = build_model(self.arch, dims=self.ctx.dims,
                            params_dtype=dtype, seq_length=cfg.model.seq_length,
                            recompute=cfg.model.recompute, routing_replay=self.routing_replay)
        self._load_initial_weights(model)
        self.model = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=p.use_distributed_optimizer))
        self.optimizer = build_optimizer(self.model, cfg.optimizer,
                                         distributed=p.use_distributed_optimizer,
                                         bf16=dtype == torch.bfloat16)
        self.expert_model = self._build_expert(model, dtype)
        # logging.update_stats: the size and sign-likeness of each step's weight update
        self.update_stats = (UpdateStats(self.optimizer.main_shards)
                             if cfg.logging.update_stats else None)
        # The EMA expert's fp32 average, sharded like the optimizer's fp32 main parameters.
        o = cfg.objective
        gathered = o.expert == "ema" and o.ema_weights == "gathered"
        self.ema = (ShardedEMA(self.optimizer, self.expert_model, model, o.ema_decay,
                               placement=o.ema_placement, replicated=not gathered)
                    if o.expert == "ema" else None)
        # "gathered": the expert model keeps no weights; each pass gathers them from the EMA.
        self.expert_weights = (GatheredEMA(self.ema, self.expert_model, o.ema_gather_scope)
                               if gathered else None)
        # Only the live-weight expert shares the student's keys/values, and only at PP = 1:
        # under PP the expert pass must reach the last stage before the student's loss there,
        # so it runs as its own schedule over whole expert sequences (docs/micro-batch.md §6).
        # Nor under context parallelism: each CP rank holds a share of the student's keys and
        # values, and the expert's suffix would need all of them (not built; the expert pass
        # then runs over whole expert sequences, split over CP like the student's).
        self.prefix_reuse = (cfg.objective.expert == "shared" and cfg.objective.expert_prefix_reuse
                             and self.ctx.dims.pp == 1 and self.ctx.dims.cp == 1)
        if (cfg.objective.expert_prefix_reuse and cfg.objective.expert == "shared"
                and self.ctx.dims.cp > 1 and self.ctx.rank == 0):
            print(f"[train] objective.expert_prefix_reuse off: parallel.cp={self.ctx.dims.cp} "
                  f"splits the student's keys and values over CP; the expert pass runs over "
                  f"whole expert sequences (cost: docs/micro-batch.md, prefix reuse)", flush=True)
        self.objective = TGObjective(cfg.objective, group=self.ctx.group(Axis.TP),
                                     reduce_hidden_grad=ops_reduce_hidden_grad(self.model))
        tok_dir = cfg.model.tokenizer or cfg.model.hf_checkpoint or cfg.model.hf_config
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(
            tok_dir if os.path.isdir(tok_dir) else os.path.dirname(tok_dir))
        # Each checkpoint carries the HF config and tokenizer files, which export needs.
        self.checkpointer = Checkpointer(
            cfg.checkpoint.dir, cfg.checkpoint.keep_last, async_save=cfg.checkpoint.async_save,
            hf_model_dir=cfg.model.hf_config_file().parent,
            hf_tokenizer_dir=tok_dir if os.path.isdir(tok_dir) else os.path.dirname(tok_dir))
        self.step = 0
        self.turn_stats: TurnStats = {}
        """Per (rollout, turn): loss/gated tokens, mean KL, mean IS weight of the last step."""

    # ---- set-up ------------------------------------------------------------------------
    def _load_initial_weights(self, model) -> None:
        m = self.cfg.model
        if m.megatron_checkpoint:
            from megatron.core import dist_checkpointing

            path = m.megatron_checkpoint
            sub = os.path.join(path, "dist")  # the converter's layout; plain dirs work too
            state = dist_checkpointing.load(model.sharded_state_dict(),
                                            sub if os.path.isdir(sub) else path)
            model.load_state_dict(state)
        elif m.hf_checkpoint:
            from megatron_tg.convert.hf_io import HFCheckpoint, LazyReader

            ckpt = HFCheckpoint(m.hf_checkpoint)
            ckpt.validate(self.arch)
            reader = LazyReader(m.hf_checkpoint, ckpt.reader_entries())
            load_hf_weights(model, reader.get, self.arch, current_layout(model=model))
            reader.close()
        else:
            raise ValueError("model.hf_checkpoint or model.megatron_checkpoint must name the "
                             "initial weights (a policy is never trained from random init)")

    def _build_expert(self, policy, dtype):
        """``objective.expert``: None for "shared" (the live policy, the paper's choice);
        otherwise a second model with the policy's sharding, initialised to its weights and
        never trained by the optimizer: "frozen" keeps them, "ema" tracks the policy.

        Memory: one more copy of this rank's parameter shard (no gradients, no optimizer
        state; ``megatron-tg describe`` prints the shard, docs/memory-plan.md has it per
        recipe). The "ema" expert adds its fp32 average, sharded over DP like the optimizer's
        main parameters (:mod:`megatron_tg.train.ema`): 4 B per parameter / DP size.
        """
        kind = self.cfg.objective.expert
        if kind == "shared":
            return None
        expert = build_model(self.arch, dims=self.ctx.dims,
                             params_dtype=dtype, seq_length=self.cfg.model.seq_length,
                             recompute=self.cfg.model.recompute)
        expert.load_state_dict(policy.state_dict())
        for param in expert.parameters():
            param.requires_grad_(False)
        return expert.eval()

    def resume(self) -> dict[str, Any] | None:
        """Load the newest checkpoint if there is one; returns its trainer state."""
        if not self.cfg.checkpoint.resume:
            return None
        path = self.checkpointer.latest()
        if path is None:
            return None
        state = self.checkpointer.load(path, self.model, self.optimizer, self.expert_model,
                                       self.ema)
        self.step = int(state["step"])
        if "objective" in state:
            self.objective.guard.load_state_dict(state["objective"])
        return state

    def save(self, extra: dict[str, Any]) -> str:
        """Collective. With ``checkpoint.async_save`` (the default) the checkpoint becomes
        ``latest`` only at a later ``self.checkpointer.finalize()``, once every rank's write has
        finished; a process that exits without it leaves the previous checkpoint as latest
        (the loop finalizes every step and blocks on the last save before exiting)."""
        state = {"objective": self.objective.guard.state_dict(), **extra}
        return str(self.checkpointer.save(self.step, self.model, self.optimizer, state,
                                          self.expert_model, self.ema))

    # ---- training ----------------------------------------------------------------------
    def _lr(self) -> float:
        o = self.cfg.optimizer
        if o.warmup_steps and self.step < o.warmup_steps:
            return o.lr * (self.step + 1) / o.warmup_steps
        return o.lr

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step on this DP rank's ``samples`` (collective)."""
        if not samples:
            raise ValueError("train_step got no samples for this data-parallel rank")
        tp = self.ctx.dims.tp
        budget = self.cfg.optimizer.micro_batch_tokens
        self.optimizer.zero_grad()
        sums: dict[str, float] = {}
        # rollouts of the micro-batches that reported each metric: a metric a micro-batch
        # lacks (no gated row, no thinking row) is averaged over those that have it
        counts: dict[str, int] = {}
        extrema: dict[str, float] = {}
        micro = split_by_tokens(samples, budget)
        batches = [build_micro_batch(group, self.tokenizer, self.cfg.objective, row_tokens=budget,
                                     pad_multiple=tp, framing=self.cfg.judge.feedback_role,
                                     pad_id=self.tokenizer.pad_token_id or 0,
                                     prefix_reuse=self.prefix_reuse,
                                     routing_replay=self.routing_replay) for group in micro]
        # Step totals: every micro-batch normalises by the whole step, not by itself.
        totals = dict(num_rollouts=len(samples),
                      num_assistant_tokens=float(sum(int(mb.policy.policy_mask().sum())
                                                     for mb in batches)),
                      num_gated_tokens=float(sum(float(mb.policy.gate.sum()) for mb in batches)))
        turn_stats = TurnStatsAccumulator() if self.cfg.logging.samples_per_step else None
        # Which passes run per micro-batch on every rank (EP lock-step, padding): decided once.
        plan = build_pass_plan(batches, ep=self.ctx.dims.ep)
        results = run_step(self.model, self.objective, batches, plan,
                           vocab_size=self.arch.vocab_size, expert_model=self.expert_model,
                           prefix_reuse=self.prefix_reuse, expert_weights=self.expert_weights,
                           **totals)
        clear_replay(self.model)  # the replayed ids accumulate over the step otherwise
        for passes, out in zip(plan, results):
            if passes.padding:
                continue
            mb, group = batches[passes.source], micro[passes.source]
            if turn_stats is not None:
                turn_stats.add(mb, group, out.rows)
            for k, v in {"loss": out.loss, **out.metrics}.items():
                v = float(v)
                if math.isnan(v):  # e.g. gated entropy of a micro-batch with no gate
                    continue
                if k.endswith(_EXTREMA):  # a maximum/minimum stays one over micro-batches
                    pick = max if k.endswith("_max") else min
                    extrema[k] = pick(extrema.get(k, v), v)
                else:
                    sums[k] = sums.get(k, 0.0) + v * (len(group) if k != "loss" else 1.0)
                    counts[k] = counts.get(k, 0) + len(group)
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        self.optimizer.lr = self._lr()
        if self.update_stats is not None:
            self.update_stats.before()
        opt_metrics = self.optimizer.step()
        if self.update_stats is not None:
            opt_metrics.update(self.update_stats.after(self.optimizer.lr))
        if self.ema is not None:
            self.ema.update()
        self.step += 1
        metrics = {k: (v if k == "loss" else v / counts[k]) for k, v in sums.items()}
        metrics.update(extrema)
        metrics.update({f"optim/{k}": v for k, v in opt_metrics.items()})
        metrics["optim/lr"] = self.optimizer.lr
        metrics["train/micro_batches"] = len(micro)
        metrics["train/routing_replay"] = float(self.routing_replay)
        metrics = self._mean_over_dp(metrics)
        if turn_stats is not None:
            self.turn_stats = self._union_over_dp(turn_stats.result())
        event = self.objective.end_step(metrics.get("entropy/gated"))
        if event is not None:
            metrics["kl/guard_event"] = 1.0
        return metrics

    def _union_over_dp(self, stats: TurnStats) -> TurnStats:
        """Every DP rank's per-turn records, on every rank (rollout ids are disjoint)."""
        group = self.ctx.group(Axis.DP)
        size = dist.get_world_size(group)
        if size == 1:
            return stats
        everyone: list[TurnStats] = [{} for _ in range(size)]
        dist.all_gather_object(everyone, stats, group=group)
        return {rid: turns for part in everyone for rid, turns in part.items()}

    def _mean_over_dp(self, metrics: dict[str, float]) -> dict[str, float]:
        """Mean of each metric over the DP ranks that have it (ranks may lack a metric, e.g.
        gated entropy on a rank with nothing gated), so key sets need not match."""
        group = self.ctx.group(Axis.DP)
        size = dist.get_world_size(group)
        if size == 1:
            return metrics
        everyone: list[dict[str, float]] = [{} for _ in range(size)]
        dist.all_gather_object(everyone, metrics, group=group)
        keys = sorted({k for m in everyone for k in m})
        out = {}
        for k in keys:
            have = [m[k] for m in everyone if k in m]
            if k.endswith(_EXTREMA):
                out[k] = max(have) if k.endswith("_max") else min(have)
            else:
                out[k] = sum(have) / len(have)
        return out

    @property
    def gpt(self):
        return unwrap(self.model)
