"""megatron's DistributedOptimizer (the GPU recipes' optimizer) on CPU under gloo.

At DP 2 (fp32 and bf16, with EP 2, and at TP 2 x DP 2 on 4 ranks), one TG step through
megatron DDP's sharded grad buffers and the distributed optimizer gives the weights of the
CPU AdamW path (:class:`CPUAdamW`) at the same settings, on every rank (the parameter
all-gather ran). Its grad norm, the number the loop logs, is the norm of the DP-averaged
gradient computed here from the gradients themselves, and with Adam's epsilon large enough
for the first step to be linear in the gradient, the update equals the closed-form clipped
step (and not the unclipped one).

Its sharded state, saved by the trainer's checkpointer in megatron's ``dp_reshardable``
format, resumes at another DP size: saved at DP 2 after step 2, resumed at DP 1 for step 3
(saved again), resumed at DP 2 for step 4; each resumed step's weights equal the
uninterrupted DP 2 run's. A resume at another TP size is refused, naming both layouts.

The trainer with ``parallel.use_distributed_optimizer=true`` on the CPU default recipe (DP 2,
EMA expert): the loop's ``optim/grad_norm`` is megatron's and the step is the default path's;
the EMA follows the distributed optimizer's main shards; a save resumes both exactly.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.train.common import make_samples, tiny_policy
from tests.train.test_trainer import checkpoint  # noqa: F401  (the fixture)

# Every test here under NCCL's rules (tests/conftest.py: comm_rules; plain gloo on request).
pytestmark = pytest.mark.usefixtures("comm_rules")

# (name, optimizer kind, params dtype, TP, EP, OptimizerConfig fields)
CLIP = dict(lr=1e-3, grad_clip=1.0)
RUNS = [("dist", "distributed", "float32", 1, 1, CLIP),
        ("adamw", "cpu_adamw", "float32", 1, 1, CLIP),
        ("dist_bf16", "distributed", "bfloat16", 1, 1, CLIP),
        ("adamw_bf16", "cpu_adamw", "bfloat16", 1, 1, CLIP),
        # EP 2 over the same 2 ranks: dense weights sharded over DP 2, experts over expert-DP 1
        # (two DistributedOptimizers), the norm summed over the expert-parallel ranks.
        ("dist_ep2", "distributed", "float32", 1, 2, CLIP),
        ("adamw_ep2", "cpu_adamw", "float32", 1, 2, CLIP),
        # eps >> |g|: Adam's first step is lr * g / (|g| + eps), linear in the (clipped) g.
        ("dist_linear", "distributed", "float32", 1, 1, dict(CLIP, eps=1e-2))]
# 4 ranks, TP 2 x DP 2: TP-replicated weights (norms, router) count once in the norm.
RUNS_TP2 = [("dist_tp2", "distributed", "float32", 2, 1, CLIP),
            ("adamw_tp2", "cpu_adamw", "float32", 2, 1, CLIP)]


def _one_step_fn(rank, world, state, hf_cfg, samples, tok_dir, runs):
    """For each run: build the tiny policy at the run's TP and EP, one TG micro-batch per DP
    rank, one optimizer step. Returns the weights before/after, the DP-averaged gradients and the step's metrics."""
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
    from megatron_tg.train.step import ops_reduce_hidden_grad, run_step

    tok = AutoTokenizer.from_pretrained(tok_dir)
    arch = Qwen3Arch.from_hf(hf_cfg)
    obj_cfg = ObjectiveConfig(mode="tg", kl_coef=0.5)
    row = 2 * max(len(s.rollout.token_ids) for s in samples)
    out = {}
    for name, kind, dtype, tp, ep, opt_fields in runs:
        ctx = init_parallel(tp=tp, ep=ep, etp=1 if ep > 1 else tp, seed=3)
        dp, dp_rank = ctx.dims.dp, ctx.rank_in(Axis.DP)
        distributed = kind == "distributed"
        params_dtype = getattr(torch, dtype)
        model = build_model(arch, tp=tp, ep=ep, etp=1 if ep > 1 else tp,
                            params_dtype=params_dtype)
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
        mb = build_micro_batch(samples[dp_rank::dp], tok, obj_cfg, row_tokens=row,
                               pad_multiple=tp)
        opt.zero_grad()
        # Forward and backward through the trainer's schedule path (one micro-batch).
        loss = run_step(ddp, objective, [mb], vocab_size=arch.vocab_size)[0].loss
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
                         optimizer=type(opt.opt).__name__,
                         parts=len(getattr(opt.opt, "chained_optimizers", [])))
    return out


def _own_range_summed(opt, param, grad):
    """``grad`` with every element outside this rank's distributed-optimizer range zeroed and
    the result summed over the ranks that shard ``param`` (the DP group, or for an expert the
    expert-DP group): each element from the one rank that owns it. A rank owning
    none of ``param`` adds zeros."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    flat = torch.zeros_like(grad).view(-1)
    for o in opt.opt.chained_optimizers:
        if param in o.model_param_group_index_map:
            r = o._get_model_param_range_map(param)["param"]
            flat[r.start:r.end] = grad.view(-1)[r.start:r.end]
    expert = not getattr(param, "allreduce", True)
    dist.all_reduce(flat, group=mps.get_expert_data_parallel_group() if expert
                    else mps.get_data_parallel_group())
    return flat.view_as(grad)


@pytest.fixture(scope="module")
def steps(comm_rules):  # runs ranks: once per rule set
    tok, cfg, state = tiny_policy()
    samples = make_samples(tok, cfg, state)
    return run_distributed(_one_step_fn, 2, state, cfg, samples, tok.name_or_path, RUNS)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _norm(grads: dict) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def test_one_step_equals_the_adamw_path_at_dp2(steps):
    for dist_run, ref_run in (("dist", "adamw"), ("dist_bf16", "adamw_bf16"),
                              ("dist_ep2", "adamw_ep2")):
        d0, d1 = steps[0][dist_run], steps[1][dist_run]
        assert d0["optimizer"] == "ChainedOptimizer"
        if dist_run != "dist_ep2":
            # The parameter all-gather ran: both ranks hold the same, updated weights.
            assert _max_diff(d0["after"], d1["after"]) == 0.0
        else:  # each rank holds its own experts; the dense weights are gathered
            dense = [n for n in d0["after"] if "experts" not in n]
            assert len(dense) < len(d0["after"])
            assert max((d0["after"][n] - d1["after"][n]).abs().max() for n in dense) == 0.0
        assert _max_diff(d0["after"], d0["before"]) > 1e-4
        diff = 0.0
        for rank in (0, 1):
            d, ref = steps[rank][dist_run], steps[rank][ref_run]
            assert _max_diff(d["before"], ref["before"]) == 0.0
            assert _max_diff(d["grads"], ref["grads"]) == 0.0, (dist_run, rank)
            diff = max(diff, _max_diff(d["after"], ref["after"]))
        ref = steps[0][ref_run]
        layout = "DP 2 x EP 2" if dist_run == "dist_ep2" else "DP 2"
        print(f"{dist_run} vs {ref_run} at {layout}: max |w_dist - w_adamw| = {diff:.3e}, "
              f"grad norm {d0['metrics']['grad_norm']:.9f} vs {ref['metrics']['grad_norm']:.9f}")
        assert diff <= 1e-6, (dist_run, diff)
        assert d0["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"],
                                                           rel=1e-6)
        assert d0["metrics"]["skipped"] == 0.0
    # The same global gradient at EP 2: megatron sums the expert part over the EP ranks.
    assert steps[0]["dist_ep2"]["parts"] == 2  # dense and expert DistributedOptimizers
    assert steps[0]["dist_ep2"]["metrics"]["grad_norm"] == pytest.approx(
        steps[0]["dist"]["metrics"]["grad_norm"], rel=1e-5)


def test_one_step_at_tp2_dp2(steps):
    tok, cfg, state = tiny_policy()
    samples = make_samples(tok, cfg, state)
    out = run_distributed(_one_step_fn, 4, state, cfg, samples, tok.name_or_path, RUNS_TP2)
    diff = 0.0
    for rank_out in out:
        d, ref = rank_out["dist_tp2"], rank_out["adamw_tp2"]
        assert _max_diff(d["grads"], ref["grads"]) == 0.0
        assert _max_diff(d["after"], d["before"]) > 1e-4
        diff = max(diff, _max_diff(d["after"], ref["after"]))
        # The same global gradient as at TP 1: the norm counts TP duplicates once.
        assert d["metrics"]["grad_norm"] == pytest.approx(
            steps[0]["dist"]["metrics"]["grad_norm"], rel=1e-5)
    norm = out[0]["dist_tp2"]["metrics"]["grad_norm"]
    ref_norm = out[0]["adamw_tp2"]["metrics"]["grad_norm"]
    print(f"dist_tp2 vs adamw_tp2 at TP 2 x DP 2: max |w_dist - w_adamw| = {diff:.3e}, "
          f"grad norm {norm:.9f} vs {ref_norm:.9f}")
    assert diff <= 1e-6


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
    assert clipped < 5e-7 and unclipped > 1e-5  # a few float32 ulps of weights near 1


def _resume_fn(rank, world, state, hf_cfg, samples, tok_dir, ckpt_root, first, last, save_at):
    """Steps ``first+1 .. last`` with the distributed optimizer at DP = world (TP = 1); with
    ``first`` > 0 the model and optimizer come from the checkpoint of step ``first`` (the
    model built with other weights, so only the checkpoint can supply them). Saves after
    step ``save_at``. Returns per step: the DP-mean loss and the weights after it."""
    import torch.distributed as dist
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
    from megatron_tg.train.checkpoint import Checkpointer
    from megatron_tg.train.optim import build_optimizer
    from megatron_tg.train.step import ops_reduce_hidden_grad, run_step

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ctx = init_parallel(tp=1, seed=7)
    dp, dp_rank = ctx.dims.dp, ctx.rank_in(Axis.DP)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=1)
    if first == 0:
        load_hf_weights(model, state, arch, current_layout())
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(
                                      grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    opt = build_optimizer(ddp, OptimizerConfig(lr=1e-3, grad_clip=1.0), distributed=True)
    obj_cfg = ObjectiveConfig(mode="tg", kl_coef=0.5)
    objective = TGObjective(obj_cfg, group=ctx.group(Axis.TP),
                            reduce_hidden_grad=ops_reduce_hidden_grad(ddp))
    ckpt = Checkpointer(ckpt_root, keep_last=2)
    if first:
        assert ckpt.load(ckpt.latest(), ddp, opt)["step"] == first
        assert opt.num_steps == first
    row = 2 * max(len(s.rollout.token_ids) for s in samples)
    out = []
    for step in range(first, last):
        # Advantages vary by step, so each step's gradient differs.
        batch = [s.__class__(s.rollout, s.advantage * (1 + 0.5 * step), s.feedback_by_turn)
                 for s in samples]
        mb = build_micro_batch(batch[dp_rank::dp], tok, obj_cfg, row_tokens=row)
        opt.zero_grad()
        # Forward and backward through the trainer's schedule path (one micro-batch).
        loss = run_step(ddp, objective, [mb], vocab_size=arch.vocab_size)[0].loss
        finalize_model_grads([ddp])
        assert opt.step()["skipped"] == 0.0
        # the step's loss comes back on the host (run_step: .cpu()); NCCL reduces device memory
        mean = loss.detach().to(next(model.parameters()).device, copy=True)
        dist.all_reduce(mean)
        out.append(dict(loss=mean / dp,
                        weights={n: p.detach().clone() for n, p in model.named_parameters()}))
        if step + 1 == save_at:
            ckpt.save(save_at, ddp, opt, {})
    return out


def test_sharded_state_resumes_at_another_dp_size(tmp_path):
    tok, cfg, state = tiny_policy()
    samples = make_samples(tok, cfg, state)
    root = str(tmp_path / "ckpt")
    args = (state, cfg, samples, tok.name_or_path, root)
    whole = run_distributed(_resume_fn, 2, *args, 0, 4, 2)[0]  # uninterrupted DP 2, saves at 2
    fmt = json.loads((tmp_path / "ckpt" / "step_00000002" / "dist" / "metadata.json").read_text())
    assert fmt["sharded_backend"] == "torch_dist"
    dp1 = run_distributed(_resume_fn, 1, *args, 2, 3, 3)[0]  # DP 2 -> DP 1: step 3, save
    dp2 = run_distributed(_resume_fn, 2, *args, 3, 4, 0)[0]  # DP 1 -> DP 2: step 4
    # The weights the checkpoint restored, then the step that used the restored Adam state.
    diff3 = _max_diff(dp1[0]["weights"], whole[2]["weights"])
    diff4 = _max_diff(dp2[0]["weights"], whole[3]["weights"])
    moved = _max_diff(whole[3]["weights"], whole[2]["weights"])
    print(f"resumed DP2->DP1 step 3: max |dw| = {diff3:.3e}; DP1->DP2 step 4: {diff4:.3e} "
          f"(the step itself moves weights by up to {moved:.3e}); losses "
          f"{float(dp1[0]['loss']):.7f}/{float(whole[2]['loss']):.7f}, "
          f"{float(dp2[0]['loss']):.7f}/{float(whole[3]['loss']):.7f}")
    torch.testing.assert_close(dp1[0]["loss"], whole[2]["loss"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dp2[0]["loss"], whole[3]["loss"], atol=1e-6, rtol=1e-5)
    assert moved > 1e-4 and diff3 < 1e-6 and diff4 < 1e-6


def _trainer_fn(rank, world, overrides, samples):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_tg.config import load_config
    from megatron_tg.train.trainer import Trainer

    cfg = load_config("recipes/tiny_cpu.yaml", overrides)
    trainer = Trainer(cfg)
    inner = getattr(trainer.optimizer, "opt", None)
    kinds = sorted({type(o).__name__ for o in getattr(inner, "chained_optimizers", [inner])})
    flat = lambda m: torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()])  # noqa: E731
    before = flat(trainer.gpt), flat(trainer.expert_model)
    dp = trainer.ctx.dims.dp
    metrics = trainer.train_step(samples[rank % dp::dp])
    after = flat(trainer.gpt), flat(trainer.expert_model)
    trainer.save({})
    trainer.checkpointer.finalize(blocking=True)  # an async save completes before a resume sees it
    again = Trainer(cfg)  # the base weights again, then the checkpoint
    again.resume()
    return dict(kinds=kinds, metrics=metrics, before=before, after=after,
                resumed=(flat(again.gpt), flat(again.expert_model)),
                sharded_main=DistributedOptimizer.__name__ in kinds
                and sum(s.main.numel() for s in trainer.ema.shards))


def test_trainer_uses_megatron_s_distributed_optimizer(checkpoint, tmp_path):  # noqa: F811
    d, tok, cfg, state = checkpoint
    samples = make_samples(tok, cfg, state)
    decay = 0.9
    base = [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "optimizer.lr=1e-3", "objective.kl_coef=0.5",
            "optimizer.micro_batch_tokens=4096", "objective.expert=ema",
            f"objective.ema_decay={decay}", f"logging.run_dir={tmp_path}/run"]
    dist = run_distributed(_trainer_fn, 2, base + ["parallel.use_distributed_optimizer=true",
                                                   f"checkpoint.dir={tmp_path}/dist"], samples)
    ref = run_distributed(_trainer_fn, 2, base + [f"checkpoint.dir={tmp_path}/ref"], samples)
    out, r = dist[0], ref[0]
    assert out["kinds"] == ["DistributedOptimizer"] and r["kinds"] == ["AdamW"]
    norm, ref_norm = out["metrics"]["optim/grad_norm"], r["metrics"]["optim/grad_norm"]
    assert norm == pytest.approx(ref_norm, rel=1e-6) and norm > 1.0  # clipped at 1.0
    assert out["metrics"]["loss"] == r["metrics"]["loss"]
    p0, e0 = out["before"]
    p1, e1 = out["after"]
    diff = (p1 - r["after"][0]).abs().max().item()
    print(f"trainer at DP 2: distributed vs AdamW max |dw| = {diff:.3e}, grad norm "
          f"{norm:.9f} vs {ref_norm:.9f}")
    assert diff <= 1e-6 and (p1 - p0).abs().max() > 1e-4
    # Each DP rank averages its half of the main parameters; the expert gets the whole EMA.
    assert 0 < out["sharded_main"] < p0.numel()
    assert out["sharded_main"] + dist[1]["sharded_main"] == p0.numel()
    torch.testing.assert_close(e1, decay * e0 + (1 - decay) * p1, atol=1e-7, rtol=1e-6)
    for rank_out in dist:
        assert torch.equal(rank_out["resumed"][0], p1) and torch.equal(rank_out["resumed"][1], e1)


def _layout_fn(rank, world, state, hf_cfg, ckpt_root, tp, mode):
    """Build the policy at TP ``tp`` with the distributed optimizer; save its (initialised)
    state, or load the newest checkpoint. Returns the error a load raised, if any."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_tg.config.train import OptimizerConfig
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.checkpoint import Checkpointer
    from megatron_tg.train.optim import build_optimizer

    init_parallel(tp=tp, seed=7)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=tp)
    load_hf_weights(model, state, arch, current_layout())
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(
                                      grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    opt = build_optimizer(ddp, OptimizerConfig(), distributed=True)
    ckpt = Checkpointer(ckpt_root)
    if mode == "save":
        # megatron's torch-AdamW state_dict needs the state a first step creates (the trainer
        # saves only after steps); megatron's zero-gradient initialiser stands in for one.
        opt._materialise_torch_adam_state()
        ckpt.save(1, ddp, opt, {})
        return None
    try:
        ckpt.load(ckpt.latest(), ddp, opt)
    except ValueError as exc:
        return str(exc)
    return None


def test_resume_at_another_model_layout_is_refused(tmp_path):
    tok, cfg, state = tiny_policy()
    root = str(tmp_path / "ckpt")
    run_distributed(_layout_fn, 2, state, cfg, root, 1, "save")  # TP 1 x DP 2
    errors = run_distributed(_layout_fn, 2, state, cfg, root, 2, "load")  # TP 2 x DP 1
    for err in errors:
        assert err is not None and "saved at tp=1, pp=1, ep=1, etp=1" in err
        assert "this run has tp=2" in err and "data-parallel size only" in err
