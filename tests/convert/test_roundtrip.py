"""HF -> megatron -> HF is bit-exact, and the result loads with ``from_pretrained``.

A: single-file source, written at TP=2 x EP=2, exported reading at TP=2 x EP=2.
B: sharded-index source, written at PP=2, exported reading at PP=2.
Both exports use a small ``max_shard_size`` so the index and several writer ranks' files
are exercised.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_tg.convert import convert_megatron_to_hf
from megatron_tg.convert.common import FORMAT_VERSION, METADATA_FILE
from tests.convert.conftest import SIDE_FILES, leftovers

# Spawns gloo workers (conversions, exports, a 4-rank load): minutes on 2 shared cores.
pytestmark = pytest.mark.slow

CASES = {"A": ("model_a", "ckpt_a", dict(tp=2, ep=2)), "B": ("model_b", "ckpt_b", dict(pp=2))}


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, workdir):
    model_name, ckpt_name, layout = CASES[request.param]
    model = request.getfixturevalue(model_name)
    ckpt = request.getfixturevalue(ckpt_name)
    out = workdir / f"hf_back_{request.param}"
    result = convert_megatron_to_hf(ckpt.dir, out, max_shard_size="150KB", progress=False,
                                    **layout)
    return model, ckpt, out, result


def test_bit_exact_and_same_keys(exported):
    model, _, out, result = exported
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).exists() for f in files)
    back = {}
    for f in files:
        part = load_file(out / f)
        assert all(index["weight_map"][k] == f for k in part)
        back.update(part)
    assert set(back) == set(model.state), set(back) ^ set(model.state)
    for name, t in model.state.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in model.state.values())
    assert result.tensors == len(model.state) and "MB/s" in result.summary


def test_side_files_restored(exported):
    model, _, out, _ = exported
    for name, text in SIDE_FILES.items():
        assert (out / name).read_text() == text
    src = json.loads((model.dir / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == src
    assert (out / "generation_config.json").exists()


def test_from_pretrained_gives_identical_logits(exported):
    from transformers import AutoModelForCausalLM

    model, _, out, _ = exported
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=gen)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model.model(tokens).logits)


def test_checkpoint_metadata(exported):
    model, ckpt, _, _ = exported
    meta = json.loads((ckpt.dir / METADATA_FILE).read_text())
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["hf_dtype"] == "float32"
    assert meta["tensor_count"]["hf"] == len(model.state)
    assert meta["architecture"]["num_experts"] == 4
    assert meta["source"]["name"] == model.dir.name
    assert meta["writer_layout"]["world_size"] == len(ckpt.result.ranks)
    assert sorted(meta["hf_files"]) == sorted(["config.json", "generation_config.json",
                                               *SIDE_FILES])
    assert leftovers(ckpt.dir.parent) == []
