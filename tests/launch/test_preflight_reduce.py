"""megatron_tg.launch.preflight's pieces that need no cluster: the recipe reduced to one
node, the routing-replay row, the table (slurm/preflight.sh runs them on the local Slurm
cluster in tests/slurm/test_preflight.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_tg.config import ConfigError, load_config
from megatron_tg.launch import preflight as PF
from megatron_tg.launch.plan import Knobs, make_plan

ROOT = Path(__file__).resolve().parents[2]
R30, R235, R480 = (str(ROOT / "recipes" / f"{n}.yaml") for n in ("tg_30b", "tg_235b", "tg_480b"))


def test_30b_reduces_to_half_a_node_keeping_tp_and_the_engines():
    out = PF.reduce_overrides(R30, 4)
    cfg = load_config(R30, out)
    assert cfg.parallel.tp == 2 and cfg.parallel.ep == 4 and cfg.steps == 1
    cfg.layout(4)  # the trainer accepts it
    assert f"judge.rubric={PF.RULE_RUBRIC}" in out  # style_suite has LLM criteria and no endpoint here
    plan = make_plan(R30, out, Knobs(nodes=2, train_nodes=1, rollout_nodes=1, gpus_per_node=4,
                                     hosts=("n1", "n1"), addrs=("10.0.0.1", "10.0.0.1")))
    engines = [s for s in plan.servers if s.role == "engine"]
    assert len(engines) == 2 and all(s.gpus == 2 for s in engines)  # the recipe's engine TP
    assert plan.router_url and {s.addr for s in plan.servers} == {"10.0.0.1"}
    assert "judge.rubric" not in " ".join(PF.reduce_overrides(R30, 4, judge_url="http://j:1"))


def test_layouts_that_cannot_fit_are_named():
    with pytest.raises(ConfigError, match="tp 4 x cp 1 x pp 2 = 8 ranks do not fit 4 trainer GPUs"):
        PF.reduce_overrides(R235, 4)  # TP4 x PP2 needs 8 trainer GPUs
    out = PF.reduce_overrides(R235, 4, ["parallel.pp=1"])  # the fix the message suggests
    assert "parallel.ep=4" in out


def test_routing_replay_row_and_table(tmp_path):
    assert PF.check_routing(R30, [])[1] == "PASS"  # MoE, replay on by default
    off = PF.check_routing(R30, ["rollout.routing_replay=false"])
    assert off[1] == "FAIL" and "rollout.routing_replay=false" in off[2]
    results = tmp_path / "r.tsv"
    PF.record(results, "plan", "PASS", "ok")
    PF.record(results, "engines started", "FAIL", "exit 1\nsee log")
    text, code = PF.table(results)
    assert code == 1 and text.splitlines()[-1] == "preflight: FAILED: engines started"
    assert "engines started  FAIL    exit 1 see log" in text
    with pytest.raises(ValueError):
        PF.record(results, "x", "OK", "")
    assert PF.table(tmp_path / "none.tsv")[1] == 1  # no rows: not a pass
