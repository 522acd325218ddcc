"""``--dry-run`` reads config.json only and prints the per-rank shard plan."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_tg.convert.plan import shard_plan
from megatron_tg.models.describe import built_shards
from megatron_tg.models.qwen3_moe.config import Qwen3Arch

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "hf_configs"
CFG_30B = FIXTURES / "qwen3-coder-30b-a3b-instruct.json"


def test_dry_run_30b_through_the_tool(tmp_path, monkeypatch, capsys):
    # config.json alone in a model dir: no weights are needed (or read). The tool script
    # runs in this process (runpy, as __main__), which saves a second interpreter's imports.
    (tmp_path / "config.json").write_text(CFG_30B.read_text())
    monkeypatch.setattr(sys, "argv", ["convert_hf_to_megatron.py", "--hf-dir", str(tmp_path),
                                      "--tp", "2", "--ep", "4", "--pp", "2", "--dry-run"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "tools" / "convert_hf_to_megatron.py"), run_name="__main__")
    out = capsys.readouterr()
    assert exit_.value.code == 0, out.err
    proc = SimpleNamespace(stdout=out.out)
    lines = proc.stdout.strip().splitlines()
    assert "-> 16 processes" in lines[0] and "qwen3_moe in bfloat16" in lines[0]
    stage_lines = [ln for ln in lines if ln.strip().startswith("pp stage")]
    assert len(stage_lines) == 2
    assert all("megatron tensors from" in ln and "GB" in ln for ln in stage_lines)
    plan = json.loads(lines[-1])
    assert plan["layout"] == {"tp": 2, "ep": 4, "pp": 2, "etp": 2, "world_size": 16}
    assert 60e9 < plan["checkpoint_bytes"] < 62e9  # 30.5B params in bf16
    # Per rank: (dense / tp) + (experts / (ep * etp)) of 24 layers; the stages agree with
    # the builder and cover the whole model once DP replicas are discounted.
    stages = built_shards(Qwen3Arch.from_hf(CFG_30B), tp=2, ep=4, pp=2)
    for row, built in zip(plan["per_rank"], stages):
        assert row["megatron_tensors"] == built["tensors"] and row["bytes"] == built["bytes"]
        assert row["ranks"] == 8
        # 24 layers x (9 + 128 / 4 * 3 + 1) HF tensors, plus the embedding or head + norm
        assert row["hf_tensors_read"] == 24 * (8 + 1 + 96) + (1 if row["pp_stage"] == 0 else 2)


@pytest.mark.parametrize("name", ["qwen3-235b-a22b.json", "qwen3-coder-480b-a35b-instruct.json"])
def test_dry_run_big_configs(name):
    plan = shard_plan(FIXTURES / name, tp=4, ep=8, pp=2)  # 94 and 62 layers: pp=2 divides
    assert plan["layout"]["world_size"] == 64
    assert len(plan["per_rank"]) == 2
    assert all(r["bytes"] > 0 and r["megatron_tensors"] > 0 for r in plan["per_rank"])
