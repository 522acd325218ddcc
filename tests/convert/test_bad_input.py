"""Bad input is refused before any worker starts, with a message naming the problem, and
leaves nothing behind: no output dir, no temporary sibling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

from megatron_tg.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_tg.convert.common import ConversionError
from megatron_tg.convert.hf_to_megatron import main as hf_to_megatron_main
from megatron_tg.convert.megatron_to_hf import main as megatron_to_hf_main
from megatron_tg.models.qwen3_moe.config import UnsupportedConfigError
from tests.convert.conftest import leftovers

EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


def _clone(model_a, tmp_path: Path, state=None) -> Path:
    """A copy of model A's dir, optionally with a different tensor set."""
    d = tmp_path / "hf"
    shutil.copytree(model_a.dir, d)
    if state is not None:
        save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _refused(tmp_path: Path, hf_dir: Path, match: str, exc=ConversionError) -> None:
    out = tmp_path / "out"
    with pytest.raises(exc, match=match):
        convert_hf_to_megatron(hf_dir, out, tp=2, ep=2, progress=False)
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_truncated_safetensors(model_a, tmp_path):
    d = _clone(model_a, tmp_path)
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    _refused(tmp_path, d, r"model\.safetensors: truncated safetensors file.*1000 missing")


def test_missing_expert_tensor(model_a, tmp_path):
    state = {k: v for k, v in model_a.state.items() if k != EXPERT}
    _refused(tmp_path, _clone(model_a, tmp_path, state), rf"1 missing tensor\(s\): {EXPERT}")


def test_unexpected_tensor(model_a, tmp_path):
    state = dict(model_a.state)
    state["model.layers.0.mlp.shared_expert.weight"] = state["model.norm.weight"].clone()
    _refused(tmp_path, _clone(model_a, tmp_path, state),
             r"1 unexpected tensor\(s\): model\.layers\.0\.mlp\.shared_expert\.weight")


def test_wrong_shape(model_a, tmp_path):
    state = dict(model_a.state)
    state["model.layers.2.mlp.gate.weight"] = state["model.layers.2.mlp.gate.weight"][:3].clone()
    _refused(tmp_path, _clone(model_a, tmp_path, state),
             r"wrong shape: model\.layers\.2\.mlp\.gate\.weight \(3, 64\) \(expected \(4, 64\)\)")


def test_unsupported_config_field(model_a, tmp_path, capsys):
    d = _clone(model_a, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(tmp_path, d, "rope_scaling", exc=UnsupportedConfigError)
    # The CLI turns it into one line on stderr and exit status 2.
    rc = hf_to_megatron_main(["--hf-dir", str(d), "--out-dir", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config field rope_scaling=") and "YaRN" in err
    assert not (tmp_path / "out").exists()


def test_existing_output_dir(model_a, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("an earlier checkpoint")
    rc = hf_to_megatron_main(["--hf-dir", str(model_a.dir), "--out-dir", str(out)])
    assert rc == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    # Export refuses the same way (its input here: a stand-in torch_dist dir).
    mg = tmp_path / "mg"
    (mg / "hf_config").mkdir(parents=True)
    (mg / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    shutil.copy(model_a.dir / "config.json", mg / "hf_config" / "config.json")
    rc = megatron_to_hf_main(["--megatron-dir", str(mg), "--out-dir", str(out)])
    assert rc == 2
    assert "--overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "an earlier checkpoint"
    assert leftovers(tmp_path) == []


def test_export_refuses_non_checkpoint_and_missing_config(model_a, tmp_path):
    with pytest.raises(ConversionError, match="not a megatron torch_dist checkpoint"):
        convert_megatron_to_hf(model_a.dir, tmp_path / "out")
    mg = tmp_path / "mg"
    mg.mkdir()
    (mg / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with pytest.raises(ConversionError, match="pass --hf-config-dir"):
        convert_megatron_to_hf(mg, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_layout_that_does_not_divide(model_a, tmp_path):
    from megatron_tg.parallel.dims import LayoutError

    with pytest.raises(LayoutError, match="num_experts=4 not divisible by ep=3"):
        convert_hf_to_megatron(model_a.dir, tmp_path / "out", ep=3)
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_config_of_another_model(model_a, tmp_path):
    from megatron_tg.convert.metadata import arch_dict, write_metadata
    from megatron_tg.models.qwen3_moe.config import Qwen3Arch

    mg = tmp_path / "mg"
    mg.mkdir()
    (mg / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    write_metadata(mg, {"architecture": arch_dict(Qwen3Arch.from_hf(model_a.dir))})
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((model_a.dir / "config.json").read_text())
    # A training-only field may differ; the expert width may not.
    cfg.update(router_aux_loss_coef=0.5, moe_intermediate_size=64)
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"different model.*moe_intermediate_size: config 64, "
                                              r"checkpoint 32$"):
        convert_megatron_to_hf(mg, tmp_path / "out", hf_config_dir=other)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def _rewrite_header(d: Path, edit) -> None:
    """Replace model.safetensors' JSON header by ``edit(header)`` (the data stays as it is)."""
    import struct

    f = d / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    text = json.dumps(edit(header)).encode()
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_header_that_is_not_an_object(model_a, tmp_path):
    d = _clone(model_a, tmp_path)
    _rewrite_header(d, lambda h: list(h))
    _refused(tmp_path, d, r"model\.safetensors: safetensors header is a JSON list")


def test_header_entry_without_offsets(model_a, tmp_path):
    d = _clone(model_a, tmp_path)

    def drop(h):
        del h[EXPERT]["data_offsets"]
        return h
    _rewrite_header(d, drop)
    _refused(tmp_path, d, rf"header entry '{EXPERT}' lacks data_offsets")


def test_overlapping_offsets_refused_in_the_parent(model_a, tmp_path):
    d = _clone(model_a, tmp_path)
    other = "model.layers.1.mlp.experts.2.up_proj.weight"

    def overlap(h):  # same size, shifted into its neighbour's bytes
        h[EXPERT]["data_offsets"] = list(h[other]["data_offsets"])
        return h
    _rewrite_header(d, overlap)
    _refused(tmp_path, d, r"overlap")


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.pop("num_attention_heads"), r"config\.json: required field num_attention_heads is missing"),
    # transformers 5 writes num_local_experts; an explicit 0 is not silently replaced by it.
    (lambda c: c.update(num_experts=0), r"config\.json: num_experts=0 and num_local_experts=4 differ"),
    (lambda c: (c.pop("num_local_experts", None), c.update(num_experts=0)),
     r"config\.json: num_experts=0: a qwen3_moe model needs at least one expert"),
    (lambda c: c.update(hidden_size="64"), r"config\.json: field hidden_size='64' is not an integer"),
])
def test_bad_config_fields_name_file_and_field(model_a, tmp_path, edit, match):
    d = _clone(model_a, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(tmp_path, d, match, exc=UnsupportedConfigError)


def test_broken_config_json_names_the_file(model_a, tmp_path, capsys):
    d = _clone(model_a, tmp_path)
    (d / "config.json").write_text('{"model_type": "qwen3_moe",')
    _refused(tmp_path, d, rf"{d / 'config.json'}: not valid JSON", exc=UnsupportedConfigError)
    assert hf_to_megatron_main(["--hf-dir", str(d), "--out-dir", str(tmp_path / "out")]) == 2
    assert str(d / "config.json") in capsys.readouterr().err


def test_export_refuses_a_truncated_distcp_in_the_parent(ckpt_a, tmp_path):
    mg = tmp_path / "mg"
    shutil.copytree(ckpt_a.dir, mg)
    part = max((mg).rglob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(part, "r+b") as fh:
        fh.truncate(part.stat().st_size - 100)
    with pytest.raises(ConversionError, match=rf"{part.name}: truncated: .* \(100 missing\)"):
        convert_megatron_to_hf(mg, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
