"""The run manifest: what produced a run, appended at every start, changes since the first."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_tg.config import load_config
from megatron_tg.train.manifest import write_manifest


def test_manifest_records_each_start_and_what_changed(tmp_path, monkeypatch):
    cfg = load_config("recipes/tiny_cpu.yaml", [f"logging.run_dir={tmp_path}"])
    write_manifest(tmp_path, cfg, step=0, engines=[{"url": "http://e0", "version": "0.5.23"}])
    doc = json.loads((tmp_path / "manifest.json").read_text())
    (first,) = doc["starts"]
    assert first["step"] == 0 and first["packages"]["torch"] == torch.__version__
    assert first["packages"]["megatron-core"] is not None
    assert first["config"]["objective"]["kl_coef"] == cfg.objective.kl_coef
    assert first["judge"]["rubric"] == cfg.judge.rubric and first["judge"]["rubric_sha256"]
    assert first["engines"] == [{"url": "http://e0", "version": "0.5.23"}]
    assert first["git"] is None or len(first["git"]["revision"]) == 40
    # a resume on a node with another torch and a changed learning rate
    import megatron_tg.train.manifest as m

    real = m.package_versions
    monkeypatch.setattr(m, "package_versions", lambda: {**real(), "torch": "9.9"})
    cfg2 = load_config("recipes/tiny_cpu.yaml", [f"logging.run_dir={tmp_path}", "optimizer.lr=0.5"])
    write_manifest(tmp_path, cfg2, step=7)
    starts = json.loads((tmp_path / "manifest.json").read_text())["starts"]
    assert [s["step"] for s in starts] == [0, 7]
    assert starts[1]["changed_since_first"] == ["config.optimizer", "packages.torch"]
    assert not list(tmp_path.glob(".manifest.json.*"))  # no temporary left behind


def test_llm_judge_identity_has_its_prompt(tmp_path):
    from megatron_tg.judge.llm import SYSTEM_PROMPT

    cfg = load_config("recipes/tiny_cpu.yaml", ["judge.endpoint=http://judge:8000/v1",
                                                "judge.model=qwen-judge"])
    write_manifest(tmp_path, cfg, step=0)
    judge = json.loads((tmp_path / "manifest.json").read_text())["starts"][0]["judge"]
    assert (judge["model"], judge["prompt"]) == ("qwen-judge", SYSTEM_PROMPT)


def test_unreadable_manifest_is_never_overwritten(tmp_path):
    (tmp_path / "manifest.json").write_text("{broken")
    cfg = load_config("recipes/tiny_cpu.yaml", [])
    with pytest.raises(RuntimeError, match="unreadable run manifest"):
        write_manifest(tmp_path, cfg, step=3)
    assert (tmp_path / "manifest.json").read_text() == "{broken"
