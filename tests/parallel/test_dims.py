"""Layout arithmetic: derived sizes and the errors that name the offending sizes."""

import pytest

from megatron_tg.parallel.dims import Axis, LayoutError, ParallelDims


def test_derived_sizes_and_default_etp():
    d = ParallelDims(world_size=16, tp=2, pp=2, ep=4, etp=1)
    assert (d.dp, d.edp) == (4, 2)
    assert ParallelDims(world_size=8, tp=4).etp == 4  # megatron's default: etp = tp
    assert d.describe() == {"world_size": 16, "tp": 2, "cp": 1, "ep": 4, "pp": 2, "dp": 4,
                            "etp": 1, "edp": 2}
    assert d.size(Axis.EP) == 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=6, tp=4), "not divisible by tp\\*cp\\*pp"),
    (dict(world_size=8, tp=2, ep=3, etp=1), "not divisible by etp\\*ep\\*pp"),
    (dict(world_size=4, tp=2, ep=1, etp=1), "ep=1 requires etp == tp"),
    (dict(world_size=4, tp=0), "tp must be >= 1"),
])
def test_bad_layouts_name_the_sizes(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        ParallelDims(**kwargs)


def test_model_checks():
    d = ParallelDims(world_size=8, tp=2, ep=4, etp=1)
    d.check_model(num_layers=48, num_attention_heads=32, num_query_groups=4, num_experts=128)
    with pytest.raises(LayoutError, match="num_experts=6 not divisible by ep=4"):
        d.check_model(num_layers=2, num_attention_heads=4, num_query_groups=2, num_experts=6)
    with pytest.raises(LayoutError, match="has no experts"):
        d.check_model(num_layers=2, num_attention_heads=4, num_query_groups=2, num_experts=None)
