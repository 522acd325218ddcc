"""Peak memory of CPU attention, THD per-segment SDPA vs a dense masked score matrix, at two
token counts each: does attention memory grow linearly with the tokens?

``thd``: :func:`megatron_tg.models.qwen3_moe.attention.varlen_causal_attention`, the local
spec's core attention for packed rows (one segment of T tokens: the worst case, one long
rollout). ``dense``: what the local path did before THD: a ``[T, T]`` boolean mask and a
full ``[heads, T, T]`` score matrix, softmax, times V (megatron's local
``DotProductAttention`` with an explicit mask). Each measurement runs forward + backward in a
fresh process and reports the rise of the resident-set high-water mark (``ru_maxrss``) above
the inputs; the ratio peak(2T) / peak(T) is ~2 for linear and ~4 for quadratic memory.
Shapes: 16 query heads, 4 key/value groups, head dim 128, fp32 (a TP=2 shard of a
32-head, 4-group layer).

    python benchmarks/thd_attention_memory.py [--thd 8192 16384] [--dense 1024 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

HEADS, GROUPS, DIM = 16, 4, 128


def _one(variant: str, tokens: int) -> float:
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, HEADS, DIM, generator=g).requires_grad_()
    k = torch.randn(tokens, GROUPS, DIM, generator=g).requires_grad_()
    v = torch.randn(tokens, GROUPS, DIM, generator=g).requires_grad_()
    w = torch.randn(tokens, HEADS, DIM, generator=g)
    # Touch the gradients' memory up front: both variants return grads of the same sizes.
    for x in (q, k, v):
        x.grad = torch.zeros_like(x)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if variant == "thd":
        from megatron_tg.models.qwen3_moe.attention import varlen_causal_attention

        cu = torch.tensor([0, tokens], dtype=torch.int32)
        out = varlen_causal_attention(q, k, v, cu, cu, scale=DIM ** -0.5)
    else:
        rep = HEADS // GROUPS
        masked = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
        kk = k.repeat_interleave(rep, 1).transpose(0, 1)
        vv = v.repeat_interleave(rep, 1).transpose(0, 1)
        scores = (q.transpose(0, 1) @ kk.transpose(1, 2)) * DIM ** -0.5
        probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
        out = (probs @ vv).transpose(0, 1)
    (out * w).sum().backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024  # KiB -> MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--thd", type=int, nargs=2, default=[8192, 16384])
    ap.add_argument("--dense", type=int, nargs=2, default=[1024, 2048])
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one[0], int(args.one[1]))))
        return
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    peaks = {}
    for variant, sizes in (("thd", args.thd), ("dense", args.dense)):
        for t in sizes:
            out = subprocess.run([sys.executable, __file__, "--one", variant, str(t)], env=env,
                                 check=True, capture_output=True, text=True).stdout
            peaks[(variant, t)] = json.loads(out.strip().splitlines()[-1])
            print(f"{variant:5s} T={t:6d}: attention fwd+bwd peak {peaks[(variant, t)]:9.1f} MiB")
    for variant, (a, b) in (("thd", args.thd), ("dense", args.dense)):
        print(f"ratio {variant:5s} peak(T={b}) / peak(T={a}): {peaks[(variant, b)] / peaks[(variant, a)]:.2f}"
              f"  (tokens x{b / a:.0f}; linear ~{b / a:.0f}, quadratic ~{(b / a) ** 2:.0f})")


if __name__ == "__main__":
    main()
