"""Part 2's three suites end to end on real tiny runs (development seed 0, a tiny base, 3
steps of 8 rollouts): the instruments are on, each arm's overrides reach its run, and the
verdicts written are the rules (megatron_tg/demo/claims2.py) on the runs' measures. About 4
minutes on 2 cores for the three."""

from __future__ import annotations

import argparse

import pytest

from megatron_tg.demo import claims2 as K
from megatron_tg.demo import dip_suite as DS
from megatron_tg.demo import paper_config_suite as PS
from megatron_tg.demo import paper_env as P
from megatron_tg.demo import stability_suite as SS
from megatron_tg.demo import suite2 as U

TINY_BASE = dict(steps=3, pool_size=48, tokenizer_docs=60, eval_episodes=4, warmup_steps=1)
"""A base that learns nothing (seconds to build): the suite's code path, not its result."""


@pytest.mark.slow
def test_the_stability_suite_on_real_tiny_runs(tmp_path, capsys):
    """Experiment S end to end on development seed 0 (tiny base, 3 steps of 8 rollouts, the
    three arms through the real loop, two at a time; a few minutes on 2 cores): the tiny
    base's success is outside the pre-registered range, which a development call warns about
    and goes on; every run has its instruments on; the verdicts in stability.json are the
    rules applied to the measures of the run directories; the label and the rule files'
    hashes are printed."""
    import json
    import sys

    import torch

    from megatron_tg.train.metrics import read_metrics

    n = torch.get_num_threads()
    out = tmp_path / "s"
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"defaults: [{SS.RECIPE}]\nrollout:\n  group_size: 4\n  prompts_per_step: 2\n"
                      "  buffer_size: 2\n")
    a = argparse.Namespace(out=str(out), jobs=2, seeds=(0,), steps=3, recipe=str(recipe))
    said = []
    try:
        assert SS.run(a, sys.executable, said.append, base_overrides=TINY_BASE) == 0
    finally:
        torch.set_num_threads(n)
    printed = capsys.readouterr().out
    assert any(s.startswith("WARNING: base outside") for s in said) or any(s.startswith("base check passes") for s in said)
    assert any(s.startswith("S base: success_no_hint") and "wrong_answer_fraction 0.5" in s for s in said)
    rec = json.loads((out / "stability.json").read_text())
    assert rec["seeds"] == [0] and rec["steps"] == 3 and "development seeds" in rec["seed_set"]
    assert "development seeds" in printed and not (out / "heldout_first.json").exists()
    dirs = {arm: [out / "runs" / f"{arm}-s0"] for arm, _, _ in SS.RUNS}
    m = U.measures(dirs, SS.CRITERIA)
    assert all(x[0]["steps"] == 3 and x[0]["dip_step"] == 3 for x in m.values())
    assert json.loads(json.dumps(K.stability(m, P.STYLE_CRITERIA), default=float)) == rec["verdicts"]
    for claim, v in rec["verdicts"].items():
        assert f"{claim:<16} {v['verdict']}" in printed
    for arm, (d,) in dirs.items():
        cfg = (d / "config.yaml").read_text()
        assert "update_stats: true" in cfg, arm
        rows = read_metrics(d)
        assert 0 in K.by_step(rows, K.CLOSE) and 3 in K.by_step(rows, K.CLOSE), arm
        assert set(K.by_step(rows, K.UPDATE_NORM)) >= {1, 2, 3}, arm
    assert "expert_feedback: placebo" in (dirs["placebo"][0] / "config.yaml").read_text()
    assert "expert_feedback: placebo" not in (dirs["tg"][0] / "config.yaml").read_text()
    prov = rec["provenance"]
    assert prov["files"] == {f: K.C.blob_hash(K.ROOT / f) for f in K.RULE_FILES}
    assert f"{K.CLAIMS2_DOC} {prov['files'][K.CLAIMS2_DOC][:12]}" in printed


def _tiny(tmp_path, recipe, seeds=(0,)):
    path = tmp_path / "tiny.yaml"
    path.write_text(f"defaults: [{recipe}]\nrollout:\n  group_size: 4\n  prompts_per_step: 2\n  buffer_size: 2\n")
    return argparse.Namespace(out=str(tmp_path / "out"), jobs=2, seeds=seeds, steps=3, recipe=str(path))


@pytest.mark.slow
def test_the_dip_suite_on_real_tiny_runs(tmp_path, capsys):
    """Experiment D end to end on development seed 0 (tiny base, 3 steps, the six arms): each
    arm's override reached its run's config, the instruments are on, the hypotheses' verdicts
    are the rules on the run directories' measures, and no fix is run."""
    import json
    import sys

    import torch

    n = torch.get_num_threads()
    a = _tiny(tmp_path, DS.RECIPE)
    try:
        assert DS.run(a, sys.executable, print, base_overrides=TINY_BASE) == 0
    finally:
        torch.set_num_threads(n)
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    rec = json.loads((out / "dip.json").read_text())
    dirs = {arm: [out / "runs" / f"{arm}-s0"] for arm, _, _ in DS.RUNS}
    m = U.measures(dirs, SS.CRITERIA)
    assert json.loads(json.dumps(K.dip(m, P.STYLE_CRITERIA), default=float)) == rec["verdicts"]
    assert set(rec["verdicts"]) == {"H1", "H2", "H3"} and rec["fix"] == "none defined"
    assert "no fix defined: none run" in printed and "H2" in printed
    cfg = {arm: (d / "config.yaml").read_text() for arm, (d,) in dirs.items()}
    assert all("update_stats: true" in c for c in cfg.values())
    assert "kl_coef: 10.0" in cfg["lambda_10"] and "kl_coef: 1.0" in cfg["tg"]
    assert "lr: 0.0001" in cfg["lr_low"] and "kl_token_normalization: global" in cfg["norm_global"]
    assert "mode: no_thinking" in cfg["no_thinking"] and "distill_actions: false" in cfg["thinking_only"]
    # the update ratio is measured (update_stats on in both runs)
    assert rec["update_ratio_lambda_10"][0] == rec["update_ratio_lambda_10"][0]


@pytest.mark.slow
def test_the_paper_config_suite_on_real_tiny_runs(tmp_path, capsys, monkeypatch):
    """Experiment P end to end on development seed 0 for its 1e-3 level only (a tiny main
    base, 3 steps, grpo and paper_tg): the base's probability is printed with the factor
    check, paper_tg runs the paper's settings, and the level's verdict is the rules'."""
    import json
    import sys

    import torch

    monkeypatch.setattr(K, "P_LEVELS", ("1e-3",))
    n = torch.get_num_threads()
    a = _tiny(tmp_path, PS.RECIPE)
    said = []
    try:
        assert PS.run(a, sys.executable, said.append, base_overrides=TINY_BASE) == 0
    finally:
        torch.set_num_threads(n)
    printed = capsys.readouterr().out
    assert any(s.startswith("base 1e-3: p_branch no hint mean") and "within x3 of 1e-3" in s for s in said)
    out = tmp_path / "out"
    rec = json.loads((out / "paper_config.json").read_text())
    dirs = {arm: [out / "p1e-3" / "runs" / f"{arm}-s0"] for arm, _, _ in PS.RUNS}
    m = {"1e-3": U.measures(dirs, PS.CRITERIA)}
    v = json.loads(json.dumps(K.paper_config(m), default=float))
    assert v["levels"] == rec["verdicts"] and v["boundary"] == rec["boundary"] and v["boundary"] in printed
    cfg = (dirs["paper_tg"][0] / "config.yaml").read_text()
    for want in ("kl_direction: reverse", "expert: shared", "expert_feedback: failing", "hinted_samples: 0",
                 "update_stats: true"):
        assert want in cfg, want
