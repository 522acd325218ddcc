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


def test_smallest_world_and_etp_default_have_one_owner():
    from megatron_tg.parallel.dims import ParallelDims

    assert ParallelDims.resolve_etp(4, None) == 4 and ParallelDims.resolve_etp(4, 1) == 1
    # dense tp*cp*pp = 2*1*2 = 4, expert etp*ep*pp = 1*3*2 = 6: both tile lcm(4, 6) = 12
    assert ParallelDims.smallest_world(tp=2, pp=2, ep=3, etp=1) == 12
    dims = ParallelDims.smallest(tp=2, pp=2, ep=3, etp=1)
    assert (dims.world_size, dims.dp, dims.edp) == (12, 3, 2)
    assert dims.sizes() == {"tp": 2, "ep": 3, "pp": 2, "etp": 1, "world_size": 12}
    assert ParallelDims.smallest(tp=2).etp == 2  # unset etp follows tp


def test_check_arch_reads_the_model_shape():
    from types import SimpleNamespace

    import pytest

    from megatron_tg.parallel.dims import LayoutError, ParallelDims

    arch = SimpleNamespace(num_layers=94, num_attention_heads=64, num_key_value_heads=4,
                           num_experts=128)
    ParallelDims.smallest(tp=4, pp=2, ep=8).check_arch(arch)
    with pytest.raises(LayoutError, match="num_layers=94 not divisible by pp=4"):
        ParallelDims.smallest(pp=4).check_arch(arch)


def test_pipeline_with_tied_embeddings_is_refused_at_config_time():
    import pytest

    from megatron_tg.parallel.dims import LayoutError, ParallelDims

    shape = dict(num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=4)
    ParallelDims.smallest(pp=2).check_model(**shape)  # untied: fine
    ParallelDims.smallest(pp=1).check_model(**shape, tied_embeddings=True)
    with pytest.raises(LayoutError, match="pp=2 with tied word embeddings"):
        ParallelDims.smallest(pp=2).check_model(**shape, tied_embeddings=True)
