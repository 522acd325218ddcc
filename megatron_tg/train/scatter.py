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

Waiting: rank 0's batch can take longer than any collective timeout (the first batch of
50-turn rollouts, a held-out evaluation at step 0), so the other ranks never wait inside
the scatter. They wait on the default process group's store for rank 0's "batch ready" key
(:func:`wait_for_batch`, limit ``timeouts.rollout_wait_s``) and enter the scatter only once
rank 0 has the batch, so the collective itself takes only the transfer.
"""

from __future__ import annotations

import datetime
import heapq
import math
import time
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


_READY = "tg/batch_ready/{}"


class RolloutWaitTimeout(RuntimeError):
    """Rank 0 did not produce a step's batch within ``timeouts.rollout_wait_s``."""


def wait_for_batch(step: int, *, rank: int, timeout_s: float, store=None) -> float:
    """Rank 0 (after it has the batch of ``step``): mark it ready. Other ranks: wait for the
    mark on the default store, at most ``timeout_s``. Returns the seconds waited here.

    A store wait is a blocking get on rank 0's TCPStore, not a collective, so it is bounded
    only by ``timeout_s``; the key of the previous step is removed by rank 0 (every rank has
    passed that step's scatter by then)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    store = store or dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(_READY.format(step), b"1")
        store.delete_key(_READY.format(step - 1))
        return 0.0
    t0 = time.perf_counter()
    try:
        store.wait([_READY.format(step)], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
        raise RolloutWaitTimeout(
            f"rank {rank}: no batch from rank 0 for step {step} within timeouts.rollout_wait_s="
            f"{timeout_s:g} s (rank 0 is generating or judging, or died; raise the limit if its "
            f"rollouts are legitimately this slow): {exc}") from exc
    return time.perf_counter() - t0
