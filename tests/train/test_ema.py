"""The EMA expert in bf16 at the paper's lr (3e-6): its fp32 average follows the closed form
e_k = d·e_{k−1} + (1 − d)·m_k of the optimizer's fp32 masters m_k, the expert's bf16 weights
are that average rounded, and a bf16 lerp (the old update) would have stayed frozen. Two DP
ranks hold disjoint halves of the average; a resume restores it exactly."""

from __future__ import annotations

import torch

from megatron_tg.testing.distributed import run_distributed
from tests.train.common import make_samples
from tests.train.test_trainer import checkpoint  # noqa: F401  (the fixture)

DECAY = 0.99


def _ema_fn(rank, world, overrides, samples):
    from megatron_tg.config import load_config
    from megatron_tg.train.trainer import Trainer

    cfg = load_config("recipes/tiny_cpu.yaml", overrides)
    trainer = Trainer(cfg)
    names = trainer.ema.names
    full = lambda: {n: t.double() for n, t in trainer.ema.full_state().items()}  # noqa: E731
    index = {id(p): i for i, p in enumerate(trainer.optimizer.params)}
    masters = lambda: {n: trainer.optimizer.main[index[id(s.param)]].detach().double().clone()  # noqa: E731
                       for n, s in zip(names, trainer.ema.shards)}
    history = [(full(), masters())]
    shard_numel = sum(e.numel() for e in trainer.ema.ema)
    dp = trainer.ctx.dims.dp
    for _ in range(2):
        trainer.train_step(samples[rank % dp::dp])
        history.append((full(), masters()))
    expert = {n: p.detach().clone() for n, p in trainer.expert_model.named_parameters()}
    trainer.save({})
    trainer.checkpointer.finalize(blocking=True)  # an async save completes before a resume sees it
    again = Trainer(cfg)
    again.resume()
    return dict(history=history, expert=expert, resumed=again.ema.full_state(),
                resumed_main=[m.detach().clone() for m in again.optimizer.main],
                main=[m.detach().clone() for m in trainer.optimizer.main],
                shard_numel=shard_numel, total=sum(p.numel() for p in trainer.gpt.parameters()),
                dtype=str(next(trainer.gpt.parameters()).dtype))


def test_bf16_ema_moves_by_the_closed_form(checkpoint, tmp_path):  # noqa: F811
    d, tok, cfg, state = checkpoint
    samples = make_samples(tok, cfg, state)
    out = run_distributed(_ema_fn, 2, [
        f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
        "model.params_dtype=bfloat16", "rollout.max_context_tokens=1024", "optimizer.lr=3e-6",
        "optimizer.micro_batch_tokens=4096", "objective.expert=ema",
        f"objective.ema_decay={DECAY}", "objective.kl_coef=0.5",
        f"checkpoint.dir={tmp_path}/ckpt", f"logging.run_dir={tmp_path}/run"], samples,
        timeout=600)
    r0 = out[0]
    assert r0["dtype"] == "torch.bfloat16"
    # Sharded: each of the 2 DP ranks holds half of the fp32 average.
    assert r0["shard_numel"] + out[1]["shard_numel"] == r0["total"]
    assert abs(r0["shard_numel"] - out[1]["shard_numel"]) <= 2 * len(r0["history"][0][0])
    hist = r0["history"]
    moved, frozen_in_bf16, n_elems = 0.0, 0.0, 0
    eps = torch.finfo(torch.float32).eps
    for k in range(1, len(hist)):
        (ema_k, master_k), prev = hist[k], hist[k - 1][0]
        step, want_step = [], []
        for n in prev:
            want = DECAY * prev[n] + (1 - DECAY) * master_k[n]
            # One fp32 lerp per step: within a rounding of the closed form.
            assert ((ema_k[n] - want).abs() <= eps * want.abs() + 1e-12).all(), n
            step.append((ema_k[n] - prev[n]).abs().reshape(-1))
            want_step.append((want - prev[n]).abs().reshape(-1))
        step, want_step = torch.cat(step), torch.cat(want_step)
        # The step's movement in aggregate equals the closed form's (rounding averages out).
        assert abs(step.mean().item() / want_step.mean().item() - 1) < 0.02
        print(f"step {k}: EMA moves by mean {step.mean().item():.3g}, max "
              f"{step.max().item():.3g} (closed form {want_step.mean().item():.3g}, "
              f"{want_step.max().item():.3g})")
    for n, e0 in hist[0][0].items():
        trained = hist[-1][1][n] != hist[0][1][n]  # weights with a gradient (a used expert, ...)
        moved += float((hist[-1][0][n] != e0)[trained].sum())
        n_elems += int(trained.sum())
        # The old update: lerp in bf16 from the bf16 weights, each step.
        pe = e0.bfloat16()
        for k in range(1, len(hist)):
            pe = pe.lerp(hist[k][1][n].bfloat16(), 1 - DECAY)
        frozen_in_bf16 += float((pe.double() == e0.bfloat16().double())[trained].sum())
    print(f"of {n_elems} trained weights, fp32 EMA moved {moved / n_elems:.3f}; "
          f"a bf16 lerp left {frozen_in_bf16 / n_elems:.3f} frozen")
    assert moved / n_elems > 0.9 and frozen_in_bf16 / n_elems > 0.9
    # The expert's bf16 weights are the fp32 average rounded.
    for n, w in r0["expert"].items():
        assert torch.equal(w, hist[-1][0][n].to(w.dtype)), n
    # Resume restores the fp32 average and the fp32 masters exactly.
    for n, t in r0["resumed"].items():
        assert torch.equal(t.double(), hist[-1][0][n]), n
    for a, b in zip(r0["resumed_main"], r0["main"]):
        assert torch.equal(a, b)
