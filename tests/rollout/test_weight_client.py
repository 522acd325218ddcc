"""The weight-sync rules the client applies before touching an engine (pure functions):
group layout by GPU count (finding 1), which SGLang releases and layouts are refused,
and the flattened-bucket packing rule (finding 7)."""

from __future__ import annotations

import pytest
import torch

from megatron_tg.rollout.client import SGLangClientError
from megatron_tg.rollout.transport import FlatBucket, bucket_offsets
from megatron_tg.rollout.weight_client import EngineInfo, check_weight_sync, group_layout


def test_layout_counts_engine_gpus_not_servers():
    infos = [EngineInfo("a", "0.5.23", tp_size=2), EngineInfo("b", "0.5.23", tp_size=4),
             EngineInfo("c", "0.5.23", tp_size=2)]
    world, offsets = group_layout(infos)
    assert (world, offsets) == (9, [1, 3, 7])
    # SGLang ranks GPU t of engine i as offsets[i] + t: every rank 1..world-1 exactly once.
    ranks = [off + t for off, info in zip(offsets, infos) for t in range(info.tp_size)]
    assert sorted(ranks) == list(range(1, world))


@pytest.mark.parametrize("info, needle", [
    (EngineInfo("http://e:1", "0.5.20"), "older than 0.5.21"),
    (EngineInfo("http://e:1", "0.5.23", tp_size=2, pp_size=2), "pp_size=2"),
    (EngineInfo("http://e:1", "0.5.23", dp_size=2), "dp_size=2"),
    (EngineInfo("http://e:1", "megatron-tg-embedded"), "not an SGLang release"),
])
def test_engines_weight_sync_cannot_serve_are_refused_by_name(info, needle):
    with pytest.raises(SGLangClientError, match=needle) as err:
        check_weight_sync(info)
    assert "http://e:1" in str(err.value)


@pytest.mark.parametrize("version", ["0.5.21", "0.5.22", "0.5.23"])
def test_the_pinned_range_is_accepted(version):
    check_weight_sync(EngineInfo("http://e:1", version, tp_size=8))


def test_flat_bucket_never_starts_a_tensor_at_a_misaligned_offset():
    b = FlatBucket(1 << 10, torch.device("cpu"))
    half = torch.arange(3, dtype=torch.bfloat16)
    wide = torch.arange(4, dtype=torch.float32)
    b.add("half", half)
    assert not b.fits(wide)  # byte 6 is not a multiple of 4: the bucket must be sent first
    with pytest.raises(ValueError, match="does not fit"):
        b.add("wide", wide)
    b.add("half2", torch.ones(1, dtype=torch.bfloat16))  # byte 6 is fine for 2-byte elements
    assert b.fits(wide) and b.size == 8
    b.add("wide", wide)
    specs, total = bucket_offsets(b.names, b.dtypes, b.shapes)
    assert total == b.size == 24 and [s[3] for s in specs] == [0, 6, 8]
    got = [b.flat()[a:e].view(d).view(s) for _, d, s, a, e in specs]
    assert torch.equal(got[0], half) and torch.equal(got[2], wide)
    with pytest.raises(ValueError, match="Unaligned received tensor w: byte offset 6"):
        bucket_offsets(["h", "w"], ["bfloat16", "float32"], [[3], [4]])
