"""Peak memory and time of full-vocabulary KL, forward + backward: naive vs chunked vs fused.

Variants (reverse KL, fp32, loss = mean over tokens of KL(π_s ‖ π_e), then backward):

* ``naive``        — gather the vocabulary shards of student and expert logits, then
                     ``log_softmax`` + ``F.kl_div(..., log_target=True)`` on [T, V].
* ``chunked``      — :func:`megatron_tg.ops.vocab_parallel_kl` on the [T, V/TP] shards.
* ``naive_linear`` — hidden states in: ``h @ Wᵀ`` per shard, then ``naive`` (the fair
                     baseline for the fused op, which also does the output-layer matmuls).
* ``fused``        — :func:`megatron_tg.ops.fused_vocab_parallel_kl_loss` from hidden [T, H]
                     and the weight shard [V/TP, H] with per-token weights 1/T (what the
                     objective uses): gradient made in forward, never materialises [T, V/TP].
* ``fused_pertoken`` — :func:`megatron_tg.ops.fused_vocab_parallel_kl` (per-token output,
                     autograd-driven; backward recomputes both logits: 6 matmuls, not 4).

How TP is simulated on one 2-core machine. Each variant runs in fresh processes forming a
gloo group of TP ranks; only rank 0 is measured. Every TP rank does the same work on real
hardware, so rank 0's figures are the per-rank figures; to fit one machine the other ranks
do only what rank 0 needs from them:
* naive: they send their real-size shards with ``dist.gather`` to rank 0 (on rank 0 this
  allocates exactly what ``all_gather`` would) and skip the full-vocabulary math;
* chunked/fused: they run the same op on a 1-column shard, which issues the identical
  sequence of collectives (their shapes depend on token rows only, never on the vocabulary)
  at negligible cost, so rank 0's wall time is its own compute plus real collectives.

How memory is measured. Peak extra memory = VmHWM − VmRSS of rank 0 (Linux /proc), with the
high-water mark reset (``echo 5 > /proc/self/clear_refs``) right before the measured step,
after inputs exist and after a warm-up on 16 rows. It counts everything the step allocates
(torch, gloo buffers, the gradient of the input), not the inputs themselves. torch's CPU
allocator returns large blocks to the OS on free, so RSS tracks live tensors.
Time = rank 0 wall-clock of a measured step (one thread per rank), the fastest of
``--repeats``; rank 0's CPU time is printed too because a shared machine's load inflates
wall-clock (waiting in collectives for descheduled ranks) but not CPU time.

    python benchmarks/kl_memory.py            # T=2048 all variants + T=8192 chunked/fused
    python benchmarks/kl_memory.py --small    # quick: T=512, V=32768, H=256
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_tg.ops import fused_vocab_parallel_kl, fused_vocab_parallel_kl_loss, vocab_parallel_kl
from megatron_tg.testing.distributed import run_distributed

VARIANTS = ("naive", "chunked", "naive_linear", "fused", "fused_pertoken")
WARMUP_ROWS = 16


def _mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024.0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _naive_kl(zs: torch.Tensor, ze: torch.Tensor, world: int, heavy: bool) -> None:
    """Gather both logits over the vocabulary, then plain torch on [T, V]; backward."""
    if not heavy:
        dist.gather(zs.detach().contiguous(), None, dst=0)
        dist.gather(ze.detach().contiguous(), None, dst=0)
        return
    parts = [torch.empty_like(zs, requires_grad=False) for _ in range(world)]
    dist.gather(zs.detach().contiguous(), parts, dst=0)
    parts[0] = zs  # rank 0's own shard keeps the autograd edge
    full_s = torch.cat(parts, dim=-1)
    del parts
    parts = [torch.empty_like(ze) for _ in range(world)]
    dist.gather(ze.detach().contiguous(), parts, dst=0)
    full_e = torch.cat(parts, dim=-1)
    del parts
    log_s, log_e = F.log_softmax(full_s, dim=-1), F.log_softmax(full_e, dim=-1)
    kl = F.kl_div(log_e, log_s, reduction="none", log_target=True).sum(-1)  # KL(s ‖ e)
    kl.mean().backward()


def _head(x: torch.Tensor, rows: int) -> torch.Tensor:
    """First rows of x; x itself for all rows (a slice would add a full-size gradient copy)."""
    return x if rows == x.shape[0] else x[:rows]


def rank_main(rank: int, world: int, variant: str, tokens: int, vocab: int, hidden: int,
              chunk: int, repeats: int) -> dict:
    torch.manual_seed(1000 + rank)
    group = dist.group.WORLD
    heavy = rank == 0
    vs = vocab // world
    width = vs if heavy or variant in ("naive", "naive_linear") else 1

    if variant in ("naive", "chunked"):
        zs = torch.randn(tokens, width).mul_(3).requires_grad_(True)
        ze = torch.randn(tokens, width).mul_(3)
        leaves = [zs]

        def step(rows: int) -> None:
            if variant == "naive":
                _naive_kl(_head(zs, rows), _head(ze, rows), world, heavy)
            else:
                vocab_parallel_kl(_head(zs, rows), _head(ze, rows), group,
                                  chunk_size=chunk).mean().backward()
    else:
        h = torch.randn(tokens, hidden).requires_grad_(True)
        he = torch.randn(tokens, hidden)
        w_rows = vs if heavy else 1
        w = (torch.randn(w_rows, hidden) / hidden ** 0.5).requires_grad_(True)
        leaves = [h, w]
        # Stand-in shards the light naive ranks send (they would compute h @ Wᵀ themselves).
        sent = None if heavy or variant.startswith("fused") else torch.randn(tokens, vs)

        def step(rows: int) -> None:
            if variant == "fused":
                mean_w = torch.full((rows,), 1.0 / rows)
                fused_vocab_parallel_kl_loss(_head(h, rows), _head(he, rows), w, mean_w, group,
                                             chunk_size=chunk)[0].backward()
            elif variant == "fused_pertoken":
                fused_vocab_parallel_kl(_head(h, rows), _head(he, rows), w, group,
                                        chunk_size=chunk).mean().backward()
            elif heavy:
                _naive_kl(_head(h, rows) @ w.t(), (_head(he, rows) @ w.t()).detach(), world, True)
            else:
                _naive_kl(_head(sent, rows), _head(sent, rows), world, False)

    step(WARMUP_ROWS)
    best = {"extra_mib": 0.0, "wall_s": float("inf"), "cpu_s": float("inf")}
    for _ in range(repeats):
        for leaf in leaves:  # each measured step allocates its gradients afresh
            leaf.grad = None
        gc.collect()
        dist.barrier()
        rss0 = _mib("VmRSS")
        _reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        step(tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        best["extra_mib"] = max(best["extra_mib"], _mib("VmHWM") - rss0)
        best["wall_s"], best["cpu_s"] = min(best["wall_s"], wall), min(best["cpu_s"], cpu)
        dist.barrier()
    return best


def measure(variant: str, tokens: int, args: argparse.Namespace) -> dict:
    res = run_distributed(rank_main, args.tp, variant, tokens, args.vocab, args.hidden,
                          args.chunk, args.repeats, timeout=3600.0, threads_per_rank=1)
    return res[0]


def _fmt_ratio(num: dict, den: dict, what: str, target: float) -> str:
    r = num[what] / den[what]
    return f"{r:6.3f} ({'met' if r <= target else 'MISSED'})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="quick run: T=512, V=32768, H=256")
    p.add_argument("--tokens", type=int, default=2048,
                   help="T for the naive-vs-ours comparison (naive at 8192 needs >24 GiB)")
    p.add_argument("--large-tokens", type=int, default=8192,
                   help="T for chunked/fused only (0 to skip)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2,
                   help="measured steps per variant: max peak memory, min time")
    args = p.parse_args()
    if args.small:
        args.tokens, args.large_tokens, args.vocab, args.hidden, args.chunk = 512, 0, 32768, 256, 128
    if args.vocab % args.tp:
        raise SystemExit(f"--vocab {args.vocab} must be divisible by --tp {args.tp}")

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, 1 thread per rank, fp32, reverse KL")
    print(f"V={args.vocab} TP={args.tp} (V/TP={args.vocab // args.tp}) H={args.hidden} "
          f"chunk={args.chunk}; rank 0 of {args.tp} measured; forward + backward")
    runs = {(args.tokens, v): measure(v, args.tokens, args) for v in VARIANTS}
    if args.large_tokens:
        for v in ("chunked", "fused"):
            runs[(args.large_tokens, v)] = measure(v, args.large_tokens, args)

    print(f"\n{'T':>6} {'variant':<15} {'peak extra MiB':>15} {'wall s':>8} {'cpu s':>8}")
    for (t, v), r in runs.items():
        print(f"{t:>6} {v:<15} {r['extra_mib']:>15.1f} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f}")

    t = args.tokens
    print(f"\nratios at T={t} (targets: peak memory <= 0.10, time <= 1.00)")
    print(f"{'':<28} {'peak memory':>18} {'wall time':>18} {'cpu time':>18}")
    for num, den in (("chunked", "naive"), ("fused", "naive_linear"),
                     ("fused_pertoken", "naive_linear"), ("fused", "naive")):
        a, b = runs[(t, num)], runs[(t, den)]
        print(f"{num + ' / ' + den:<28} {_fmt_ratio(a, b, 'extra_mib', 0.10):>18} "
              f"{_fmt_ratio(a, b, 'wall_s', 1.0):>18} {_fmt_ratio(a, b, 'cpu_s', 1.0):>18}")
    if args.large_tokens:
        lt = args.large_tokens
        scale = lt / t
        naive_est = runs[(t, "naive")]["extra_mib"] * scale
        print(f"\nT={lt}: naive not run (it would need ~{naive_est / 1024:.1f} GiB per rank, "
              f"extrapolated x{scale:g} from T={t}, not measured)")
        for v in ("chunked", "fused"):
            r = runs[(lt, v)]
            print(f"  {v:<8} peak extra {r['extra_mib']:8.1f} MiB = {r['extra_mib'] / naive_est:.3f} "
                  f"x extrapolated naive; wall {r['wall_s']:.2f} s")


if __name__ == "__main__":
    main()
