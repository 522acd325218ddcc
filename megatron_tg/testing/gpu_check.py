"""The first-GPU-run check: what one CUDA GPU with only torch and megatron-core can prove.

    bash scripts/gpu_check.sh [OUT.json]          # one GPU, <= 8 minutes, no network
    python -m megatron_tg.testing.gpu_check --tiny --out x.json   # the same code on CPU

One process, a world of one (NCCL on GPU, gloo on CPU), megatron's local (non-Transformer
Engine) layers. Each check records its figures or its error in one JSON; the process exits 1
if any check failed. ``--tiny`` runs every check at test sizes, which is what CI runs
(tests/launch/test_gpu_check.py); on GPU the sizes are the recipes' where one GPU can hold
them:

* ``thd_bf16_vs_fp32``   packed (THD) forward + backward of a 2-layer Qwen3-30B-A3B-shaped
  model in bf16 against the same weights in fp32: max |Δ log-prob| and the cosine of the
  gradients;
* ``fused_kl``           the fused vocab-parallel KL loss at V = 151,936 against the naive
  path (full logits, log_softmax, kl_div): time and peak memory (CUDA's allocator peak; not
  measured on CPU) and the loss difference;
* ``distopt_resume``     megatron's distributed optimizer over torch's Adam: 2 steps, save
  (torch_dist, dp_reshardable), load into a fresh model and optimizer with the EMA expert
  built first (as the trainer does), 1 more step: moments and weights bit-exact. TE's
  FusedAdam cannot be checked here (no Transformer Engine); its state layout is covered on
  CPU by tests/train/test_fused_adam_resume.py;
* ``ema``                the sharded EMA on the optimizer's fp32 main params against the
  closed form d·θ_ema + (1 − d)·θ after each of 3 steps;
* ``tg_step``            one TG step (expert pass + student forward/backward through
  megatron's schedule, DDP, the optimizer) of a reduced-depth Qwen3-30B-A3B-shaped model:
  tokens/s and TFLOP/s (6 x active parameters per token plus the expert's forward) against
  the GPU's dense bf16 peak.

Not covered (needs Transformer Engine or SGLang): TE's fused attention and grouped GEMMs,
FusedAdam, FP8; the engines, weight sync into them and the log-prob probe; more than one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
QWEN3_30B = ROOT / "tests" / "fixtures" / "hf_configs" / "qwen3-coder-30b-a3b-instruct.json"
# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by device-name substring.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0,
                    "H100 NVL": 835.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0,
                    "L40S": 362.0}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _peak(fn: Callable[[], Any]) -> tuple[Any, float, float | None]:
    """(fn(), seconds, peak extra GiB allocated on the GPU; None on CPU)."""
    base = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    dt = time.perf_counter() - t0
    peak = None if base is None else (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return out, dt, peak


def _arch(tiny: bool, layers: int):
    from megatron_tg.models.qwen3_moe import Qwen3Arch

    cfg = json.loads(QWEN3_30B.read_text())
    cfg["num_hidden_layers"] = layers
    if tiny:  # the 30B's structure at test width
        cfg.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                   num_experts_per_tok=2, vocab_size=1024)
    return Qwen3Arch.from_hf(cfg)


def _rows(arch, lengths: list[int], seed: int = 0):
    """Packed THD rows of random token sequences of ``lengths``."""
    from megatron_tg.train.batching import pack

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist() for n in lengths]
    return seqs, pack(seqs, row_tokens=sum(lengths), pad_multiple=1)


def check_thd(tiny: bool) -> dict[str, Any]:
    from megatron_tg.models.qwen3_moe import build_model
    from megatron_tg.ops import fused_vocab_parallel_logprob
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.train.policy import forward_hidden

    from megatron_tg.parallel.state import init_parallel

    ctx = init_parallel()
    arch = _arch(tiny, 2)
    lengths = [40, 24] if tiny else [3000, 1096]
    seqs, rows = _rows(arch, lengths)
    targets = torch.tensor([t for s in seqs for t in s[1:]], device=_device())
    keep = torch.tensor([i for k, s in enumerate(seqs) for i in range(sum(lengths[:k]),
                         sum(lengths[:k]) + len(s) - 1)], device=_device())
    out = {}
    ref = build_model(arch, params_dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        model = ref if dtype == torch.float32 else build_model(arch, params_dtype=dtype)
        if model is not ref:
            model.load_state_dict({k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                                   for k, v in ref.state_dict().items()})
        model.zero_grad(set_to_none=True)
        h = forward_hidden(model, rows)
        lp = fused_vocab_parallel_logprob(h.hidden[0, keep], h.output_weight, targets,
                                          ctx.group(Axis.TP), vocab_size=arch.vocab_size)
        lp.float().sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        out[dtype] = (lp.detach().float(), grads)
    (lp32, g32), (lp16, g16) = out[torch.float32], out[torch.bfloat16]
    cos = float(torch.nn.functional.cosine_similarity(g32, g16, dim=0))
    diff = float((lp32 - lp16).abs().max())
    return {"tokens": sum(lengths), "sequences": len(lengths), "max_abs_logprob_diff": diff,
            "mean_abs_logprob_diff": float((lp32 - lp16).abs().mean()), "grad_cosine": cos,
            "ok": bool(diff < 0.5 and cos > 0.98)}


def check_fused_kl(tiny: bool) -> dict[str, Any]:
    from megatron_tg.ops import fused_vocab_parallel_kl_loss
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel

    ctx = init_parallel()
    dev = _device()
    t, h, v = (64, 32, 1024) if tiny else (4096, 2048, 151_936)
    g = torch.Generator(device=dev).manual_seed(0)
    hs = torch.randn(t, h, device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True)
    he = torch.randn(t, h, device=dev, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(v, h, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
    weights = torch.full((t,), 1.0 / t, device=dev)

    def fused():
        loss, _ = fused_vocab_parallel_kl_loss(hs, he, w, weights, ctx.group(Axis.TP),
                                               vocab_size=v, expert_weight_shard=w.detach())
        loss.backward()
        return loss.detach().float()

    def naive():
        ls = torch.log_softmax((hs @ w.t()).float(), -1)
        le = torch.log_softmax((he @ w.detach().t()).float(), -1)
        loss = (ls.exp() * (ls - le)).sum(-1).mul(weights).sum()  # reverse KL(π_s ‖ π_e)
        loss.backward()
        return loss.detach()

    out = {"tokens": t, "hidden": h, "vocab": v}
    for name, fn in (("fused", fused), ("naive", naive)):
        fn()  # warm-up
        hs.grad = w.grad = None
        loss, dt, peak = _peak(fn)
        out[name] = {"seconds": dt, "peak_gib": peak, "loss": float(loss)}
        hs.grad = w.grad = None
    out["loss_diff"] = abs(out["fused"]["loss"] - out["naive"]["loss"])
    out["ok"] = out["loss_diff"] <= 1e-2 * max(1.0, abs(out["naive"]["loss"]))
    return out


def _grads(model, step: int):
    g = torch.Generator().manual_seed(100 + step)
    return {n: (torch.randn(p.shape, generator=g) * 1e-2).to(p.main_grad.device)
            for n, p in model.named_parameters()}


def _opt_run(arch, root: str, resume: bool, steps: list[int]):
    """Distributed optimizer + EMA expert; load ``root``'s latest first when ``resume``."""
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)

    from megatron_tg.config.train import OptimizerConfig
    from megatron_tg.models.qwen3_moe import build_model
    from megatron_tg.train.checkpoint import Checkpointer
    from megatron_tg.train.ema import ShardedEMA
    from megatron_tg.train.optim import build_optimizer

    torch.manual_seed(1 if resume else 0)  # the resumed model starts from other weights
    model = build_model(arch, params_dtype=torch.bfloat16)
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=(
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)))
    opt = build_optimizer(ddp, OptimizerConfig(lr=1e-3, grad_clip=0.0), distributed=True, bf16=True)
    expert = build_model(arch, params_dtype=torch.bfloat16)
    expert.load_state_dict(model.state_dict())
    ema = ShardedEMA(opt, expert, model, decay=0.5)  # before any load, as the trainer builds it
    ckpt = Checkpointer(root, keep_last=2)
    if resume:
        ckpt.load(ckpt.latest(), ddp, opt, expert, ema)
    trace = []
    for i in steps:
        opt.zero_grad()
        for n, p in model.named_parameters():
            p.main_grad.copy_(_grads(model, i)[n])
        finalize_model_grads([ddp])
        opt.step()
        before = [e.clone() for e in ema.ema]
        mains = [s.main.float().clone() for s in ema.shards]
        ema.update()
        trace.append(max(float((e - (0.5 * b + 0.5 * m)).abs().max())
                         for e, b, m in zip(ema.ema, before, mains) if e.numel()))
    return ddp, opt, ema, expert, ckpt, trace


def _inner_state(opt) -> dict[str, torch.Tensor]:
    out = {}
    for k, o in enumerate(getattr(opt.opt, "chained_optimizers", [opt.opt])):
        for gi, group in enumerate(o.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                for n, t in o.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(t):
                        out[f"{k}.{gi}.{pi}.{n}"] = t.detach().clone()
    return out


def check_distopt_and_ema(tiny: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    from megatron_tg.parallel.state import init_parallel

    init_parallel()
    arch = _arch(tiny, 2)
    with tempfile.TemporaryDirectory() as root:
        ddp, opt, ema, expert, ckpt, trace = _opt_run(arch, root, False, [0, 1])
        ckpt.save(2, ddp, opt, {}, expert, ema)
        saved = _inner_state(opt)
        ddp2, opt2, _, _, _, _ = _opt_run(arch, root, True, [])
        loaded = _inner_state(opt2)
        moments_equal = saved.keys() == loaded.keys() and all(
            torch.equal(saved[k], loaded[k]) for k in saved)
        _step(ddp, opt, 2)  # the uninterrupted third step and the resumed one
        _step(ddp2, opt2, 2)
        weights_equal = all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ddp2.parameters()))
    resume = {"optimizer": type(opt.opt).__name__ + " over " + type(
        getattr(opt.opt, "chained_optimizers", [opt.opt])[0].optimizer).__name__,
        "state_tensors": len(saved), "moments_bit_exact": bool(moments_equal and saved),
        "next_step_bit_exact": bool(weights_equal),
        "note": "Transformer Engine's FusedAdam is not checked here (no TE); its state layout is "
                "tested on CPU (tests/train/test_fused_adam_resume.py)"}
    resume["ok"] = resume["moments_bit_exact"] and resume["next_step_bit_exact"]
    ema_out = {"steps": len(trace), "max_abs_err_vs_closed_form": max(trace), "shard_bytes":
               ema.shard_bytes, "ok": max(trace) <= 1e-6}
    return resume, ema_out


def _step(ddp, opt, i):
    from megatron.core.distributed import finalize_model_grads

    opt.zero_grad()
    model = ddp.module
    for n, p in model.named_parameters():
        p.main_grad.copy_(_grads(model, i)[n])
    finalize_model_grads([ddp])
    opt.step()


def check_tg_step(tiny: bool) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))  # tests.train.common: the rollout fixtures
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_tg.config.objective import ObjectiveConfig
    from megatron_tg.config.train import OptimizerConfig
    from megatron_tg.models.describe import param_counts
    from megatron_tg.models.qwen3_moe import build_model
    from megatron_tg.objectives import TGObjective
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.batching import build_micro_batch
    from megatron_tg.train.optim import build_optimizer
    from megatron_tg.train.step import ops_reduce_hidden_grad, run_step
    from tests.train.common import make_samples, tiny_policy

    ctx = init_parallel()
    layers = 2 if tiny else 4
    arch = _arch(tiny, layers)
    tok, cfg, state = tiny_policy()
    samples = make_samples(tok, cfg, state, n=4 if tiny else 8)
    model = build_model(arch, params_dtype=torch.bfloat16)
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=(
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)))
    opt = build_optimizer(ddp, OptimizerConfig(lr=1e-6), distributed=True, bf16=True)
    obj_cfg = ObjectiveConfig(mode="tg", kl_coef=0.1, expert_prefix_reuse=True)
    objective = TGObjective(obj_cfg, group=ctx.group(Axis.TP),
                            reduce_hidden_grad=ops_reduce_hidden_grad(ddp))
    reps = 1 if tiny else 16  # repeat the rollouts to a realistic micro-batch
    batch = samples * reps
    row = sum(s.num_tokens for s in batch)
    mb = build_micro_batch(batch, tok, obj_cfg, row_tokens=row, prefix_reuse=True)
    totals = dict(num_rollouts=len(batch), num_assistant_tokens=float(mb.policy.loss_mask.sum()),
                  num_gated_tokens=float(mb.policy.gate.sum()))

    def step():
        opt.zero_grad()
        outs = run_step(ddp, objective, [mb], vocab_size=arch.vocab_size, prefix_reuse=True, **totals)
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([ddp])
        opt.step()
        return float(outs[0].loss)

    step()  # warm-up
    loss, dt, peak = _peak(step)
    counts = param_counts(arch)
    student = int(mb.student.tokens.numel())
    expert_tokens = int(mb.expert.tokens.numel()) if mb.expert is not None else 0
    flops = 6 * counts["active_params"] * student + 2 * counts["active_params"] * expert_tokens
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak_tflops = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    tflops = flops / dt / 1e12
    return {"layers": layers, "of_layers": 48, "active_params": counts["active_params"],
            "student_tokens": student, "expert_tokens": expert_tokens, "seconds": dt,
            "tokens_per_s": student / dt, "tflops": tflops, "device": name,
            "bf16_peak_tflops": peak_tflops,
            "mfu": None if peak_tflops is None else tflops / peak_tflops,
            "peak_gib": peak, "loss": loss, "ok": bool(torch.isfinite(torch.tensor(loss)))}


def run_checks(tiny: bool) -> dict[str, Any]:
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                               else "cpu", "torch": torch.__version__, "tiny": tiny}
    try:
        import megatron.core

        results["megatron_core"] = getattr(megatron.core, "__version__", "?")
    except ImportError as exc:  # pragma: no cover - the one hard requirement
        results["megatron_core"] = f"missing: {exc}"

    def run(name, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # one broken check must not hide the others
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc(limit=8)}
        if isinstance(out, dict):
            out["wall_s"] = round(time.perf_counter() - t0, 2)
        return out

    results["thd_bf16_vs_fp32"] = run("thd", lambda: check_thd(tiny))
    results["fused_kl"] = run("kl", lambda: check_fused_kl(tiny))
    both = run("opt", lambda: check_distopt_and_ema(tiny))
    if isinstance(both, tuple):
        results["distopt_resume"], results["ema"] = both
    else:
        results["distopt_resume"] = results["ema"] = both
    results["tg_step"] = run("tg", lambda: check_tg_step(tiny))
    results["ok"] = all(results[k].get("ok") for k in
                        ("thd_bf16_vs_fp32", "fused_kl", "distopt_resume", "ema", "tg_step"))
    results["not_covered"] = ("Transformer Engine (fused attention, grouped GEMM, FusedAdam, FP8), "
                              "SGLang engines (weight sync, log-prob probe), more than one GPU")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json", help="the JSON to write")
    ap.add_argument("--tiny", action="store_true", help="test sizes (what CI runs on CPU)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.tiny:
        print("gpu_check: no CUDA device; run with --tiny for the CPU version", file=sys.stderr)
        return 2
    from megatron_tg.parallel.ports import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    results = run_checks(args.tiny)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(json.dumps({k: (v.get("ok") if isinstance(v, dict) else v) for k, v in results.items()}))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
