"""Parameter counts of the public Qwen3 MoE configs, and the shards the builder really makes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tg.models.describe import built_shards, param_counts
from megatron_tg.models.qwen3_moe.config import Qwen3Arch, padded_vocab_size

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"

# (config file, published total, published active, digits after the point in the figure)
PUBLISHED = [
    ("qwen3-coder-30b-a3b-instruct.json", 30.5e9, 3.3e9, 1),
    ("qwen3-235b-a22b.json", 235e9, 22e9, 0),
    ("qwen3-coder-480b-a35b-instruct.json", 480e9, 35e9, 0),
]


@pytest.mark.parametrize("name,total,active,digits", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_counts_match_published_figures(name, total, active, digits):
    counts = param_counts(Qwen3Arch.from_hf(FIXTURES / name))
    assert abs(counts["total_params"] - total) / total < 0.01
    # The model cards truncate to the digits shown (30.53B -> "30.5B", 3.353B -> "3.3B",
    # 35.47B -> "35B"): the exact count lies in [published, published + one last digit).
    unit = 1e9 * 10 ** -digits
    assert active <= counts["active_params"] < active + unit, counts
    assert total <= counts["total_params"] < total + unit, counts


def test_built_model_equals_analytic_count_at_tp1():
    arch = Qwen3Arch.from_hf(FIXTURES / "qwen3-coder-30b-a3b-instruct.json")
    (stage,) = built_shards(arch)
    assert stage["params"] == param_counts(arch)["total_params"]


def test_built_shards_under_tp_ep_pp():
    arch = Qwen3Arch.from_hf(FIXTURES / "qwen3-coder-30b-a3b-instruct.json")
    tp, ep, pp = 2, 8, 2
    stages = built_shards(arch, tp=tp, ep=ep, pp=pp)
    h, hd, e = arch.hidden_size, arch.head_dim, arch.num_experts
    layers = arch.num_layers // pp
    expert = 3 * h * arch.moe_intermediate_size
    # Experts: E/ep experts per rank, each split over etp (= tp by default).
    for s in stages:
        assert s["expert_params"] == layers * (e // ep) * expert // tp
    # Dense: TP-split attention, replicated norms/router, embedding on the first stage,
    # output layer + final norm on the last, both with the padded vocabulary.
    attn = (h * arch.num_attention_heads * hd * 2 + 2 * h * arch.num_key_value_heads * hd) // tp
    per_layer = attn + 2 * hd + 2 * h + e * h
    vocab_rows = padded_vocab_size(arch.vocab_size, tp) // tp
    assert stages[0]["dense_params"] == layers * per_layer + vocab_rows * h
    assert stages[1]["dense_params"] == layers * per_layer + vocab_rows * h + h


def test_describe_cli_prints_json_last():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-m", "megatron_tg.cli", "describe", "--hf-config",
         str(FIXTURES / "qwen3-235b-a22b.json"), "--tp", "4", "--ep", "8"],
        capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert math.isclose(info["total_params"], 235e9, rel_tol=0.01)
    assert math.isclose(info["active_params"], 22e9, rel_tol=0.01)
    assert info["layout"] == {"tp": 4, "ep": 8, "pp": 1, "etp": 4}
    assert info["per_rank"][0]["expert_params"] * 8 * 4 == (
        94 * 128 * 3 * 4096 * 1536), info["per_rank"]


def test_describe_refuses_a_layout_that_does_not_divide():
    arch = Qwen3Arch.from_hf(FIXTURES / "qwen3-coder-30b-a3b-instruct.json")
    from megatron_tg.parallel.dims import LayoutError

    with pytest.raises(LayoutError, match="num_experts=128 not divisible by ep=3"):
        built_shards(arch, ep=3)
