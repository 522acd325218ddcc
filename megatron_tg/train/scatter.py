"""Judged samples -> data-parallel ranks: each rank receives only its own share, balanced by
tokens.

Why balance: every DP rank runs the same step, so the rank with the most tokens sets the
step time; with expert parallelism the ranks also meet in every micro-batch's all-to-alls,
so the longest micro-batch index sets each of those. Round-robin (``samples[r::dp]``) lets
a few 64k-token agent rollouts land on one rank.

Assignment (greedy longest-first with equal counts): samples are taken longest first and
each goes to the rank with the fewest tokens among those that still have room, where room
is ``ceil(N / dp)`` samples. Counts per rank therefore differ by at most one, exactly as
with round-robin, so the step's rollout mean keeps the same weighting; and the token totals
differ by at most the longest sample (each rank, when it last received one, held the fewest
tokens among the ranks with room). Within a rank the samples stay longest first, so
micro-batch ``i`` of every rank holds comparable tokens (the EP lock-step then waits little).

Transport: global rank 0 holds the judged batch; ``scatter_object_list`` sends every rank
only its DP share (all TP/CP/PP ranks of one DP index get the same share), not the whole
batch to everyone.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import torch.distributed as dist

from megatron_tg.parallel.dims import Axis, ParallelDims


def balanced_assignment(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` per part: equal counts (±1), token totals within the longest."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    room = math.ceil(len(lengths) / parts) if lengths else 0
    heap = [(0, p) for p in range(parts)]  # (tokens, part) of the parts with room
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, p = heapq.heappop(heap)
        out[p].append(i)
        if len(out[p]) < room:
            heapq.heappush(heap, (tokens + lengths[i], p))
    return out


def dp_index_of_ranks(dims: ParallelDims) -> list[int]:
    """The data-parallel index of every global rank (megatron's rank order)."""
    index = [0] * dims.world_size
    for group in dims.rank_groups(Axis.DP):
        for k, rank in enumerate(group):
            index[rank] = k
    return index


def scatter_by_tokens(samples, metrics, *, rank: int, dims: ParallelDims):
    """Collective over the world: rank 0's ``(samples, metrics)`` -> this rank's DP share of
    the samples (balanced by tokens) and the metrics. Other ranks pass ``None, None``."""
    payload = None
    if rank == 0:
        if len(samples) < dims.dp:
            raise RuntimeError(
                f"{len(samples)} trainable rollouts for {dims.dp} data-parallel ranks (judge errors: "
                f"{metrics.get('rollout/judge_errors', 0):g}, rollouts without an assistant turn: "
                f"{metrics.get('rollout/empty', 0):g} — is the prompt longer than "
                "rollout.max_context_tokens? Otherwise raise rollout.prompts_per_step or group_size)")
        lengths = [len(s.rollout.token_ids) for s in samples]
        shares = balanced_assignment(lengths, dims.dp)
        per_dp = [[samples[i] for i in share] for share in shares]
        tokens = [sum(lengths[i] for i in share) for share in shares]
        metrics = {**metrics, "scatter/tokens_max_over_mean": max(tokens) / (sum(tokens) / len(tokens))}
        payload = [(per_dp[k], metrics) for k in dp_index_of_ranks(dims)]
    if dims.world_size == 1:
        return payload[0]
    box = [None]
    dist.scatter_object_list(box, payload, src=0)
    return box[0]
