"""Token-balanced data-parallel scatter: each rank gets only its share, balanced by tokens
(spread bound on a skewed batch), identical on the TP ranks of one DP index (gloo ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_tg.parallel.dims import ParallelDims
from megatron_tg.testing.distributed import run_distributed
from megatron_tg.train.scatter import balanced_assignment, dp_index_of_ranks, scatter_by_tokens

# A skewed agent batch: a few 64k-token rollouts among many short ones.
SKEWED = [65536, 61000, 58000, 40000] + [2000 + 37 * i for i in range(60)]


def _spread(lengths, shares):
    tokens = [sum(lengths[i] for i in s) for s in shares]
    return max(tokens) - min(tokens), tokens


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_balanced_within_the_longest_sample_and_counts_within_one(dp):
    shares = balanced_assignment(SKEWED, dp)
    assert sorted(i for s in shares for i in s) == list(range(len(SKEWED)))  # nothing lost
    counts = [len(s) for s in shares]
    assert max(counts) - min(counts) <= 1
    spread, tokens = _spread(SKEWED, shares)
    assert spread <= max(SKEWED)  # the guarantee in the module docstring
    round_robin, _ = _spread(SKEWED, [list(range(r, len(SKEWED), dp)) for r in range(dp)])
    assert spread < round_robin  # and better than what it replaces on this batch
    print(f"dp={dp}: max/mean tokens {max(tokens) / (sum(tokens) / dp):.3f}, spread {spread} "
          f"(round-robin {round_robin})")


def test_assignment_edge_cases():
    assert balanced_assignment([], 3) == [[], [], []]
    assert balanced_assignment([5], 1) == [[0]]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        balanced_assignment([1, 2], 0)


def test_dp_index_follows_megatron_rank_order():
    dims = ParallelDims(8, tp=2, pp=2)  # dp = 2; TP fastest, then DP, then PP
    assert dp_index_of_ranks(dims) == [0, 0, 1, 1, 0, 0, 1, 1]


def _fake(n):
    return SimpleNamespace(rollout=SimpleNamespace(token_ids=[0] * n, rollout_id=f"r{n}"))


def _scatter_rank(rank, world, lengths):
    dims = ParallelDims(world, tp=2)  # 4 ranks: dp = 2, TP pairs (0,1) and (2,3)
    samples = [_fake(n) for n in lengths] if rank == 0 else None
    metrics = {"reward/mean": 0.5} if rank == 0 else None
    mine, m = scatter_by_tokens(samples, metrics, rank=rank, dims=dims)
    return [len(s.rollout.token_ids) for s in mine], m


def test_each_rank_receives_its_share_over_gloo():
    lengths = [9000, 100, 200, 300, 8000, 400]
    out = run_distributed(_scatter_rank, 4, lengths)
    assert out[0] == out[1] and out[2] == out[3]  # TP ranks of one DP index: same share
    a, b = out[0][0], out[2][0]
    assert sorted(a + b) == sorted(lengths)
    assert abs(sum(a) - sum(b)) <= max(lengths)
    assert all(m["reward/mean"] == 0.5 and m["scatter/tokens_max_over_mean"] >= 1 for _, m in out)


# ---- waiting for rank 0's batch: on the store, not inside the scatter's collective ----------
COLLECTIVE_S = 2.0  # the process group's timeout in these tests
LATE_S = 3 * COLLECTIVE_S  # rank 0's first batch comes later than any collective may wait


def _late_first_batch(rank, world, on_store: bool, wait_limit: float):
    import time

    from megatron_tg.train.scatter import wait_for_batch

    dims = ParallelDims(world)  # dp = world
    got, waited = [], []
    for step, late in ((0, LATE_S), (1, 0.0)):  # a late first batch, then a prompt one
        if rank == 0:
            time.sleep(late)  # generating and judging
        samples = [_fake(n) for n in (500, 400, 300, 200)] if rank == 0 else None
        metrics = {"step": step} if rank == 0 else None
        if on_store:
            waited.append(wait_for_batch(step, rank=rank, timeout_s=wait_limit))
        mine, m = scatter_by_tokens(samples, metrics, rank=rank, dims=dims)
        got.append((sorted(len(s.rollout.token_ids) for s in mine), m["step"]))
    return got, waited


def test_a_first_batch_later_than_the_collective_timeout_still_arrives():
    out = run_distributed(_late_first_batch, 2, True, 60.0, pg_timeout_s=COLLECTIVE_S)
    (got0, _), (got1, waited1) = out
    assert [s for _, s in got0] == [s for _, s in got1] == [0, 1]
    assert sorted(got0[0][0] + got1[0][0]) == [200, 300, 400, 500]  # nothing lost or doubled
    assert waited1[0] > COLLECTIVE_S  # rank 1 really waited longer than a collective may
    assert waited1[1] < COLLECTIVE_S


def test_the_same_wait_inside_the_collective_dies_at_its_timeout():
    # The control: without the store wait the scatter's collective times out, so the test
    # above proves the store wait, not a lenient process group.
    with pytest.raises(RuntimeError, match="(?i)timed? ?out"):
        run_distributed(_late_first_batch, 2, False, 60.0, pg_timeout_s=COLLECTIVE_S)


def _rank0_never_ready(rank, world):
    import time

    from megatron_tg.train.scatter import RolloutWaitTimeout, wait_for_batch

    if rank == 0:
        time.sleep(3.0)  # never marks the batch ready; outlives rank 1's wait
        return None
    try:
        wait_for_batch(0, rank=rank, timeout_s=1.0)
    except RolloutWaitTimeout as exc:
        return str(exc)
    return "no timeout"


def test_the_wait_for_rollouts_has_its_own_limit_and_names_it():
    msg = run_distributed(_rank0_never_ready, 2)[1]
    assert "timeouts.rollout_wait_s=1 s" in msg and "step 0" in msg, msg
