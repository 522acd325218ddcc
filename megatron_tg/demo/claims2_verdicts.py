"""The tests and verdicts of ``docs/claims-2.md``'s experiments S, D and P.

Each function takes per-seed measures (:func:`.claims2.measure`; arm -> one per seed, the
seeds in the same order in every arm) and returns claim / hypothesis -> {"verdict",
"decides", "tests"}. Intervals are Student-t over seeds (:mod:`.tinterval`): 95 % for S, P,
D's precondition and the fix, 1 - 0.05/3 for the tests that decide H1-H3. A test whose
statistic cannot be computed is undecided; a verdict that needs an undecided test is
undecided, except that a failed test which alone refutes (or fails) a verdict decides it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from megatron_tg.demo import claims2 as K
from megatron_tg.demo.tinterval import Test2, half_width

Measures = Mapping[str, Sequence[Mapping[str, Any]]]
FIXES = {"H1": (f"optimizer.lr={K.D_LR_LOW}",), "H2": (f"objective.kl_action_weight={K.D_ACTION_WEIGHT}",)}
"""The recipe default each hypothesis implies, fixed in advance (H3 implies none)."""
D_ARMS = ("tg", "grpo", "lambda_10", "lambda_0.1", "lr_low", "action_x4", "tg_ra", "no_thinking_ra",
          "thinking_only_ra")
UNDECIDED = "undecided"


def _per(xs: Sequence[Mapping[str, Any]], f: Callable[[Mapping[str, Any]], float]) -> list[float]:
    return [float(f(x)) for x in xs]


def _diff(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [x - y for x, y in zip(a, b)]


def _nseeds(m: Measures, arms: Sequence[str]) -> int:
    missing = [a for a in arms if a not in m]
    if missing:
        raise ValueError(f"arms missing: {missing}")
    n = {len(m[a]) for a in arms}
    if len(n) != 1:
        raise ValueError(f"every arm needs the same seeds; got seed counts {sorted(n)}")
    return n.pop()


def _ev(ts: Sequence[Test2]) -> dict[str, dict[str, Any]]:
    return {t.name: t.evaluate() for t in ts}


def _all(ev: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> bool | None:
    """True when every named test passes, False when one fails, None otherwise (undecided)."""
    got = [ev[k]["passed"] for k in names]
    return False if False in got else None if None in got else True


def _claim(verdict: str, decides: Sequence[str], tests: Mapping[str, Any]) -> dict[str, Any]:
    return {"verdict": verdict, "decides": list(decides), "tests": dict(tests)}


# ------------------------------------------------------------------------------ experiment S
def power(dev: Measures, n: int = len(K.HELDOUT_SEEDS)) -> dict[str, Any]:
    """From development seeds: the standard deviation over seeds of worst(tg) - worst(grpo)
    and the half-width an n-seed 95 % t-interval would have with it; ``separates`` False when
    it exceeds :data:`.claims2.S_POWER_HALF_WIDTH` (None when it cannot be computed)."""
    d = _diff(_per(dev["tg"], lambda x: x["worst"]), _per(dev["grpo"], lambda x: x["worst"]))
    if len(d) < 2 or any(x != x for x in d):
        return {"seeds": len(d), "sd": math.nan, "half_width": math.nan, "separates": None}
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    hw = half_width(sd, n, K.CONFIDENCE)
    return {"seeds": len(d), "sd": sd, "half_width": hw, "separates": hw <= K.S_POWER_HALF_WIDTH}


def stability(m: Measures, style: Sequence[str], pw: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Experiment S (arms grpo, tg, placebo); ``pw``: :func:`power` from the development seeds."""
    _nseeds(m, ("grpo", "tg", "placebo"))
    worst = {a: _per(m[a], lambda x: x["worst"]) for a in ("grpo", "tg", "placebo")}
    fin = {a: _per(m[a], lambda x: x["pass"]) for a in ("grpo", "tg")}
    lrn = {a: _per(m[a], lambda x: learned(x, style)) for a in ("grpo", "tg", "placebo")}
    c = K.CONFIDENCE
    ev = _ev([Test2("grpo_learns", "final pass(grpo) - start", "greater", K.S_GRPO_LEARNS,
                    _diff(fin["grpo"], _per(m["grpo"], lambda x: x["start"])), c),
              Test2("worst_vs_grpo", "worst(tg) - worst(grpo)", "not_worse", K.S_WORST_VS_GRPO,
                    _diff(worst["tg"], worst["grpo"]), c),
              Test2("final_pass_vs_grpo", "final pass(tg) - final pass(grpo)", "not_worse", K.S_FINAL_PASS_VS_GRPO,
                    _diff(fin["tg"], fin["grpo"]), c),
              Test2("worst_vs_placebo", "worst(tg) - worst(placebo)", "not_worse", K.S_WORST_VS_PLACEBO,
                    _diff(worst["tg"], worst["placebo"]), c),
              Test2("learned_vs_placebo", "learned(tg) - learned(placebo)", "greater", K.S_LEARNED_VS_PLACEBO,
                    _diff(lrn["tg"], lrn["placebo"]), c),
              Test2("learned_vs_grpo", "learned(tg) - learned(grpo)", "greater", K.S_LEARNED_VS_GRPO,
                    _diff(lrn["tg"], lrn["grpo"]), c)])
    learns = ev["grpo_learns"]["passed"]
    nd_tests = ("grpo_learns", "worst_vs_grpo", "final_pass_vs_grpo")
    if learns is False:
        nd = "decides nothing (against a GRPO that did not learn)"
    elif learns is None:
        nd = UNDECIDED
    else:
        both = _all(ev, nd_tests[1:])
        worst_hi = ev["worst_vs_grpo"]["interval"][1]
        if both is None:
            nd = UNDECIDED
        elif both:
            nd = "reproduced"
        elif ev["worst_vs_grpo"]["passed"] is False:
            nd = ("NOT reproduced: degrades (worst_vs_grpo's upper end below "
                  f"{-K.S_WORST_VS_GRPO:g})" if worst_hi < -K.S_WORST_VS_GRPO else
                  "NOT reproduced: not shown to be stable")
        else:
            nd = "NOT reproduced"
    if pw is not None and pw.get("separates") is False:
        nd += (f" (power: a {len(K.HELDOUT_SEEDS)}-seed half-width {pw['half_width']:.3f} > "
               f"{K.S_POWER_HALF_WIDTH:g}: worst_vs_grpo cannot separate the margin from noise)")
    ff = _all(ev, ("learned_vs_placebo", "learned_vs_grpo"))
    return {"no_degradation": _claim(nd, nd_tests, {k: ev[k] for k in nd_tests}),
            "from_feedback": _claim(UNDECIDED if ff is None else "reproduced" if ff else "NOT reproduced",
                                    ("learned_vs_placebo", "learned_vs_grpo"),
                                    {k: ev[k] for k in ("learned_vs_placebo", "learned_vs_grpo", "worst_vs_placebo")})}


def learned(x: Mapping[str, Any], style: Sequence[str]) -> float:
    return K.learned(x, style)


# ------------------------------------------------------------------------------ experiment D
def _dipping(tg: Sequence[Mapping[str, Any]]) -> list[int] | None:
    """Indices of the dipping seeds (dip(tg) <= -0.1); None when a seed's dip is unmeasured."""
    flags = [K.dips(x) for x in tg]
    return None if None in flags else [i for i, f in enumerate(flags) if f]


def _only(values: Sequence[float], keep: list[int] | None) -> list[float]:
    """The values of the dipping seeds; [NaN] (undecided) when they cannot be told or there are none."""
    if keep is None or not keep:
        return [math.nan]
    return [values[i] for i in keep]


def dip(m: Measures) -> dict[str, dict[str, Any]]:
    """Experiment D: the precondition ``tg_dips``, H1-H3 and, when ``m`` has a ``tg_fix`` arm
    (the fix call), only the fix's tests (``fix_dip``, ``fix_learned``, ``fix_pass``)."""
    if "tg_fix" in m:
        return {"fix": fix(m)}
    _nseeds(m, D_ARMS)
    dp = {a: _per(xs, lambda x: x["dip"]) for a, xs in m.items()}
    tg, keep, hc = m["tg"], _dipping(m["tg"]), K.HYPOTHESIS_CONFIDENCE
    pre = _ev([Test2("tg_dips", "dip(tg)", "at_most", K.D_TG_DIPS, dp["tg"], K.CONFIDENCE, "hi<0")])

    def to_dip(key: str) -> list[float]:
        return _only(_per(tg, lambda x: x[key]), keep)
    ratio = {a: [K.update_ratio(x, y) for x, y in zip(m[a], tg)] for a in ("lambda_10", "lambda_0.1")}
    h1 = _ev([Test2("lambda_dip", "dip(lambda_10) - dip(tg)", "equivalent", K.D_LAMBDA_DIP,
                    _diff(dp["lambda_10"], dp["tg"]), hc),
              Test2("lambda_low_dip", "dip(lambda_0.1) - dip(tg)", "equivalent", K.D_LAMBDA_DIP,
                    _diff(dp["lambda_0.1"], dp["tg"]), hc),
              Test2("lr_dip", "dip(lr_low) - dip(tg)", "greater", K.D_LR_DIP, _diff(dp["lr_low"], dp["tg"]), hc),
              Test2("update_ratio_lambda_10", f"update ratio lambda_10 / tg, steps 1..{K.RATIO_STEPS}", "reported",
                    0.0, ratio["lambda_10"], hc),
              Test2("update_ratio_lambda_0.1", f"update ratio lambda_0.1 / tg, steps 1..{K.RATIO_STEPS}",
                    "reported", 0.0, ratio["lambda_0.1"], hc),
              Test2("abs_mean_over_lr", "tg's optim/update_abs_mean_over_lr over steps 1..t* (dipping seeds)",
                    "reported", 0.0, to_dip("abs_mean_over_lr_to_dip"), hc)])
    close = _diff(_per(tg, lambda x: x["close_fall"]), _per(m["grpo"], lambda x: x["close_fall"]))
    h2 = _ev([Test2("close_falls", "close fall(tg) - close fall(grpo), nats", "at_most", K.D_CLOSE_FALLS,
                    close, hc, "hi<0"),
              Test2("branch_rises", "branch rise(tg), nats", "at_least", K.D_BRANCH_RISES,
                    _per(tg, lambda x: x["branch_rise"]), hc, "lo>0"),
              Test2("close_leads", "fraction of dipping seeds with close onset < pass onset", "at_least",
                    K.D_CLOSE_LEADS, _only(_per(tg, K.leads), keep), hc),
              Test2("action_x4_dip", "dip(action_x4) - dip(tg)", "greater", K.D_ACTION_X4_DIP,
                    _diff(dp["action_x4"], dp["tg"]), hc),
              Test2("weight_frac_thinking", "tg's kl/weight_frac_thinking over steps 1..t* (dipping seeds)",
                    "reported", 0.0, to_dip("weight_frac_thinking_to_dip"), hc),
              Test2("frac_gated_thinking", "tg's kl/frac_gated_thinking over steps 1..t* (dipping seeds)",
                    "reported", 0.0, to_dip("frac_gated_thinking_to_dip"), hc)])
    h3 = _ev([Test2("no_thinking_dip", "dip(no_thinking_ra) - dip(tg_ra)", "greater", K.D_NO_THINKING_DIP,
                    _diff(dp["no_thinking_ra"], dp["tg_ra"]), hc),
              Test2("thinking_only_dips", "dip(thinking_only_ra) - dip(tg_ra)", "not_better",
                    K.D_THINKING_ONLY_DIPS, _diff(dp["thinking_only_ra"], dp["tg_ra"]), hc)])

    def confirmed_or_refuted(ev, names):
        ok = _all(ev, names)
        return UNDECIDED if ok is None else "confirmed" if ok else "refuted"
    d1 = ("lambda_dip", "lambda_low_dip", "lr_dip")
    d2 = ("close_falls", "branch_rises", "close_leads", "action_x4_dip")
    d3 = ("no_thinking_dip", "thinking_only_dips")
    mech = _all(h2, d2[:3])
    if mech is not True:
        v2 = UNDECIDED if mech is None else "refuted"
    else:
        x4 = h2["action_x4_dip"]["passed"]
        v2 = UNDECIDED if x4 is None else "confirmed" if x4 else (
            "seen (the closing token's probability falls before the task) but not removed by "
            "weighting the action rows")
    verdicts = {"H1": confirmed_or_refuted(h1, d1), "H2": v2, "H3": confirmed_or_refuted(h3, d3)}
    held = pre["tg_dips"]["passed"]
    if held is not True:
        why = ("undecided: the seeds show no dip (tg_dips fails)" if held is False else
               "undecided: tg_dips undecided")
        verdicts = {k: why for k in verdicts}
    return {"precondition": _claim("holds" if held else "fails" if held is False else UNDECIDED,
                                   ["tg_dips"], pre),
            "H1": _claim(verdicts["H1"], d1, h1), "H2": _claim(verdicts["H2"], d2, h2),
            "H3": _claim(verdicts["H3"], d3, h3)}


def reading(v: Mapping[str, Mapping[str, Any]]) -> str:
    """"Reading several": a cause is named only where the other hypotheses were refuted."""
    hs = ("H1", "H2", "H3")
    conf = [h for h in hs if v[h]["verdict"] == "confirmed"]
    if not conf:
        return "no hypothesis confirmed"
    if len(conf) == 1 and all(v[h]["verdict"] == "refuted" for h in hs if h != conf[0]):
        return f"the dip's cause: {conf[0]} (the others refuted)"
    rest = [f"{h} {v[h]['verdict']}" for h in hs if h not in conf]
    return ("the dip is consistent with each of " + ", ".join(conf) + "; no cause named"
            + (f" ({'; '.join(rest)})" if rest else ""))


def fix_overrides(verdicts: Mapping[str, str]) -> tuple[str, ...]:
    """The fixed-in-advance fix the held-out verdicts imply: H1 -> lr 1e-4, H2 -> action
    weight 4, both when both are confirmed; () when neither is (H3 alone runs no fix)."""
    return tuple(o for h in ("H1", "H2") if verdicts.get(h) == "confirmed" for o in FIXES[h])


def fix(m: Measures) -> dict[str, Any]:
    """The fix's validation on the fix seeds (arms tg and tg_fix): validated when all three pass."""
    from megatron_tg.demo.paper_env import STYLE_CRITERIA

    _nseeds(m, ("tg", "tg_fix"))
    dp = {a: _per(m[a], lambda x: x["dip"]) for a in ("tg", "tg_fix")}
    pas = {a: _per(m[a], lambda x: x["pass"]) for a in ("tg", "tg_fix")}
    lrn = {a: _per(m[a], lambda x: learned(x, STYLE_CRITERIA)) for a in ("tg", "tg_fix")}
    c = K.CONFIDENCE
    ev = _ev([Test2("fix_dip", "dip(tg_fix) - dip(tg)", "greater", K.D_FIX_DIP, _diff(dp["tg_fix"], dp["tg"]), c),
              Test2("fix_learned", "learned(tg_fix) - learned(tg)", "not_worse", K.D_FIX_LEARNED,
                    _diff(lrn["tg_fix"], lrn["tg"]), c),
              Test2("fix_pass", "final pass(tg_fix) - final pass(tg)", "not_worse", K.D_FIX_PASS,
                    _diff(pas["tg_fix"], pas["tg"]), c)])
    ok = _all(ev, list(ev))
    return _claim(UNDECIDED if ok is None else "validated" if ok else "NOT validated", list(ev), ev)


# ------------------------------------------------------------------------------ experiment P
def paper_config(m: Mapping[str, Measures]) -> dict[str, Any]:
    """Experiment P (level -> arm -> per-seed measures): per level its verdict and tests, and
    the phase boundary."""
    levels: dict[str, dict[str, Any]] = {}
    c = K.CONFIDENCE
    for lvl, arms in m.items():
        _nseeds(arms, ("grpo", "paper_tg"))
        tg, g = arms["paper_tg"], arms["grpo"]
        sl = {a: _per(x, lambda r: r["final"]["search_lines"]) for a, x in (("tg", tg), ("grpo", g))}
        ev = _ev([Test2(f"tg_learns_{lvl}", "final search_lines(paper_tg)", "at_least", K.P_TG_LEARNS, sl["tg"], c),
                  Test2(f"tg_vs_grpo_{lvl}", "final search_lines(paper_tg) - (grpo)", "greater", K.P_TG_VS_GRPO,
                        _diff(sl["tg"], sl["grpo"]), c),
                  Test2(f"pass_vs_grpo_{lvl}", "final pass(paper_tg) - (grpo)", "not_worse", K.P_PASS_VS_GRPO,
                        _diff(_per(tg, lambda r: r["pass"]), _per(g, lambda r: r["pass"])), c)])
        ok = _all(ev, list(ev))
        levels[lvl] = _claim(UNDECIDED if ok is None else "reproduced" if ok else "NOT reproduced", list(ev), ev)
    flags = {k: (None if v["verdict"] == UNDECIDED else v["verdict"] == "reproduced") for k, v in levels.items()}
    return {"levels": levels, "boundary": boundary(flags)}


def boundary(reproduced: Mapping[str, bool | None]) -> str:
    """The lowest level reproduced with every higher level reproduced too; when the levels
    disagree with that order, each level's verdict; undecided while a level is."""
    order = sorted(reproduced, key=float)
    name = {True: "reproduced", False: "NOT reproduced", None: UNDECIDED}
    if any(reproduced[k] is None for k in order):
        return "undecided: " + ", ".join(f"{k} {name[reproduced[k]]}" for k in order)
    flags = [reproduced[k] for k in order]
    if any(a and not b for a, b in zip(flags, flags[1:])):
        return "levels out of order: " + ", ".join(f"{k} {name[reproduced[k]]}" for k in order)
    lowest = next((k for k, f in zip(order, flags) if f), None)
    return f"phase boundary at {lowest}" if lowest else "reproduced at no level"
