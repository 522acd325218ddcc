"""Part 2's pre-registered rules (docs/claims-2.md; megatron_tg/demo/claims2.py and tinterval.py):
the document's numbers and arms are the code's, the t quantile against tabulated values, each
measure on hand-made metrics rows, each test kind passing, failing and undecided where it
should."""

from __future__ import annotations

import math
import re

import pytest

from megatron_tg.demo import claims2 as K
from megatron_tg.demo import dip_suite as DS
from megatron_tg.demo import paper_config_suite as PS
from megatron_tg.demo import paper_env as P
from megatron_tg.demo import stability_suite as SS
from megatron_tg.demo import tinterval as TI

DOC = (K.ROOT / K.CLAIMS2_DOC).read_text()


def test_the_numbers_of_docs_claims_2_md_are_the_code_s():
    block = DOC[DOC.index("## The numbers"):DOC.index("## Cost")]
    rows = dict(re.findall(r"^\| ([A-Z0-9_]+) \| ([^|]+) \|$", block, flags=re.M))
    assert len(rows) == 37
    for name, value in rows.items():
        code = getattr(K, name)
        if isinstance(code, tuple):
            want = tuple(type(code[0])(x.strip()) for x in value.split(","))
        else:
            want = type(code)(value.strip())
        assert code == want, (name, code, value)
    assert all(float(lvl) > 0 for lvl in K.P_LEVELS) and set(PS.LEVELS) == set(K.P_LEVELS)
    assert K.HYPOTHESIS_CONFIDENCE == pytest.approx(1 - 0.05 / 3)


def _section(title: str) -> str:
    i = DOC.index(title)
    return DOC[i:DOC.index("\n## ", i + 1)]


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


@pytest.mark.parametrize("title, runs", [("## Experiment S", SS.RUNS), ("## Experiment D", DS.RUNS),
                                         ("## Experiment P", PS.RUNS)])
def test_the_arms_of_the_document_are_the_suites(title, runs):
    """Every arm is named in its experiment's section, and every override it makes is written
    there (`key=value`, the key's last part, the value equal as a number)."""
    text = _section(title)
    pairs = re.findall(r"`(?:[a-z_]+\.)?([a-z_]+)=([^`\s]+)`", text)
    for arm, mode, extra in runs:
        assert f"`{arm}`" in text, arm
        # a tg arm is "tg with ..." in the text; an arm named as its mode needs no mode=
        for ov in extra + ((f"mode={mode}",) if mode not in ("tg", arm) else ()):
            key, val = ov.split("=", 1)
            assert any(k == key.split(".")[-1] and _same(v, val) for k, v in pairs), (arm, ov)
    if title == "## Experiment P":
        assert "`paper_tg`: `mode=tg`" in text
    if title == "## Experiment D":  # the table's arms, in its order
        table = re.findall(r"^\| `([a-z_0-9.]+)` \|", text, flags=re.M)
        assert table == [arm for arm, _, _ in runs]


@pytest.mark.parametrize("runs, recipe", [(SS.RUNS, SS.RECIPE), (DS.RUNS, DS.RECIPE), (PS.RUNS, PS.RECIPE)])
def test_every_arm_is_a_valid_config(runs, recipe):
    """Each arm's overrides load on its recipe (no_thinking and thinking-only under
    rollout_assistant too), with the settings the document names."""
    from megatron_tg.config import load_config

    for arm, mode, extra in runs:
        cfg = load_config(str(recipe), [f"objective.mode={mode}", *extra, "logging.update_stats=true"])
        assert cfg.objective.mode == mode, arm
        if arm.endswith("_ra"):
            assert cfg.objective.kl_token_normalization == "rollout_assistant"
    d = {arm: load_config(str(DS.RECIPE), [f"objective.mode={mode}", *extra]) for arm, mode, extra in DS.RUNS}
    assert d["action_x4"].objective.kl_action_weight == 4.0 and d["tg"].objective.kl_action_weight == 1.0
    assert d["lambda_0.1"].objective.kl_coef == 0.1 and d["lambda_10"].objective.kl_coef == 10.0
    assert d["lr_low"].optimizer.lr == 1e-4 and d["tg"].optimizer.lr == 3e-4
    assert d["thinking_only_ra"].objective.distill_actions is False


# ------------------------------------------------------------------------------ the t interval
@pytest.mark.parametrize("p, df, want", [
    (0.975, 1, 12.7062047), (0.975, 2, 4.3026527), (0.975, 4, 2.7764451), (0.975, 10, 2.2281389),
    (0.975, 20, 2.0859634), (0.995, 4, 4.6040949), (0.995, 1, 63.6567412), (0.95, 3, 2.3533634),
    (0.9, 4, 1.5332063)])
def test_the_t_quantile_against_tabulated_values(p, df, want):
    assert TI.t_quantile(p, df) == pytest.approx(want, abs=2e-6)
    assert TI.t_quantile(1 - p, df) == pytest.approx(-want, abs=2e-6)


def test_the_t_interval():
    # 1 - 0.05/3 two-sided at df 4 (the Bonferroni t of 3 tests on 5 seeds): 3.9608
    assert TI.t_quantile(1 - 0.05 / 6, 4) == pytest.approx(3.9608, abs=1e-4)
    assert TI.t_cdf(2.7764451, 4) == pytest.approx(0.975, abs=1e-7)
    mean, lo, hi = TI.t_interval([1.0, 2.0, 3.0, 4.0, 5.0], 0.95)
    assert mean == 3.0 and hi - mean == pytest.approx(2.7764451 * math.sqrt(2.5) / math.sqrt(5))
    assert mean - lo == pytest.approx(hi - mean)
    assert math.isnan(TI.t_interval([1.0], 0.95)[1]) and TI.t_interval([1.0], 0.95)[0] == 1.0
    assert all(math.isnan(x) for x in TI.t_interval([1.0, math.nan], 0.95))


# ------------------------------------------------------------------------------ test kinds
def _kind(kind, margin, values, cond=None, confidence=0.95):
    return TI.Test2("t", "t", kind, margin, values, confidence, cond).evaluate()


@pytest.mark.parametrize("kind, margin, cond, good, bad", [
    ("greater", 0.1, None, [0.2, 0.3, 0.15, 0.25, 0.2], [0.5, -0.3, 0.0, 0.1, 0.2]),
    ("greater", 0.1, None, [0.2, 0.3, 0.15, 0.25, 0.2], [0.05, 0.06, 0.07, 0.05, 0.06]),  # lo > 0, mean < m
    ("not_worse", 0.05, None, [0.0, -0.02, 0.01, 0.0, -0.03], [-0.06, -0.07, -0.1, -0.06, -0.08]),
    ("not_better", 0.1, None, [0.05, -0.02, 0.0, 0.04, -0.03], [0.05, 0.3, 0.0, 0.08, 0.2]),
    ("equivalent", 0.1, None, [0.02, -0.02, 0.01, 0.0, 0.03], [0.3, -0.2, 0.1, -0.1, 0.0]),  # mean 0.02, wide
    ("equivalent", 0.1, None, [0.02, -0.02, 0.01, 0.0, 0.03], [0.15, 0.12, 0.11, 0.2, 0.1]),
    ("at_least", 0.8, None, [0.8, 1.0, 0.8, 0.8, 0.6], [1.0, 1.0, 0.6, 0.6, 0.6]),
    ("at_least", 1.0, "lo>0", [1.2, 1.5, 1.1, 1.3, 1.4], [5.0, -1.0, 0.0, 2.0, -0.5]),  # 1.1, lo < 0
    ("at_most", -0.5, "hi<0", [-0.8, -0.9, -0.6, -1.2, -0.7], [-0.8, -0.9, 0.1, -0.2, -0.4]),
    ("at_most", -0.5, "hi<0", [-0.8, -0.9, -0.6, -1.2, -0.7], [-2.5, 0.1, 0.2, 0.3, -0.7]),  # -0.52, hi > 0
    ("at_most", -0.15, None, [-0.2, -0.3, -0.1, -0.2, -0.2], [-0.1, -0.1, -0.2, 0.0, -0.1]),
])
def test_each_kind_passes_and_fails_where_it_should(kind, margin, cond, good, bad):
    assert _kind(kind, margin, good, cond)["passed"] is True
    r = _kind(kind, margin, bad, cond)
    assert r["passed"] is False and r["status"] == "FAILS"
    # an uncomputable statistic (a crashed run, a missing probe): undecided, not failed
    r = _kind(kind, margin, [math.nan] + good[1:], cond)
    assert r["passed"] is None and r["status"] == "undecided"


def test_the_wider_hypothesis_interval_decides_differently():
    xs = [0.2, 0.25, -0.05, 0.3, 0.2]  # lower end 0.012 at 95 %, -0.059 at 98.3 %
    assert _kind("greater", 0.1, xs)["passed"] is True
    assert _kind("greater", 0.1, xs, confidence=K.HYPOTHESIS_CONFIDENCE)["passed"] is False


def test_one_seed_and_reported():
    # one seed: no interval, so a kind that needs one is undecided; a bare level is decided
    assert _kind("greater", 0.1, [0.5])["passed"] is None
    assert _kind("at_least", 0.8, [0.9])["passed"] is True and _kind("at_least", 0.8, [0.5])["passed"] is False
    assert _kind("at_most", -0.5, [-0.9], "hi<0")["passed"] is None
    r = _kind("reported", 0.0, [1.0, 2.0, 3.0])
    assert r["passed"] is None and r["status"] == "reported" and r["estimate"] == 2.0
    assert r["interval"][0] < 2.0 < r["interval"][1]
    with pytest.raises(ValueError, match="unknown kind"):
        TI.Test2("t", "t", "within", 0.1, [0.0])
    with pytest.raises(ValueError, match="at_least / at_most"):
        TI.Test2("t", "t", "greater", 0.1, [0.0], cond="lo>0")


# ------------------------------------------------------------------------------ measures
def rows(pas, close=None, branch=None, norm=None, absmean=None, think=None):
    """metrics.jsonl rows: step 0 (the probes' version 0) and steps 1..len(pas)."""
    out = [{"step": 0, **({K.CLOSE: close[0]} if close else {}), **({K.BRANCH: branch[0]} if branch else {})}]
    for t, v in enumerate(pas, 1):
        r = {"step": t, K.PASS: v, "criteria/search_lines": 1.0, "criteria/answer_style": 0.95,
             "criteria/brief_thinking": 0.5}
        for key, series in ((K.CLOSE, close), (K.BRANCH, branch)):
            if series and t < len(series):
                r[key] = series[t]
        for key, series in ((K.UPDATE_NORM, norm), (K.ABS_MEAN, absmean), (K.WEIGHT_THINK, think),
                            (K.GATED_THINK, think)):
            if series:
                r[key] = series[t - 1]
        out.append(r)
    return out


def test_measures_on_hand_made_rows():
    pas = [0.9, 0.85, 0.75, 0.4, 0.1, 0.4, 0.7, 0.9, 0.9]
    m = K.measure(rows(pas, close=[-0.01, -0.02, -0.6, -1.5, -0.5, -0.1, -0.1, -0.1, -0.1, -0.1],
                       branch=[-8.0, -7.0, -5.0, -3.0, -2.5, -2.6, -3.0, -3.0, -3.0, -3.0],
                       norm=[2.0] * 9, absmean=[1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5, 0.5],
                       think=[0.5] * 9), ("answer", *P.STYLE_CRITERIA))
    assert m["start"] == 0.9  # pass_1 alone
    # rolling3: t=3 0.833, t=4 0.667, t=5 0.417, t=6 0.3, t=7 0.4, ...
    assert m["worst"] == pytest.approx(0.3) and m["dip"] == pytest.approx(-0.6) and m["dip_step"] == 6
    # pass_3 = 0.75 is the first <= 0.9 - 0.1 (0.85 is not): t_p 3, version 2
    assert m["pass_onset"] == 2
    # close: version 2 (-0.6) is the first 0.5 nats below version 0 (-0.01); its minimum at version 3
    assert m["close_onset"] == 2 and m["close_fall"] == pytest.approx(-1.49)
    assert m["branch_rise"] == pytest.approx(5.5)
    assert m["pass"] == pytest.approx((0.1 + 0.4 + 0.7 + 0.9 + 0.9) / 5)
    assert m["abs_mean_over_lr_to_dip"] == pytest.approx((1.0 + 0.9 + 0.8 + 0.7 + 0.6 + 0.5) / 6)
    assert m["weight_frac_thinking_to_dip"] == 0.5 and m["frac_gated_thinking_to_dip"] == 0.5
    assert m["final"]["search_lines"] == 1.0 and K.learned(m, P.STYLE_CRITERIA) == 2.0
    assert K.dips(m) is True and K.leads(m) == 0.0  # s_c 2 is not strictly before s_p 2
    # a run that only rises: its "dip" is above 0 (the minimum, at t* = 3, is above the start); no onset
    up = K.dip_measures({t: v for t, v in enumerate([0.5, 0.6, 0.7, 0.8], 1)})
    assert up["dip"] == pytest.approx(0.1) and up["dip_step"] == 3 and up["pass_onset"] is None
    # the same minimum twice: t* is the first
    assert K.dip_measures({t: v for t, v in enumerate([1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0], 1)})["dip_step"] == 6
    # too few steps, no probe at version 0: NaN, no step; no close onset without version 0
    short = K.measure(rows([0.9, 0.8]), ("answer",))
    assert short["dip"] != short["dip"] and short["dip_step"] is None and K.dips(short) is None
    assert math.isnan(short["close_fall"]) and short["close_onset"] is None and math.isnan(K.leads(short))
    # versions after 25 do not count
    assert K.probe_change({0: 0.0, 1: -0.1, 26: -9.0})["min"] == pytest.approx(-0.1)
    assert K.close_onset({0: 0.0, 1: -0.1, 26: -9.0}) is None


def test_leads_and_update_ratio():
    x = {"close_fall": -1.0, "dip": -0.3, "close_onset": 3, "pass_onset": 5}
    assert K.leads(x) == 1.0
    assert K.leads({**x, "close_onset": 5}) == 0.0  # strictly before
    assert K.leads({**x, "close_onset": None}) == 0.0  # no close onset: does not lead
    assert math.isnan(K.leads({**x, "close_fall": math.nan}))  # the probe missing: unmeasured
    a = {"update_norm": {str(t): 3.0 for t in range(1, 13)}}
    b = {"update_norm": {**{str(t): 1.5 for t in range(1, 11)}, "11": 100.0, "12": 100.0}}
    assert K.update_ratio(a, b) == pytest.approx(2.0)  # steps 11, 12 are not in the mean
    assert math.isnan(K.update_ratio(a, {"update_norm": {}}))


def test_seed_sets():
    assert K.seed_set(K.HELDOUT_SEEDS, 25).startswith("held-out")
    assert "development seeds" in K.seed_set((0,), 3)
    assert "part 1's held-out" in K.seed_set((3, 4, 5, 6, 7), 25)
    assert K.seed_set(K.FIX_SEEDS, 25, reported=K.FIX_SEEDS).startswith("fix seeds")
    assert "3 steps" in K.seed_set(K.HELDOUT_SEEDS, 3)
