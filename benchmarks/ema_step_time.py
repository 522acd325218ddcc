"""Train-step time of the EMA expert, gathered and replicated, against the shared expert.

Compares, on the same batch and the same policy in one run (interleaved repetitions, after a
warm-up, so load drift on a shared machine hits all alike), the time of one TG optimizer step
(``run_step`` + gradient finalisation + optimizer step + the EMA update) with:

* ``shared``: the live policy as the expert, with prefix reuse (the default);
* ``ema_replicated``: the EMA expert with a persistent copy, refreshed after every update
  (``objective.ema_weights=replicated``, :mod:`megatron_tg.train.ema`);
* ``ema_gathered``: the EMA expert gathered layer by layer at each micro-batch's expert pass
  (``ema_weights=gathered``, ``ema_gather_scope=layer``, :mod:`megatron_tg.train.ema_gather`);
* ``ema_gathered_step``: gathered once per step (``ema_gather_scope=step``).

The model has the CPU demo's shape (``megatron_tg/demo/base_model.py``'s defaults: hidden 64,
3 layers, 4 heads / 2 KV heads, 4 experts top-2, expert width 128), with the test tokenizer's
vocabulary in place of the demo's 512 tokens (the rollouts are the trainer tests' fixture
conversations); fp32, two gloo ranks (DP 2, so the gathers are real collectives), each with
its half of the rollouts in ``--micro`` micro-batches. Printed: the median step time per
variant and each EMA variant's ratio to ``shared``.

    python benchmarks/ema_step_time.py [--reps 7] [--rollouts 8] [--micro 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.* fixtures

DEMO_SHAPE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=128, intermediate_size=128)
VARIANTS = ("shared", "ema_replicated", "ema_gathered", "ema_gathered_step")


def _rank_fn(rank, world, state, hf_cfg, samples, tok_dir, reps, micro):
    import torch
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
    from megatron_tg.train.ema import ShardedEMA
    from megatron_tg.train.ema_gather import GatheredEMA
    from megatron_tg.train.optim import build_optimizer
    from megatron_tg.train.pass_plan import build_pass_plan
    from megatron_tg.train.step import run_step

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ctx = init_parallel()
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch)
    load_hf_weights(model, state, arch, current_layout())
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    optimizer = build_optimizer(ddp, OptimizerConfig(lr=1e-5))
    local = samples[ctx.rank_in(Axis.DP)::ctx.dims.dp]
    row = max(len(s.rollout.token_ids) for s in samples)

    def expert_copy():
        e = build_model(arch)
        e.load_state_dict(model.state_dict())
        for p in e.parameters():
            p.requires_grad_(False)
        return e.eval()

    setups = {}
    for name in VARIANTS:
        shared = name == "shared"
        cfg = ObjectiveConfig(mode="tg", kl_coef=0.5, kl_direction="forward",
                              expert="shared" if shared else "ema")
        mbs = [build_micro_batch(local[k::micro], tok, cfg, row_tokens=row, prefix_reuse=shared)
               for k in range(micro) if local[k::micro]]
        expert = ema = weights = None
        if not shared:
            expert = expert_copy()
            ema = ShardedEMA(optimizer, expert, model, 0.99, replicated=name == "ema_replicated")
            if name != "ema_replicated":
                weights = GatheredEMA(ema, expert, "step" if name.endswith("step") else "layer")
        totals = dict(num_rollouts=float(len(local)),
                      num_assistant_tokens=float(sum(int(m.policy.loss_mask.sum()) for m in mbs)),
                      num_gated_tokens=float(sum(float(m.policy.gate.sum()) for m in mbs)))
        setups[name] = (TGObjective(cfg), mbs, expert, ema, weights, totals)

    times = {m: [] for m in VARIANTS}
    for rep in range(reps + 1):
        for name, (objective, mbs, expert, ema, weights, totals) in setups.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            optimizer.zero_grad()
            run_step(ddp, objective, mbs, build_pass_plan(mbs, ep=1), vocab_size=arch.vocab_size,
                     expert_model=expert, expert_weights=weights,
                     prefix_reuse=name == "shared", **totals)
            finalize_model_grads([ddp])
            optimizer.step()
            if ema is not None:
                ema.update()
            dt = time.perf_counter() - t0
            if rep:  # rep 0 is warm-up
                times[name].append(dt)
    gathered = setups["ema_gathered"][4]
    return {"times": times, "micro_batches": len(setups["shared"][1]),
            "gathers": gathered.gathers, "units": len(gathered.units),
            "params": sum(p.numel() for p in model.parameters())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per DP rank")
    args = ap.parse_args(argv)

    import platform

    import torch

    from megatron_tg.chat import get_tiny_tokenizer
    from megatron_tg.testing.distributed import run_distributed
    from tests.models.qwen3_moe.common import tiny_hf_model
    from tests.train.common import make_samples

    tok = get_tiny_tokenizer()
    cfg, _, state = tiny_hf_model(vocab_size=len(tok), **DEMO_SHAPE)
    cfg = cfg.to_dict()
    samples = make_samples(tok, cfg, state, n=args.rollouts)
    out = run_distributed(_rank_fn, 2, state, cfg, samples, tok.name_or_path, args.reps,
                          args.micro, timeout=3600)
    # A step takes as long as its slower rank.
    steps = {m: [max(r["times"][m][i] for r in out) for i in range(args.reps)] for m in VARIANTS}
    med = {m: statistics.median(t) for m, t in steps.items()}
    r0 = out[0]
    print(f"torch {torch.__version__}, {platform.machine()}, 2 gloo ranks (DP 2), fp32, "
          f"{os.environ.get('BENCH_THREADS', '1')} thread(s) per rank; model: the CPU demo's "
          f"shape, {r0['params']:,} params; {args.rollouts} rollouts, {r0['micro_batches']} "
          f"micro-batches per rank; median of {args.reps}")
    for m in VARIANTS:
        ts = steps[m]
        print(f"{m:18s} step: median {med[m] * 1e3:8.1f} ms  (min {min(ts) * 1e3:.1f}, "
              f"max {max(ts) * 1e3:.1f})")
    print("ratio " + "  ".join(f"{m}/shared {med[m] / med['shared']:.3f}" for m in VARIANTS[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
