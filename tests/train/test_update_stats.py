"""logging.update_stats: the step's weight update, measured on the optimizer's main shards,
equals the update read off the model's parameters, and each element is counted once under
DP (the distributed optimizer's shards) and TP (replicated norms)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.train.common import make_samples
from tests.train.test_trainer import checkpoint  # noqa: F401 - the module's fixture


def _fn(rank, world, overrides, samples):
    from megatron_tg.config import load_config
    from megatron_tg.train.trainer import Trainer

    trainer = Trainer(load_config("recipes/tiny_cpu.yaml", overrides))
    dp = trainer.ctx.dims.dp
    before = [p.detach().double().clone() for p in trainer.gpt.parameters()]
    metrics = trainer.train_step(samples[rank % dp::dp] if dp > 1 else samples)
    # the independent reference (meaningful at world 1: every parameter whole on one rank)
    deltas = [p.detach().double() - b for p, b in zip(trainer.gpt.parameters(), before)]
    ref = {"norm": math.sqrt(sum(float(d.pow(2).sum()) for d in deltas)),
           "abs": sum(float(d.abs().sum()) for d in deltas),
           "n": sum(d.numel() for d in deltas), "lr": trainer.optimizer.lr}
    return metrics, ref


@pytest.mark.slow
def test_the_update_is_measured_once_per_element(checkpoint, tmp_path):  # noqa: F811
    d, tok, cfg, state = checkpoint
    samples = make_samples(tok, cfg, state)
    base = [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "objective.kl_coef=0.5", "optimizer.lr=1e-3",
            f"checkpoint.dir={tmp_path}/ckpt", f"logging.run_dir={tmp_path}/run",
            "logging.update_stats=true"]
    m1, ref = run_distributed(_fn, 1, base, samples)[0]
    assert m1["optim/update_norm"] == pytest.approx(ref["norm"], rel=1e-9)
    assert m1["optim/update_rms_over_lr"] == pytest.approx(
        ref["norm"] / math.sqrt(ref["n"]) / ref["lr"], rel=1e-9)
    assert m1["optim/update_abs_mean_over_lr"] == pytest.approx(ref["abs"] / ref["n"] / ref["lr"], rel=1e-9)
    # Adam's first step is about lr * sign(g) on every weight with a gradient (issue 38's H1)
    print({k: v for k, v in m1.items() if k.startswith("optim/update")})
    assert 0.5 < m1["optim/update_abs_mean_over_lr"] <= 1.0 + 1e-6
    # DP 2 through the distributed optimizer (each rank steps its shard), and TP 2
    # (norms replicated over TP): the same update as one rank, counted once.
    for extra in (["parallel.use_distributed_optimizer=true"], ["parallel.tp=2", "parallel.sequence_parallel=true"]):
        mw = run_distributed(_fn, 2, base + extra, samples)
        for m, _ in mw:
            # near-zero gradients flip sign with the reduction order; Adam turns that into
            # lr-sized steps on those elements, so this is close, not bit-equal
            assert m["optim/update_norm"] == pytest.approx(m1["optim/update_norm"], rel=2e-2), extra
            assert m["optim/update_abs_mean_over_lr"] == pytest.approx(
                m1["optim/update_abs_mean_over_lr"], rel=2e-2), extra


def test_after_without_before_is_an_error():
    from megatron_tg.train.update_stats import UpdateStats

    with pytest.raises(RuntimeError, match="without before"):
        UpdateStats(lambda: []).after(1e-3)
