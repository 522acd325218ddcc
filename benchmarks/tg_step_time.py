"""TG train-step time / GRPO train-step time on the same batch (tiny Qwen3-MoE, CPU, TP=1).

The batch: multi-turn agent rollouts (the 4-turn fixture conversation, 8 rollouts) where a
final-turn criterion fails on every rollout, i.e. the worst case for a final-turn rubric:
every rollout gets an expert pass. TG's extra cost is one no-grad expert forward, and the fused KL at the gated rows only.
``tg`` (the default) reuses the student's keys/values for the prefix before the inserted
feedback, so its expert pass covers the feedback and the failing turn only
(:mod:`megatron_tg.train.prefix_kv`); ``tg_naive`` runs the expert over whole expert
sequences truncated after the failing turn: the paper's naive estimate of "one more
forward", ~1.33x (forward + backward ≈ 3 forwards).

Both variants run interleaved in one process (warm-up first, then alternating repetitions),
and the ratio of medians is printed. ``--gate all-turns`` fails every turn instead.

    python benchmarks/tg_step_time.py [--reps 7] [--rollouts 8] [--gate last|all-turns]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.* fixtures


def _rank_fn(rank, world, state, hf_cfg, samples, tok_dir, reps):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from transformers import AutoTokenizer

    from megatron_tg.config.objective import ObjectiveConfig
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.objectives import TGObjective
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.batching import build_micro_batch
    from megatron_tg.train.step import run_step

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    init_parallel()
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch)
    load_hf_weights(model, state, arch, current_layout())
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    row = max(len(s.rollout.token_ids) for s in samples)
    variants = {}
    for name, mode, reuse in (("grpo", "grpo", False), ("tg", "tg", True), ("tg_naive", "tg", False)):
        cfg = ObjectiveConfig(mode=mode, kl_coef=0.1, expert_prefix_reuse=reuse)
        variants[name] = (TGObjective(cfg), build_micro_batch(samples, tok, cfg, row_tokens=row,
                                                              prefix_reuse=reuse))
    times = {m: [] for m in variants}
    for rep in range(reps + 1):
        for mode, (objective, mb) in variants.items():
            ddp.zero_grad_buffer()
            t0 = time.perf_counter()
            run_step(ddp, objective, [mb], vocab_size=arch.vocab_size)
            dt = time.perf_counter() - t0
            if rep:  # rep 0 is warm-up
                times[mode].append(dt)
    tg_mb, naive_mb = variants["tg"][1], variants["tg_naive"][1]
    # Where tg's extra time goes: its passes alone, no_grad (student forward recording the
    # keys, then the expert pass over the suffixes), interleaved the same way.
    from megatron_tg.train.policy import forward_hidden, unwrap
    from megatron_tg.train.prefix_kv import record_kv, reuse_kv

    gpt = unwrap(ddp)
    passes = {"student forward": [], "expert reuse forward": []}
    with torch.no_grad():
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            with record_kv(gpt) as store:
                forward_hidden(ddp, tg_mb.student)
            t1 = time.perf_counter()
            with reuse_kv(gpt, store, tg_mb.expert_prefix):
                forward_hidden(ddp, tg_mb.expert)
            t2 = time.perf_counter()
            if rep:
                passes["student forward"].append(t1 - t0)
                passes["expert reuse forward"].append(t2 - t1)
    return {"times": times, "passes": passes, "student_tokens": int(tg_mb.student.tokens.numel()),
            "expert_tokens": int(tg_mb.expert.tokens.numel()) if tg_mb.expert else 0,
            "naive_expert_tokens": int(naive_mb.expert.tokens.numel()) if naive_mb.expert else 0,
            "gated_rows": int(tg_mb.policy.gate.sum()), "loss_rows": int(tg_mb.rows.numel())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--gate", choices=["last", "all-turns"], default="last")
    args = ap.parse_args(argv)

    from megatron_tg.testing.distributed import run_distributed
    from megatron_tg.sampling.train_sample import TrainSample
    from tests.train.common import make_samples, tiny_policy

    tok, cfg, state = tiny_policy()
    base = make_samples(tok, cfg, state, n=args.rollouts)
    samples = []
    for s in base:
        n = s.rollout.num_turns
        turns = [n - 1] if args.gate == "last" else list(range(n))
        samples.append(TrainSample(s.rollout, s.advantage,
                                   {k: "End with a markdown table of what you changed." for k in turns}))
    out = run_distributed(_rank_fn, 1, state, cfg, samples, tok.name_or_path, args.reps)[0]
    med = {m: statistics.median(t) for m, t in out["times"].items()}
    print(f"batch: {args.rollouts} rollouts, {out['student_tokens']} student tokens, "
          f"{out['loss_rows']} loss rows, {out['gated_rows']} gated rows, "
          f"expert tokens {out['expert_tokens']} with prefix reuse / {out['naive_expert_tokens']} "
          f"without (gate: {args.gate})")
    for m in ("grpo", "tg", "tg_naive"):
        ts = out["times"][m]
        print(f"{m:8s} train step: median {med[m] * 1e3:8.1f} ms  (min {min(ts) * 1e3:.1f}, "
              f"max {max(ts) * 1e3:.1f}, n={len(ts)})")
    for name, ts in out["passes"].items():
        toks = out["student_tokens"] if name.startswith("student") else out["expert_tokens"]
        print(f"{name:21s} (no_grad, {toks:5d} tokens): median {statistics.median(ts) * 1e3:7.1f} ms")
    print(f"ratio tg/grpo:       {med['tg'] / med['grpo']:.3f}  (prefix reuse, the default; target <= 1.05)")
    print(f"ratio tg_naive/grpo: {med['tg_naive'] / med['grpo']:.3f}  (whole expert sequences; "
          "the paper's naive cost ~1.33)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
