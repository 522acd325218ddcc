"""The pass plan: per micro-batch index, which passes every rank runs (EP lock-step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from megatron_tg.train.pass_plan import ExpertPass, build_pass_plan


def _mb(gated: int):
    return SimpleNamespace(expert=object() if gated else None,
                           expert_rows=torch.arange(gated, dtype=torch.long))


def test_without_expert_parallelism_the_plan_is_the_ranks_own():
    plan = build_pass_plan([_mb(3), _mb(0), _mb(1)], ep=1)
    assert [(p.source, p.expert) for p in plan] == [
        (0, ExpertPass.REAL), (1, ExpertPass.NONE), (2, ExpertPass.REAL)]
    assert plan.expert_passes == [0, 2] and not any(p.padding for p in plan)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        build_pass_plan([], ep=1)


def _plan_fn(rank, world, gated_per_rank):
    plan = build_pass_plan([_mb(g) for g in gated_per_rank[rank]], ep=world)
    return [(p.source, p.expert.value) for p in plan]


def test_expert_parallel_ranks_agree_on_count_and_expert_passes():
    # rank 0: 3 micro-batches, gated in the first; rank 1: 2, gated in the second.
    plans = run_distributed(_plan_fn, 2, [[2, 0, 0], [0, 1]])
    assert plans[0] == [(0, "real"), (1, "dummy"), (2, "none")]
    assert plans[1] == [(0, "dummy"), (1, "real"), (None, "none")]  # padding at index 2
