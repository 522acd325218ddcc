"""Tiny random Qwen3-MoE models on disk and their converted checkpoints, shared by the tests.

Every conversion spawns gloo workers (several seconds of imports each on 2 cores), so the
checkpoints are session fixtures, converted once and read by several tests:
- model A: one ``model.safetensors`` (3 layers, layer 0 dense), plus tokenizer-like side
  files; converted at TP=2 x EP=2 (4 workers).
- model B: a different seed, 4 layers, saved as a sharded ``model.safetensors.index.json``
  source; converted at PP=2 (2 workers), so the pipeline-stage layer renumbering is used.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.models.qwen3_moe.common import tiny_hf_model

SIDE_FILES = {
    "tokenizer_config.json": json.dumps({"model_max_length": 64, "tokenizer_class": "Dummy"}),
    "special_tokens_map.json": json.dumps({"eos_token": "<eos>"}),
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}",
}


def save_model(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    for name, text in SIDE_FILES.items():
        (path / name).write_text(text)
    return path


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="session")
def model_a(workdir):
    cfg, model, state = tiny_hf_model(seed=0)
    path = save_model(model, workdir / "hf_a")
    assert (path / "model.safetensors").exists()
    return SimpleNamespace(dir=path, cfg=cfg, model=model, state=state)


@pytest.fixture(scope="session")
def model_b(workdir):
    cfg, model, state = tiny_hf_model(seed=1, num_hidden_layers=4)
    path = save_model(model, workdir / "hf_b", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    return SimpleNamespace(dir=path, cfg=cfg, model=model, state=state)


@pytest.fixture(scope="session")
def ckpt_a(model_a, workdir):
    from megatron_tg.convert import convert_hf_to_megatron

    result = convert_hf_to_megatron(model_a.dir, workdir / "mg_a", tp=2, ep=2, progress=False)
    return SimpleNamespace(dir=workdir / "mg_a", result=result)


@pytest.fixture(scope="session")
def ckpt_b(model_b, workdir):
    from megatron_tg.convert import convert_hf_to_megatron

    result = convert_hf_to_megatron(model_b.dir, workdir / "mg_b", pp=2, progress=False)
    return SimpleNamespace(dir=workdir / "mg_b", result=result)


def leftovers(parent: Path) -> list[str]:
    """Temporary dirs a conversion would leave behind after a failure."""
    return sorted(p.name for p in Path(parent).iterdir()
                  if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name))
