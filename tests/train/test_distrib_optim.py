"""megatron's DistributedOptimizer (the GPU recipes' optimizer) on CPU under gloo.

At DP 2, one TG step through megatron DDP's sharded grad buffers and the distributed
optimizer gives the weights of the CPU AdamW path (:class:`CPUAdamW`) at the same settings,
on both ranks (the parameter all-gather ran). Its grad norm, the number the loop logs, is the
norm of the DP-averaged gradient computed here from the gradients themselves, and with Adam's
epsilon large enough for the first step to be linear in the gradient, the update equals the
closed-form clipped step (and not the unclipped one).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.train.common import make_samples, tiny_policy

# (name, optimizer kind, params dtype, OptimizerConfig fields)
RUNS = [("dist", "distributed", "float32", dict(lr=1e-3, grad_clip=1.0)),
        ("adamw", "cpu_adamw", "float32", dict(lr=1e-3, grad_clip=1.0)),
        ("dist_bf16", "distributed", "bfloat16", dict(lr=1e-3, grad_clip=1.0)),
        ("adamw_bf16", "cpu_adamw", "bfloat16", dict(lr=1e-3, grad_clip=1.0)),
        # eps >> |g|: Adam's first step is lr * g / (|g| + eps), linear in the (clipped) g.
        ("dist_linear", "distributed", "float32", dict(lr=1e-3, grad_clip=1.0, eps=1e-2))]


def _one_step_fn(rank, world, state, hf_cfg, samples, tok_dir, runs):
    """For each run: build the tiny policy, one TG micro-batch per DP rank, one optimizer
    step. Returns the weights before/after, the DP-averaged gradients and the step's metrics."""
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from transformers import AutoTokenizer

    from megatron_tg.config.objective import ObjectiveConfig
    from megatron_tg.config.train import OptimizerConfig
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.objectives import TGObjective
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.batching import build_micro_batch
    from megatron_tg.train.optim import MegatronOptimizer, build_optimizer
    from megatron_tg.train.step import micro_batch_loss, ops_reduce_hidden_grad

    tok = AutoTokenizer.from_pretrained(tok_dir)
    arch = Qwen3Arch.from_hf(hf_cfg)
    obj_cfg = ObjectiveConfig(mode="tg", kl_coef=0.5)
    row = 2 * max(len(s.rollout.token_ids) for s in samples)
    out = {}
    for name, kind, dtype, opt_fields in runs:
        ctx = init_parallel(tp=1, seed=3)
        dp, dp_rank = ctx.dims.dp, ctx.rank_in(Axis.DP)
        distributed = kind == "distributed"
        params_dtype = getattr(torch, dtype)
        model = build_model(arch, tp=1, params_dtype=params_dtype)
        load_hf_weights(model, state, arch, current_layout())
        ddp = DistributedDataParallel(config=model.config, module=model,
                                      ddp_config=DistributedDataParallelConfig(
                                          grad_reduce_in_fp32=True,
                                          use_distributed_optimizer=distributed))
        opt = build_optimizer(ddp, OptimizerConfig(**opt_fields), distributed=distributed,
                              bf16=params_dtype == torch.bfloat16)
        assert isinstance(opt, MegatronOptimizer) == distributed
        before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        objective = TGObjective(obj_cfg, group=ctx.group(Axis.TP),
                                reduce_hidden_grad=ops_reduce_hidden_grad(ddp))
        mb = build_micro_batch(samples[dp_rank::dp], tok, obj_cfg, row_tokens=row)
        opt.zero_grad()
        loss = micro_batch_loss(ddp, objective, mb, vocab_size=arch.vocab_size).loss
        loss.backward()
        finalize_model_grads([ddp])
        # The DP-averaged gradient: whole on every rank without the distributed optimizer;
        # with it, DDP reduce-scatters and each rank's own range of the buffer is the sum.
        grads = {}
        for n, p in model.named_parameters():
            g = p.main_grad.detach().clone()
            if distributed:
                g = _own_range_summed(opt, p, g)
            grads[n] = g
        metrics = opt.step()
        after = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        out[name] = dict(before=before, after=after, grads=grads, metrics=metrics,
                         optimizer=type(opt.opt).__name__)
    return out


def _own_range_summed(opt, param, grad):
    """``grad`` with every element outside this rank's distributed-optimizer range zeroed and
    the result summed over the ranks (here: the DP group, TP = EP = 1): each element from the
    one rank that owns it. A rank owning none of ``param`` adds zeros."""
    import torch.distributed as dist

    flat = torch.zeros_like(grad).view(-1)
    for o in opt.opt.chained_optimizers:
        if param in o.model_param_group_index_map:
            r = o._get_model_param_range_map(param)["param"]
            flat[r.start:r.end] = grad.view(-1)[r.start:r.end]
    dist.all_reduce(flat)
    return flat.view_as(grad)


@pytest.fixture(scope="module")
def steps():
    tok, cfg, state = tiny_policy()
    samples = make_samples(tok, cfg, state)
    return run_distributed(_one_step_fn, 2, state, cfg, samples, tok.name_or_path, RUNS)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _norm(grads: dict) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def test_one_step_equals_the_adamw_path_at_dp2(steps):
    for dist_run, ref_run in (("dist", "adamw"), ("dist_bf16", "adamw_bf16")):
        d0, d1 = steps[0][dist_run], steps[1][dist_run]
        assert d0["optimizer"] == "ChainedOptimizer"  # dense + expert DistributedOptimizers
        # The parameter all-gather ran: both ranks hold the same, updated weights.
        assert _max_diff(d0["after"], d1["after"]) == 0.0
        assert _max_diff(d0["after"], d0["before"]) > 1e-4
        ref = steps[0][ref_run]
        assert _max_diff(d0["before"], ref["before"]) == 0.0
        assert _max_diff(d0["grads"], ref["grads"]) == 0.0, dist_run
        diff = _max_diff(d0["after"], ref["after"])
        print(f"{dist_run} vs {ref_run} at DP 2: max |w_dist - w_adamw| = {diff:.3e}, "
              f"grad norm {d0['metrics']['grad_norm']:.9f} vs {ref['metrics']['grad_norm']:.9f}")
        assert diff <= 1e-6, (dist_run, diff)
        assert d0["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"],
                                                           rel=1e-6)
        assert d0["metrics"]["skipped"] == 0.0


def test_grad_norm_and_clipping_are_megatron_s(steps):
    run = steps[0]["dist_linear"]
    norm = _norm(run["grads"])
    assert norm > 1.0  # the clip at 1.0 bites
    assert run["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert steps[1]["dist_linear"]["metrics"]["grad_norm"] == run["metrics"]["grad_norm"]
    lr, eps, clip = 1e-3, 1e-2, 1.0

    def adam_first_step(scale):
        return {n: run["before"][n] - lr * (scale * g) / ((scale * g).abs() + eps)
                for n, g in run["grads"].items()}

    clipped = _max_diff(run["after"], adam_first_step(clip / (norm + 1e-6)))
    unclipped = _max_diff(run["after"], adam_first_step(1.0))
    print(f"closed-form clipped Adam step: max diff {clipped:.3e} (unclipped: {unclipped:.3e})")
    assert clipped < 1e-7 and unclipped > 1e-5
