"""TP=1 (in-process, group=None), TP=2 and TP=4 (one gloo world each) against float64 references.

Each world runs the whole battery of :mod:`tests.ops.checks` once: spawning costs seconds, a
check costs milliseconds.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_tg.testing.distributed import run_distributed
from tests.ops.checks import check_collective_budget, check_fused_ops, check_logits_ops


def _padded(vocab: int, world: int) -> int:
    return math.ceil(vocab / world) * world


def battery(rank: int, world: int, group) -> dict:
    """All checks for one TP size; vocabularies chosen so that padding lands differently."""
    errs: dict[str, float] = {}
    vocabs = {1: (11, 12), 2: (11, 12), 4: (9, 13)}[world]  # world 4, V=9: rank 3 is all padding
    for vocab in vocabs:
        padded = _padded(vocab, world) + (world if vocab == 12 else 0)  # padding beyond a full shard
        for kind, chunk, seed in (("normal", 3, 1), ("extreme", 4, 2), ("equal", 100, 3)):
            errs.update(check_logits_ops(rank, world, group, t=7, vocab=vocab, padded=padded,
                                         kind=kind, chunk=chunk, seed=seed + vocab))
        errs.update(check_logits_ops(rank, world, group, t=6, vocab=vocab, padded=padded,
                                     kind="normal", chunk=4, seed=11, dtype=torch.float32))
        errs.update(check_fused_ops(rank, world, group, t=7, vocab=vocab, padded=padded, hidden=5,
                                    chunk=3, seed=21 + vocab))
    errs.update(check_fused_ops(rank, world, group, t=5, vocab=vocabs[0], padded=_padded(vocabs[0], world),
                                hidden=4, chunk=2, seed=31, separate_expert_weight=True))
    # vocab_size=None: every column is real.
    errs.update(check_logits_ops(rank, world, group, t=5, vocab=4 * world, padded=4 * world,
                                 kind="normal", chunk=2, seed=41, vocab_size_arg=None))
    return errs


def world_battery(rank: int, world: int) -> dict:
    errs = battery(rank, world, dist.group.WORLD)
    check_collective_budget(rank, world, dist.group.WORLD)
    return errs


def test_tp1_group_none_matches_reference():
    errs = battery(0, 1, None)
    assert errs and max(errs.values()) < 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_tp_world_matches_reference(world):
    results = run_distributed(world_battery, world)
    assert len(results) == world
    # Every rank computed every check (the same keys), and all values are tiny errors.
    assert all(r.keys() == results[0].keys() for r in results)
    assert max(max(r.values()) for r in results) < 1e-3
