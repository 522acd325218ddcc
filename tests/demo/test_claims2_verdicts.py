"""Part 2's experiments decided on hand-made measures (megatron_tg/demo/claims2_verdicts.py):
each claim, precondition, hypothesis, fix and level is reproduced / confirmed where its tests
pass, refuted or not reproduced where one fails, and undecided where a statistic it needs
cannot be computed."""

from __future__ import annotations

import math

import pytest

from megatron_tg.demo import claims2 as K
from megatron_tg.demo import claims2_verdicts as V
from megatron_tg.demo import paper_env as P

SEEDS = 5
STYLE_OK = {"search_lines": 0.95, "answer_style": 0.95, "brief_thinking": 0.95}
STYLE_NO = {"search_lines": 0.95, "answer_style": 0.2, "brief_thinking": 0.2}
RISING = [0.5, 0.5, 0.5] + [0.9] * 7
DIPPING = [0.9, 0.9, 0.9, 0.5, 0.3, 0.3, 0.6, 0.9, 0.9, 0.9]  # start 0.9, worst 0.367, s_p 3
SHALLOW = [0.9, 0.9, 0.9, 0.8, 0.7, 0.7, 0.8, 0.9, 0.9, 0.9]  # worst 0.733
FLAT = [0.9, 0.9, 0.9, 0.85, 0.85, 0.85] + [0.9] * 4  # dip -0.05: not a dipping seed


def run(pas=RISING, final=None, jitter=0.0, **kw):
    """One run's measures as claims2.measure writes them; ``jitter`` shifts the pass series
    (seeds that differ a little, so the t-intervals have a width)."""
    x = K.dip_measures({t: min(1.0, max(0.0, v + jitter)) for t, v in enumerate(pas, 1)})
    x = {**x, "pass": sum(pas[-5:]) / 5 + jitter, "final": {**STYLE_OK, **(final or {})},
         "close_fall": -0.1, "close_onset": None, "branch_rise": 0.1,
         "update_norm": {str(t): 1.0 for t in range(1, 11)}, "abs_mean_over_lr_to_dip": 0.8,
         "weight_frac_thinking_to_dip": 0.6, "frac_gated_thinking_to_dip": 0.7, "steps": len(pas)}
    x.update(kw)
    return x


JIT = (0.0, 0.01, -0.01, 0.02, -0.02)


def arm(**kw):
    return [run(jitter=j, **kw) for j in JIT[:SEEDS]]


# ------------------------------------------------------------------------------ experiment S
def stability_ok():
    return {"grpo": arm(final=STYLE_NO), "tg": arm(), "placebo": arm(final=STYLE_NO)}


def test_stability_verdicts():
    v = V.stability(stability_ok(), P.STYLE_CRITERIA)
    assert v["no_degradation"]["verdict"] == "reproduced" and v["from_feedback"]["verdict"] == "reproduced"
    assert v["no_degradation"]["tests"]["grpo_learns"]["estimate"] == pytest.approx(0.4)
    assert v["from_feedback"]["decides"] == ["learned_vs_placebo", "learned_vs_grpo"]
    # GRPO that does not learn: the comparison decides nothing
    m = {**stability_ok(), "grpo": arm(pas=[0.5] * 10, final=STYLE_NO), "tg": arm(pas=[0.5] * 10)}
    assert V.stability(m, P.STYLE_CRITERIA)["no_degradation"]["verdict"].startswith("decides nothing")
    # TG's worst 0.2 below GRPO's on every seed: it degrades (the interval's upper end below -0.1)
    m = {**stability_ok(), "tg": arm(pas=[0.5, 0.5, 0.5, 0.3, 0.3, 0.3] + [0.9] * 5)}
    v = V.stability(m, P.STYLE_CRITERIA)["no_degradation"]
    assert v["tests"]["worst_vs_grpo"]["passed"] is False and v["tests"]["final_pass_vs_grpo"]["passed"] is True
    assert v["verdict"].startswith("NOT reproduced: degrades")  # upper end about -0.2 < -0.1
    # worst(tg) - worst(grpo) -0.12, -0.3, 0.05, -0.2, -0.1: lower end below -0.1, upper above
    grpo = stability_ok()["grpo"]
    tg = [run(jitter=j, worst=g["worst"] + d) for j, g, d in zip(JIT, grpo, (-0.12, -0.3, 0.05, -0.2, -0.1))]
    m = {**stability_ok(), "grpo": grpo, "tg": tg}
    assert V.stability(m, P.STYLE_CRITERIA)["no_degradation"]["verdict"] == "NOT reproduced: not shown to be stable"
    # GRPO learns the style as well: learned_vs_grpo fails, the feedback claim too
    m = {**stability_ok(), "grpo": arm()}
    assert V.stability(m, P.STYLE_CRITERIA)["from_feedback"]["verdict"] == "NOT reproduced"
    # a crashed placebo (its final rates NaN): the feedback claim undecided, the other decided
    m = {**stability_ok(), "placebo": arm(final={"answer_style": math.nan})}
    v = V.stability(m, P.STYLE_CRITERIA)
    assert v["from_feedback"]["verdict"] == "undecided" and v["no_degradation"]["verdict"] == "reproduced"
    with pytest.raises(ValueError, match="arms missing"):
        V.stability({"grpo": arm(), "tg": arm()}, P.STYLE_CRITERIA)


def test_the_power_check():
    dev = {"grpo": arm(pas=RISING)[:3], "tg": arm(pas=RISING)[:3]}
    pw = V.power(dev)
    assert pw["sd"] == pytest.approx(0.0) and pw["separates"] is True
    noisy = {"grpo": [run(worst=w) for w in (0.2, 0.6, 0.4)], "tg": [run(worst=0.4) for _ in range(3)]}
    pw = V.power(noisy)  # differences 0.2, -0.2, 0: sd 0.2, half-width 2.776 * 0.2 / sqrt 5 = 0.248
    assert pw["sd"] == pytest.approx(0.2) and pw["half_width"] == pytest.approx(2.7764451 * 0.2 / math.sqrt(5))
    assert pw["separates"] is False
    v = V.stability(stability_ok(), P.STYLE_CRITERIA, pw)["no_degradation"]["verdict"]
    assert v.startswith("reproduced") and "cannot separate the margin from noise" in v
    assert V.power({"grpo": arm()[:1], "tg": arm()[:1]})["separates"] is None


# ------------------------------------------------------------------------------ experiment D
def dip_ok():
    """The precondition holds and H1, H2 and H3 are confirmed."""
    tg = arm(pas=DIPPING, close_fall=-1.5, close_onset=2, branch_rise=2.0)
    return {"tg": tg, "grpo": arm(), "lambda_10": arm(pas=DIPPING), "lambda_0.1": arm(pas=DIPPING),
            "lr_low": arm(pas=SHALLOW), "action_x4": arm(pas=SHALLOW), "tg_ra": arm(pas=DIPPING),
            "no_thinking_ra": arm(pas=SHALLOW), "thinking_only_ra": arm(pas=DIPPING)}


def verdicts(m):
    return {k: x["verdict"] for k, x in V.dip(m).items()}


def test_dip_hypotheses_confirmed_and_refuted():
    v = V.dip(dip_ok())
    assert {k: x["verdict"] for k, x in v.items()} == {
        "precondition": "holds", "H1": "confirmed", "H2": "confirmed", "H3": "confirmed"}
    assert v["H1"]["tests"]["lr_dip"]["estimate"] == pytest.approx(2.2 / 3 - 1.1 / 3)
    assert v["H1"]["tests"]["lr_dip"]["confidence"] == pytest.approx(1 - 0.05 / 3)
    assert v["precondition"]["tests"]["tg_dips"]["confidence"] == 0.95
    assert v["H2"]["tests"]["close_falls"]["estimate"] == pytest.approx(-1.4)  # tg -1.5 minus grpo -0.1
    assert v["H2"]["tests"]["close_leads"]["estimate"] == 1.0  # s_c 2 < s_p 3 on every dipping seed
    assert V.reading(v) == "the dip is consistent with each of H1, H2, H3; no cause named"
    assert V.fix_overrides({k: x["verdict"] for k, x in v.items()}) == ("optimizer.lr=0.0001",
                                                                         "objective.kl_action_weight=4")
    # the dip follows lambda: lambda 10 dips far less than tg; H1 refuted
    assert verdicts({**dip_ok(), "lambda_10": arm(pas=SHALLOW)})["H1"] == "refuted"
    # lambda 0.1 too far from tg's dip
    assert verdicts({**dip_ok(), "lambda_0.1": arm(pas=SHALLOW)})["H1"] == "refuted"
    # GRPO's closing probability falls as much: H2 refuted
    assert verdicts({**dip_ok(), "grpo": arm(close_fall=-1.5)})["H2"] == "refuted"
    m = dip_ok()
    m["tg"] = arm(pas=DIPPING, close_fall=-1.5, close_onset=3, branch_rise=2.0)  # s_c 3 = s_p 3: not before
    assert verdicts(m)["H2"] == "refuted"
    m["tg"] = arm(pas=DIPPING, close_fall=-1.5, close_onset=2, branch_rise=0.3)  # the branch barely rises
    assert verdicts(m)["H2"] == "refuted"
    # the mechanism seen, but weighting the action rows does not remove the dip
    assert verdicts({**dip_ok(), "action_x4": arm(pas=DIPPING)})["H2"].startswith("seen")
    # thinking_only_ra dips far less than tg_ra: H3 refuted; only H2 confirmed, the others refuted
    m = {**dip_ok(), "thinking_only_ra": arm(pas=SHALLOW), "lr_low": arm(pas=DIPPING)}
    v = V.dip(m)
    assert [v[h]["verdict"] for h in ("H1", "H2", "H3")] == ["refuted", "confirmed", "refuted"]
    assert V.reading(v) == "the dip's cause: H2 (the others refuted)"
    assert V.fix_overrides({k: x["verdict"] for k, x in v.items()}) == ("objective.kl_action_weight=4",)
    assert V.fix_overrides({"H1": "refuted", "H2": "seen ...", "H3": "confirmed"}) == ()
    # one confirmed beside an undecided one: no cause named
    v["H1"] = {**v["H1"], "verdict": "undecided"}
    assert V.reading(v) == "the dip is consistent with each of H2; no cause named (H1 undecided; H3 refuted)"


def test_dip_precondition_and_undecided():
    # tg does not dip: every hypothesis undecided, whatever its tests say
    m = {**dip_ok(), "tg": arm(pas=FLAT, close_fall=-1.5, close_onset=2, branch_rise=2.0)}
    v = V.dip(m)
    assert v["precondition"]["verdict"] == "fails"
    assert all(v[h]["verdict"].startswith("undecided: the seeds show no dip") for h in ("H1", "H2", "H3"))
    # a missing probe in one tg run: close_falls, and so H2, undecided; H1 and H3 decided
    m = dip_ok()
    m["tg"][2] = {**m["tg"][2], "close_fall": math.nan}
    v = V.dip(m)
    assert v["H2"]["tests"]["close_falls"]["status"] == "undecided" and v["H2"]["verdict"] == "undecided"
    assert v["H1"]["verdict"] == "confirmed" and v["H3"]["verdict"] == "confirmed"
    # a failed decisive test refutes even beside an undecided one: GRPO's close falls as much
    # (close_falls fails) and one tg run has no branch probe (branch_rises undecided)
    m = dip_ok()
    m["grpo"] = arm(close_fall=-1.5)
    m["tg"][1] = {**m["tg"][1], "branch_rise": math.nan}
    v = V.dip(m)["H2"]
    assert v["tests"]["close_falls"]["passed"] is False and v["tests"]["branch_rises"]["status"] == "undecided"
    assert v["verdict"] == "refuted"
    # only the dipping seeds count for the onsets: a seed that does not dip is left out
    m = dip_ok()
    m["tg"][4] = run(pas=FLAT, close_fall=-1.5, close_onset=None, branch_rise=2.0)
    v = V.dip(m)["H2"]["tests"]["close_leads"]
    assert v["n"] == 4 and v["estimate"] == 1.0
    # a crashed lr_low run (no pass rate): lr_dip undecided, H1 undecided
    m = dip_ok()
    m["lr_low"][0] = {**m["lr_low"][0], "dip": math.nan}
    assert verdicts(m)["H1"] == "undecided"


def test_the_fix():
    m = {"tg": arm(pas=DIPPING), "tg_fix": arm(pas=SHALLOW)}
    assert V.dip(m) == {"fix": V.fix(m)} and V.fix(m)["verdict"] == "validated"
    assert V.fix({**m, "tg_fix": arm(pas=SHALLOW, final=STYLE_NO)})["verdict"] == "NOT validated"
    assert V.fix({**m, "tg_fix": arm(pas=DIPPING)})["verdict"] == "NOT validated"
    m["tg_fix"][0] = {**m["tg_fix"][0], "pass": math.nan}
    assert V.fix(m)["verdict"] == "undecided"


# ------------------------------------------------------------------------------ experiment P
def test_paper_config_levels_and_the_boundary():
    learns = arm(final={"search_lines": 0.95})
    never = arm(final={"search_lines": 0.0})
    m = {lvl: {"grpo": never, "paper_tg": learns} for lvl in K.P_LEVELS}
    m["1e-4"] = {"grpo": never, "paper_tg": arm(final={"search_lines": 0.1})}
    v = V.paper_config(m)
    assert [v["levels"][k]["verdict"] for k in K.P_LEVELS] == ["NOT reproduced", "reproduced", "reproduced"]
    assert v["boundary"] == "phase boundary at 1e-3"
    assert v["levels"]["1e-3"]["tests"]["tg_vs_grpo_1e-3"]["estimate"] == pytest.approx(0.95)
    # GRPO learns the format too at 1e-2: not reproduced there, the levels out of order
    m["1e-2"] = {"grpo": learns, "paper_tg": learns}
    assert V.paper_config(m)["boundary"].startswith("levels out of order")
    # TG's task pass 0.1 below GRPO's
    m["1e-2"] = {"grpo": never, "paper_tg": arm(pas=[0.5, 0.5, 0.5] + [0.8] * 7, final={"search_lines": 0.95})}
    assert V.paper_config(m)["levels"]["1e-2"]["tests"]["pass_vs_grpo_1e-2"]["passed"] is False
    # a level with a crashed run: undecided, and so is the boundary
    m["1e-2"] = {"grpo": never, "paper_tg": learns[:4] + [run(final={"search_lines": math.nan})]}
    v = V.paper_config(m)
    assert v["levels"]["1e-2"]["verdict"] == "undecided" and v["boundary"].startswith("undecided")
    assert V.boundary({"1e-4": False, "1e-3": False, "1e-2": False}) == "reproduced at no level"
