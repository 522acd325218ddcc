"""Pieces of the converters that need no worker processes: sliced reads, the safetensors
catalogue and streaming writer, output staging, sizes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_tg.convert.common import ConversionError, parse_size
from megatron_tg.convert.hf_io import (
    HFCheckpoint,
    LazyReader,
    PlannedTensor,
    StreamingSafetensorsWriter,
    pack_files,
)
from megatron_tg.convert.outdir import staged_output
from megatron_tg.convert.slicing import read_shard
from megatron_tg.models.qwen3_moe.config import Qwen3Arch
from megatron_tg.models.qwen3_moe.mapping import ShardLayout, to_megatron
from tests.convert.conftest import leftovers


def megatron_names(arch: Qwen3Arch, ep: int) -> list[str]:
    """This rank's megatron parameter names (local spec, SequentialMLP experts)."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
             "output_layer.weight"]
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"]
        names += [p + f"self_attention.{x}.weight"
                  for x in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm")]
        if arch.is_moe_layer(i):
            names.append(p + "mlp.router.weight")
            names += [p + f"mlp.experts.local_experts.{j}.linear_fc{k}.weight"
                      for j in range(arch.num_experts // ep) for k in (1, 2)]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    return names


LAYOUTS = [ShardLayout()]
LAYOUTS += [ShardLayout(tp=2, tp_rank=r, ep=2, ep_rank=e, etp=2, etp_rank=r)
            for r in range(2) for e in range(2)]
LAYOUTS += [ShardLayout(tp=2, tp_rank=r, ep=2, ep_rank=e, etp=1, etp_rank=0)
            for r in range(2) for e in range(2)]
LAYOUTS += [ShardLayout(ep=4, ep_rank=e) for e in range(4)]


@pytest.mark.parametrize("source", ["model_a", "model_b"])
def test_sliced_reads_equal_mapping(source, request):
    """read_shard (sliced safetensors reads) == mapping.to_megatron (whole tensors)."""
    m = request.getfixturevalue(source)
    arch = Qwen3Arch.from_hf(m.cfg.to_dict())
    ckpt = HFCheckpoint(m.dir)
    for layout in LAYOUTS:
        reader = LazyReader(m.dir, ckpt.reader_entries(), reopen_bytes=10_000)
        for name in megatron_names(arch, layout.ep):
            got = read_shard(name, reader, arch, layout)
            want = to_megatron(name, m.state, arch, layout)
            assert got.dtype == want.dtype and torch.equal(got, want), (name, layout)
        if layout.tp == 2:  # slices, not whole tensors: about half the dense bytes per rank
            assert reader.bytes_read < 0.8 * ckpt.total_bytes


def test_sharded_and_single_file_catalogues_agree(model_a, workdir):
    sharded = workdir / "hf_a_sharded"
    model_a.model.save_pretrained(sharded, max_shard_size="50KB")
    one, many = HFCheckpoint(model_a.dir), HFCheckpoint(sharded)
    assert len(many.files) > 3
    assert {n: (e.dtype, e.shape) for n, e in one.entries.items()} == \
        {n: (e.dtype, e.shape) for n, e in many.entries.items()}
    arch = Qwen3Arch.from_hf(model_a.dir)
    one.validate(arch)
    many.validate(arch)
    reader = LazyReader(sharded, many.reader_entries())
    for name, t in model_a.state.items():
        assert torch.equal(reader.get(name), t), name


def test_index_naming_a_tensor_its_file_lacks(model_a, workdir):
    d = workdir / "hf_bad_index"
    model_a.model.save_pretrained(d, max_shard_size="50KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.9.mlp.gate.weight"] = first
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="model.layers.9.mlp.gate.weight"):
        HFCheckpoint(d)


def test_streaming_writer_matches_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4, 2).to(torch.bfloat16), "d": torch.zeros(0, 3)}
    plan = [PlannedTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    w = StreamingSafetensorsWriter(tmp_path / "x.safetensors", plan)
    with pytest.raises(RuntimeError, match="expected"):
        w.write("b", tensors["b"])  # out of the planned order
    for n, t in tensors.items():
        w.write(n, t)
    w.close()
    back = load_file(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    for n, t in tensors.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t)
    w = StreamingSafetensorsWriter(tmp_path / "y.safetensors", plan)
    with pytest.raises(RuntimeError, match="closed after 0 of 4"):
        w.close()


def test_pack_files_caps_size():
    ts = [PlannedTensor(str(i), torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5, 1])]
    files = pack_files(ts, max_bytes=80)
    assert [[t.name for t in f] for f in files] == [["0", "1"], ["2"], ["3", "4"]]
    assert sum(len(f) for f in pack_files(ts, max_bytes=10)) == 5  # big tensors alone


def test_staged_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError):
        with staged_output(out, overwrite=False) as tmp:
            (tmp / "partial").write_text("x")
            raise ValueError("boom")
    assert not out.exists() and leftovers(tmp_path) == []
    with staged_output(out, overwrite=False) as tmp:
        (tmp / "new").write_text("1")
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    with pytest.raises(ConversionError, match="already holds"):
        with staged_output(out, overwrite=False):
            pass
    with pytest.raises(RuntimeError):
        with staged_output(out, overwrite=True) as tmp:
            raise RuntimeError("worker died")
    assert sorted(p.name for p in out.iterdir()) == ["new"]  # untouched by the failure
    with staged_output(out, overwrite=True) as tmp:
        (tmp / "newer").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["newer"]
    assert leftovers(tmp_path) == []


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 5 * 10**8
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("100KB") == 100_000
    assert parse_size("1048576") == 2**20
    with pytest.raises(ValueError, match="cannot parse"):
        parse_size("5 parsecs")
