"""ParallelDims.rank_groups (what the dry-run prints) are the groups megatron-core builds."""

from __future__ import annotations

from math import lcm

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tg.parallel.dims import Axis, ParallelDims


@st.composite
def layouts(draw):
    sizes = {a: draw(st.sampled_from([1, 2, 3, 4])) for a in ("tp", "pp", "cp", "ep", "etp")}
    if sizes["ep"] == 1:
        sizes["etp"] = sizes["tp"]  # ParallelDims refuses anything else (expert grads go dense)
    dense = sizes["tp"] * sizes["cp"] * sizes["pp"]
    expert = sizes["etp"] * sizes["ep"] * sizes["pp"]
    # the smallest world both foldings divide, times 1 or 2 data-parallel replicas
    return ParallelDims(lcm(dense, expert) * draw(st.sampled_from([1, 2])), **sizes)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_every_axis_partitions_the_world(dims):
    for axis in Axis:
        groups = dims.rank_groups(axis)
        assert all(len(g) == dims.size(axis) for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_groups_match_megatron_rank_generator(dims):
    mps = pytest.importorskip("megatron.core.parallel_state")
    order = "tp-cp-ep-dp-pp"  # megatron's default, the one parallel/state.py initialises with
    dense = mps.RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order=order)
    expert = mps.RankGenerator(tp=dims.etp, ep=dims.ep, dp=dims.edp, pp=dims.pp, cp=1, order=order)
    reference = {
        Axis.TP: dense.get_ranks("tp"), Axis.CP: dense.get_ranks("cp"),
        Axis.DP: dense.get_ranks("dp"), Axis.PP: dense.get_ranks("pp"),
        Axis.ETP: expert.get_ranks("tp"), Axis.EP: expert.get_ranks("ep"),
        Axis.EDP: expert.get_ranks("dp"),
    }
    for axis, groups in reference.items():
        assert dims.rank_groups(axis) == groups, axis
    assert dims.rank_groups(Axis.PP) == expert.get_ranks("pp")  # both foldings agree on stages
