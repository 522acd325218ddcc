"""Part 2's three suites (megatron_tg/demo/{stability,dip,paper_config}_suite.py, suite2.py): the
seeds, the fix seeds, the base gates, the build-only record and the refusal of an unrecorded
base, the fix's once-only call, and the verdicts written being the rules on the runs'
measures. The runs are faked (hand-made metrics.jsonl rows per arm) except in one slow smoke
test, which runs experiment S for real on a tiny base."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from megatron_tg.demo import claims2 as K
from megatron_tg.demo import claims2_verdicts as V
from megatron_tg.demo import dip_suite as DS
from megatron_tg.demo import paper_config_suite as PS
from megatron_tg.demo import paper_env as P
from megatron_tg.demo import runs as R
from megatron_tg.demo import stability_suite as SS
from megatron_tg.demo import suite2 as U

TINY_BASE = dict(steps=3, pool_size=48, tokenizer_docs=60, eval_episodes=4, warmup_steps=1)
"""A base that learns nothing (seconds to build): the suite's code path, not its result."""
PASS = {"tg": [0.9, 0.9, 0.9, 0.5, 0.3, 0.3, 0.6, 0.9], "lr_low": [0.9, 0.9, 0.9, 0.8, 0.7, 0.7, 0.8, 0.9]}


def fake_rows(name: str, steps: int = 8) -> list[dict]:
    """metrics.jsonl rows for run ``<arm>-s<seed>``: the pass series by arm, the probes and
    the update norm, a little different per seed."""
    arm, seed = name.rsplit("-s", 1)
    j = int(seed) % 3 * 0.01
    pas = PASS.get(arm, [0.5, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9])[:steps]
    out = [{"step": 0, K.CLOSE: -0.01, K.BRANCH: -8.0}]
    for t, v in enumerate(pas, 1):
        out.append({"step": t, K.PASS: v - j, "criteria/search_lines": 0.95, "criteria/answer_style": 0.95,
                    "criteria/brief_thinking": 0.95 if arm != "grpo" else 0.2, K.UPDATE_NORM: 1.0 + j,
                    K.CLOSE: -0.01 - (1.0 if arm == "tg" and t >= 2 else 0.0), K.BRANCH: -8.0 + t})
    return out


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Fake bases, conversion and runs; every base recorded; the record files under tmp_path."""
    made = []

    def run_all(specs, out, plan, py, recipe, jobs, inputs):
        got = {}
        for s in specs:
            d = out / "runs" / s.name
            d.mkdir(parents=True, exist_ok=True)
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in fake_rows(s.name)) + "\n")
            made.append(s)
            got[s.name] = d
        return got

    def base(out_dir, seed=0, log=None, **kw):
        return {"build_hash": "f" * 64, "weights_sha256": "e" * 16, "success_no_hint": 0.5, "search_lines_no_hint": 0.1,
                "answer_style_no_hint": 0.5, "brief_thinking_no_hint": 0.5, "success_all_hints": 0.9,
                "search_lines_all_hints": 0.9}
    monkeypatch.setattr(R, "run_all", run_all)
    monkeypatch.setattr(R, "convert", lambda *a: None)
    monkeypatch.setattr(SS.PB, "build", base)
    monkeypatch.setattr(U, "recorded", lambda h, root=None: True)
    monkeypatch.setattr(U, "ROOT", tmp_path)
    return made


def args(tmp_path, seeds=None, steps=None, recipe=SS.RECIPE, **kw):
    return argparse.Namespace(out=str(tmp_path / "out"), seeds=seeds, steps=steps, jobs=1, recipe=str(recipe), **kw)


def test_the_dip_suite_and_its_fix_once(fake, tmp_path, capsys):
    said = []
    assert DS.run(args(tmp_path), "python", said.append) == 0  # the held-out call (faked runs)
    out = tmp_path / "out"
    assert len(fake) == 9 * 5 and {s.name.rsplit("-s", 1)[0] for s in fake} == set(V.D_ARMS)
    rec = json.loads((out / "dip.json").read_text())
    m = U.measures({arm: [out / "runs" / f"{arm}-s{s}" for s in K.HELDOUT_SEEDS] for arm in V.D_ARMS},
                   SS.CRITERIA)
    assert json.loads(json.dumps(V.dip(m), default=float)) == rec["verdicts"]
    assert rec["verdicts"]["precondition"]["verdict"] == "holds" and rec["verdicts"]["H1"]["verdict"] == "refuted"
    printed = capsys.readouterr().out
    assert "reading: " in printed and "Student-t" in printed and (out / "heldout_first.json").exists()
    # the faked runs confirm H2 (the close falls first, action_x4 does not dip); the fix
    # follows the first record: make it say H1 confirmed, H2 refuted
    assert rec["verdicts"]["H2"]["verdict"] == "confirmed"
    first = json.loads((out / "heldout_first.json").read_text())
    first["verdicts"]["H1"]["verdict"], first["verdicts"]["H2"]["verdict"] = "confirmed", "refuted"
    (out / "heldout_first.json").write_text(json.dumps(first))
    fake.clear()
    assert DS.run(args(tmp_path, seeds=K.FIX_SEEDS), "python", said.append) == 0
    assert [s.name for s in fake[:2]] == ["tg-s13", "tg_fix-s13"] and len(fake) == 10
    assert fake[1].extra[0] == "optimizer.lr=0.0001"
    fix = json.loads((out / "dip_fix.json").read_text())
    assert set(fix["verdicts"]) == {"fix"} and fix["fix_overrides"] == ["optimizer.lr=0.0001"]
    assert fix["verdicts"]["fix"]["verdict"] == "validated"  # tg_fix's faked series rises, tg's dips
    assert (out / "fix_first.json").exists()
    # once only: a second call on the fix seeds is refused before any run
    fake.clear()
    assert DS.run(args(tmp_path, seeds=K.FIX_SEEDS), "python", said.append) == U.FIX_REFUSED
    assert not fake and "first write wins" in said[-1]


def test_the_fix_needs_the_held_out_record_and_a_confirmed_h1_or_h2(fake, tmp_path):
    said = []
    assert DS.run(args(tmp_path, seeds=K.FIX_SEEDS), "python", said.append) == U.FIX_REFUSED
    assert "no held-out dip record" in said[-1] and not fake
    assert DS.run(args(tmp_path, seeds=K.FIX_SEEDS, steps=3), "python", said.append) == U.FIX_REFUSED
    assert "at the pre-registered 25 steps" in said[-1]
    out = tmp_path / "out"
    (out / "heldout_first.json").write_text(json.dumps({"suite": "dip", "seed_set": "held-out (...)", "verdicts": {
        h: {"verdict": v} for h, v in (("H1", "refuted"), ("H2", "refuted"), ("H3", "confirmed"))}}))
    assert DS.run(args(tmp_path, seeds=K.FIX_SEEDS), "python", said.append) == 0
    assert "no fix is run" in said[-1] and not fake


def test_the_stability_suite_runs_the_power_check_first(fake, tmp_path, monkeypatch):
    said = []
    assert SS.run(args(tmp_path), "python", said.append) == 0
    assert [s.seed for s in fake[:6]] == [0, 0, 1, 1, 2, 2] and [s.seed for s in fake[6:]][:3] == [8, 8, 8]
    rec = json.loads((tmp_path / "out" / "stability.json").read_text())
    assert rec["power"]["seeds"] == 3 and any(s.startswith("power (development seeds 0,1,2)") for s in said)
    assert set(rec["verdicts"]) == {"no_degradation", "from_feedback"}
    # outside [0.3, 0.7] on a held-out call: stopped before any RL run
    fake.clear()
    monkeypatch.setattr(SS.PB, "build", lambda *a, **k: {
        "build_hash": "f" * 64, "success_no_hint": 0.9, "search_lines_no_hint": 0.1, "answer_style_no_hint": 0.5,
        "brief_thinking_no_hint": 0.5, "success_all_hints": 0.9})
    assert SS.run(args(tmp_path), "python", said.append) == U.BASE_REFUSED and not fake


def test_build_only_writes_the_record_and_an_unrecorded_base_is_refused(fake, tmp_path, monkeypatch):
    said = []
    assert DS.run(args(tmp_path, build_only=True), "python", said.append) == 0 and not fake
    rec = json.loads((tmp_path / "docs" / "results" / "claims2-dip-base.json").read_text())
    assert rec["bases"]["D"]["build_hash"] == "f" * 64 and rec["bases"]["D"]["success_no_hint"] == 0.5
    monkeypatch.setattr(U, "recorded", lambda h, root=None: False)
    assert DS.run(args(tmp_path, seeds=(0,)), "python", said.append) == U.BASE_UNRECORDED and not fake
    assert said[-1].startswith("REFUSED") and "--build-only" in said[-1]
    assert DS.run(args(tmp_path, seeds=(0,)), "python", said.append, require_record=False) == 0
    assert any(s.startswith("WARNING: base not committed") for s in said)


def test_a_base_with_the_recorded_hash_but_other_weights_is_refused(fake, tmp_path, monkeypatch):
    """The same settings train other weights on another CPU: the build hash names the inputs,
    the weights digest the base. A record with the digest is this base, whatever the hash; a
    record with the hash but not the digest is not."""
    said = []
    assert DS.run(args(tmp_path, build_only=True), "python", said.append) == 0
    rec = json.loads((tmp_path / "docs" / "results" / "claims2-dip-base.json").read_text())
    assert rec["bases"]["D"]["weights_sha256"] == "e" * 16 and set(rec["environment"]) == {"torch", "transformers"}
    committed = json.dumps(rec, indent=2, sort_keys=True)
    monkeypatch.setattr(U, "recorded", lambda h, root=None: h in committed)
    assert DS.run(args(tmp_path, seeds=(0,)), "python", said.append) == 0 and fake  # hash and weights committed
    fake.clear()
    committed = committed.replace("f" * 64, "a" * 64)  # a source edit changed the hash, not the weights
    assert DS.run(args(tmp_path, seeds=(0,)), "python", said.append) == 0 and fake
    fake.clear()
    committed = committed.replace("a" * 64, "f" * 64)
    committed = committed.replace("e" * 16, "d" * 16)  # the record another machine's build wrote
    assert DS.run(args(tmp_path, seeds=(0,)), "python", said.append) == U.BASE_UNRECORDED and not fake
    assert said[-1].startswith("REFUSED") and "not these weights (eeeeeeeeeeeeeeee)" in said[-1]
    assert "not bit-reproducible across CPUs" in said[-1]


def test_paper_config_gates_every_level(fake, tmp_path, monkeypatch, capsys):
    p = {"1e-4": 1e-4, "1e-3": 8.4e-4, "1e-2": 2e-3}  # 1e-2's misses the factor of 3

    def base(out_dir, seed=0, log=None, **kw):
        lvl = next(k for k, v in PS.LEVELS.items() if all(kw.get(x) == y for x, y in v.items()))
        return {"build_hash": lvl * 8, "weights_sha256": lvl * 4, "p_branch_no_hint_mean": p[lvl], "p_branch_no_hint_max": p[lvl],
                "new_format_no_hint": 0.0, "success_no_hint": 0.98, "new_format_hint": 0.9}
    monkeypatch.setattr(PS.B, "build_base_model", base)
    said = []
    assert PS.run(args(tmp_path, recipe=PS.RECIPE), "python", said.append) == U.BASE_REFUSED and not fake
    assert "missed: 1e-2 (2.00e-03)" in said[-1]
    assert PS.run(args(tmp_path, recipe=PS.RECIPE, build_only=True), "python", said.append) == 0
    rec = json.loads((tmp_path / "docs" / "results" / "claims2-paper_config-base.json").read_text())
    assert set(rec["bases"]) == set(K.P_LEVELS)
    p["1e-2"] = 1e-2
    assert PS.run(args(tmp_path, recipe=PS.RECIPE), "python", said.append) == 0 and len(fake) == 3 * 2 * 5
    printed = capsys.readouterr().out
    assert "levels by measured probability: 1e-4 (measured 1.00e-04), 1e-3 (measured 8.40e-04)" in printed
    assert "under the demo's optimizer" in printed
    rec = json.loads((tmp_path / "out" / "paper_config.json").read_text())
    assert set(rec["verdicts"]) == set(K.P_LEVELS) and rec["boundary"] in printed


def test_recorded_reads_docs_results_at_head():
    assert U.recorded("521c45e4b80916cb2c96a247d68fc2f06e0c68c0") is True  # part 1's held-out record
    assert U.recorded("0123456789abcdef" * 4) is False


# ------------------------------------------------------------------------------ seeds, gate, dispatch
def test_the_base_gate_stops_a_held_out_call_only():
    said = []
    assert U.base_gate({"kind": "held-out (the pre-registered report)"}, False, "x", said.append) is False
    assert "no RL run is made" in said[-1]
    assert U.base_gate({"kind": "NOT the pre-registered report: development seeds"}, False, "x", said.append)
    assert said[-1].startswith("WARNING")
    assert PS.within_factor(4e-4, "1e-3") and not PS.within_factor(3e-4, "1e-3")
    assert not PS.within_factor(math.nan, "1e-3")


def test_specs_have_the_instruments_and_the_probe():
    specs = U.run_specs(SS.RUNS, (0, 1))
    assert [s.name for s in specs] == ["grpo-s0", "tg-s0", "placebo-s0", "grpo-s1", "tg-s1", "placebo-s1"]
    assert all("logging.update_stats=true" in s.overrides() for s in specs)
    assert "objective.expert_feedback=placebo" in specs[2].overrides()
    p = U.plan(25, (0,), U.PAPER_RL_ARGS)
    assert p.seeded and p.rl_args[-4:] == ("--call-probe-every", "1", "--call-probe-n", "16")


@pytest.mark.parametrize("suite, module", [("stability", SS), ("dip", DS), ("paper_config", PS)])
def test_the_command_reaches_each_suite_with_the_held_out_seeds_by_default(suite, module, monkeypatch, tmp_path):
    from megatron_tg.demo import command as D

    got = []
    monkeypatch.setattr(module, "run", lambda a, py, log: got.append(a) or 0)
    assert D.main(["--suite", suite, "--out", str(tmp_path)]) == 0 and got[-1].seeds is None
    assert got[-1].build_only is False
    ctx = U.start(got[-1], [].append, suite)
    assert ctx["seeds"] == K.HELDOUT_SEEDS and ctx["kind"].startswith("held-out")
    assert D.main(["--suite", suite, "--seeds", "0,1,2", "--build-only", "--out", str(tmp_path)]) == 0
    assert got[-1].seeds == (0, 1, 2) and got[-1].build_only is True
    with pytest.raises(SystemExit):
        D.main(["--suite", suite, "--quick"])


def test_build_only_is_for_part_2():
    from megatron_tg.demo import command as D

    with pytest.raises(SystemExit):
        D.main(["--suite", "paper", "--build-only"])


@pytest.mark.parametrize("module, seeds", [(SS, (0, 13)), (SS, K.FIX_SEEDS), (PS, K.FIX_SEEDS), (DS, (0, 13)),
                                           (DS, (13, 14))])
def test_the_fix_seeds_are_the_fix_s_only(module, seeds, tmp_path):
    said = []
    a = argparse.Namespace(out=str(tmp_path / "o"), seeds=seeds, steps=None, jobs=1, recipe=str(module.RECIPE))
    assert module.run(a, "python", said.append) == U.FIX_REFUSED and "kept for validating the fix" in said[-1]
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_the_stability_suite_on_real_tiny_runs(tmp_path, capsys):
    """The one real smoke test of part 2's suites (they share suite2's path: base, conversion,
    run_all, measures, verdicts, record): experiment S on development seed 0, a tiny base, 3
    steps of 8 rollouts, its three arms through the real loop in the paper environment, two
    at a time. Every run has the instruments and the call probe on; the placebo arm's setting
    reached its config; the verdicts written are the rules on the run directories' measures."""
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
        assert SS.run(a, sys.executable, said.append, base_overrides=TINY_BASE, require_record=False) == 0
    finally:
        torch.set_num_threads(n)
    printed = capsys.readouterr().out
    assert any(s.startswith("WARNING: base not committed") for s in said)
    assert any(s.startswith("S base: success_no_hint") and "skip_search_fraction 0.3" in s for s in said)
    rec = json.loads((out / "stability.json").read_text())
    assert rec["seeds"] == [0] and rec["steps"] == 3 and "development seeds" in rec["seed_set"]
    assert "development seeds" in printed and not (out / "heldout_first.json").exists()
    dirs = {arm: [out / "runs" / f"{arm}-s0"] for arm, _, _ in SS.RUNS}
    m = U.measures(dirs, SS.CRITERIA)
    assert all(x[0]["steps"] == 3 and x[0]["dip_step"] == 3 for x in m.values())
    assert json.loads(json.dumps(V.stability(m, P.STYLE_CRITERIA), default=float)) == rec["verdicts"]
    # one seed: the tests needing an interval are undecided, never failed
    assert rec["verdicts"]["no_degradation"]["tests"]["worst_vs_grpo"]["status"] == "undecided"
    for claim, v in rec["verdicts"].items():
        assert f"{claim:<16} {v['verdict']}" in printed
    for arm, (d,) in dirs.items():
        assert "update_stats: true" in (d / "config.yaml").read_text(), arm
        rows = read_metrics(d)
        assert {0, 3} <= set(K.by_step(rows, K.CLOSE)) and {0, 3} <= set(K.by_step(rows, K.BRANCH)), arm
        assert set(K.by_step(rows, K.UPDATE_NORM)) >= {1, 2, 3}, arm
        assert m[arm][0]["close_fall"] == m[arm][0]["close_fall"]  # measured, from the real probe
    assert "expert_feedback: placebo" in (dirs["placebo"][0] / "config.yaml").read_text()
    assert "expert_feedback: placebo" not in (dirs["tg"][0] / "config.yaml").read_text()
    prov = rec["provenance"]
    assert prov["files"] == {f: K.C.blob_hash(K.ROOT / f) for f in K.RULE_FILES}
    assert f"{K.CLAIMS2_DOC} {prov['files'][K.CLAIMS2_DOC][:12]}" in printed
