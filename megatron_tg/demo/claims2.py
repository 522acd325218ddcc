"""Part 2 of the paper's claims (``docs/claims-2.md``): its numbers, measures, tests and verdicts.

Experiments S (stability against a GRPO that learns), D (the dip: hypotheses H1-H3 and a fix)
and P (the paper's configuration per no-hint level). The bootstrap and the test kinds are
part 1's (:mod:`.claims`), unchanged; the kinds this part adds live in :class:`Test2` so that
part 1's rule file, whose hash its held-out record keeps, is not touched:

* ``not_better`` (margin m): passes when the interval's upper end is at most m;
* ``within`` (margin m): the point estimate lies in [-m, m] (H1's "at most m and at least -m");
* ``falls`` (level m): the point estimate is at most m and the interval's upper end is below 0
  (H2's ``close_falls``);
* ``reported``: estimated and printed, decides nothing.

Measures of one run come from its ``metrics.jsonl`` rows (:func:`measure`); a measure the
rows cannot give (too few steps, an instrument off) is NaN, which fails every test using it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from megatron_tg.demo import claims as C

ROOT = C.ROOT
CLAIMS2_DOC = "docs/claims-2.md"
RULE_FILES = (CLAIMS2_DOC, "megatron_tg/demo/claims2.py", "megatron_tg/demo/claims.py",
              "megatron_tg/demo/suite2.py", "megatron_tg/demo/stability_suite.py",
              "megatron_tg/demo/dip_suite.py", "megatron_tg/demo/paper_config_suite.py",
              "recipes/demo_paper_cpu.yaml", "recipes/demo_cpu.yaml")
"""The pre-registration, the rule code (with part 1's bootstrap), the suites' arms and recipes."""

# ------------------------------------------------------------------------------ the numbers
DEV_SEEDS = (0, 1, 2)
HELDOUT_SEEDS = (8, 9, 10, 11, 12)
FIX_SEEDS = (13, 14, 15, 16, 17)
STEPS = 25
S_WRONG_ANSWER_FRACTION = 0.5
S_BASE_SUCCESS_RANGE = (0.3, 0.7)
S_GRPO_LEARNS, S_WORST_VS_GRPO, S_FINAL_PASS_VS_GRPO = 0.1, 0.1, 0.05
S_WORST_VS_PLACEBO, S_LEARNED_VS_PLACEBO = 0.1, 1.0
D_LR_LOW = 1.0e-4
D_UPDATE_RATIO_LOG, D_LR_DIP = 0.1, 0.1
D_CLOSE_FALLS, D_CLOSE_LEADS, D_GLOBAL_DIP = -0.5, 0.8, 0.1
D_NO_THINKING_DIP, D_THINKING_ONLY_DIPS = 0.1, 0.1
D_FIX_DIP, D_FIX_LEARNED, D_FIX_PASS = 0.1, 0.5, 0.05
P_LEVELS = ("1e-4", "1e-3", "1e-2")
P_LEVEL_FACTOR = 3
P_TG_LEARNS, P_TG_VS_GRPO, P_PASS_VS_GRPO = 0.8, 0.3, 0.05

LAST, ROLLING, START_STEPS, CLOSE_STEPS, RATIO_STEPS = C.LAST, 3, 3, 25, 10
"""Part 1's final-rate window; rolling3's window; start = pass_1..3; close fall over steps
1..25; update ratio over steps 1..10."""
PASS, CLOSE, UPDATE_NORM = "criteria/answer", "probe/p_close_logmean", "optim/update_norm"
ABS_MEAN, THINK_FRAC = "optim/update_abs_mean_over_lr", "kl/weight_frac_thinking"


# ------------------------------------------------------------------------------ test kinds
@dataclass(frozen=True)
class Test2(C.Test):
    def rule(self) -> str:
        extra = {"not_better": f"interval high <= {self.margin:g}",
                 "within": f"{-self.margin:g} <= estimate <= {self.margin:g}",
                 "falls": f"<= {self.margin:g} and interval high < 0", "reported": "reported, decides nothing"}
        return extra[self.kind] if self.kind in extra else super().rule()

    def evaluate(self, n: int, **bootstrap: Any) -> dict[str, Any]:
        if self.kind not in ("not_better", "within", "falls", "reported"):
            return super().evaluate(n, **bootstrap)
        point = self.stat(list(range(n))) if n else math.nan
        lo, hi = C.bootstrap_interval(self.stat, n, **bootstrap)
        if self.kind == "reported":
            ok = None
        elif point != point or lo != lo:
            ok = False
        elif self.kind == "not_better":
            ok = hi <= self.margin
        elif self.kind == "within":
            ok = -self.margin <= point <= self.margin
        else:
            ok = point <= self.margin and hi < 0
        return {"what": self.what, "rule": self.rule(), "estimate": point, "interval": [lo, hi],
                "passed": ok if ok is None else bool(ok)}


# ------------------------------------------------------------------------------ measures
def by_step(rows: Sequence[Mapping[str, Any]], key: str) -> dict[int, float]:
    """step -> the key's value (the last row of a step that has it; NaN values skipped)."""
    out = {}
    for r in rows:
        v = r.get(key)
        if "step" in r and isinstance(v, (int, float)) and v == v:
            out[int(r["step"])] = float(v)
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def rolling3(pas: Mapping[int, float]) -> dict[int, float]:
    """t -> mean of pass over t-2..t, for t >= 3 where the three steps are logged."""
    return {t: _mean([pas[t - 2], pas[t - 1], pas[t]]) for t in sorted(pas)
            if t >= ROLLING and all(s in pas for s in (t - 2, t - 1))}


def dip_measures(pas: Mapping[int, float]) -> dict[str, Any]:
    """start, dip, dip step t* (first t of the minimum) and worst from pass_t (t >= 1)."""
    roll = rolling3(pas)
    if not all(t in pas for t in range(1, START_STEPS + 1)) or not roll:
        return {"start": math.nan, "dip": math.nan, "dip_step": None, "worst": math.nan}
    start = _mean([pas[t] for t in range(1, START_STEPS + 1)])
    worst = min(roll.values())
    return {"start": start, "dip": worst - start, "dip_step": min(t for t, v in roll.items() if v == worst),
            "worst": worst}


def close_fall(close: Mapping[int, float], steps: int = CLOSE_STEPS) -> tuple[float, int | None]:
    """(min over steps 1..steps of the close log-mean minus its step-0 value, that step)."""
    after = {t: v for t, v in close.items() if 1 <= t <= steps}
    if 0 not in close or not after:
        return math.nan, None
    low = min(after.values())
    return low - close[0], min(t for t, v in after.items() if v == low)


def final(series: Mapping[int, float], last: int = LAST) -> float:
    xs = [series[t] for t in sorted(series) if t >= 1][-last:]
    return _mean(xs)


def measure(rows: Sequence[Mapping[str, Any]], criteria: Sequence[str]) -> dict[str, Any]:
    """One run's measures; ``criteria``: the judge's criteria whose final rates are kept
    (``criteria/<name>``)."""
    pas = {t: v for t, v in by_step(rows, PASS).items() if t >= 1}
    d = dip_measures(pas)
    fall, fall_step = close_fall(by_step(rows, CLOSE))
    upto = d["dip_step"]

    def mean_to_dip(key: str) -> float:
        s = by_step(rows, key)
        return _mean([v for t, v in s.items() if upto is not None and 1 <= t <= upto])
    return {**d, "pass": final(pas), "final": {c: final(by_step(rows, f"criteria/{c}")) for c in criteria},
            "close_fall": fall, "close_fall_step": fall_step,
            "update_norm": {str(t): v for t, v in by_step(rows, UPDATE_NORM).items()},
            "abs_mean_over_lr_to_dip": mean_to_dip(ABS_MEAN), "weight_frac_thinking_to_dip": mean_to_dip(THINK_FRAC),
            "steps": len(pas)}


def update_ratio(a: Mapping[str, Any], b: Mapping[str, Any], steps: int = RATIO_STEPS) -> float:
    """Mean over steps 1..steps (those both logged) of a's update norm over b's."""
    ua, ub = a["update_norm"], b["update_norm"]
    ks = [str(t) for t in range(1, steps + 1) if str(t) in ua and str(t) in ub]
    if not ks or any(ub[k] <= 0 for k in ks):
        return math.nan
    return _mean([ua[k] / ub[k] for k in ks])


def learned(x: Mapping[str, Any], style: Sequence[str]) -> float:
    """Style criteria learned (part 1's: final rate >= :data:`.claims.LEARNED`)."""
    return float(C.learned({c: x["final"][c] for c in style}))


def _log(v: float) -> float:
    return math.log(v) if v == v and v > 0 else math.nan


def leads(x: Mapping[str, Any]) -> float:
    """1 when the close fall's step is at or before the dip step, 0 after; NaN unmeasured."""
    if x["close_fall_step"] is None or x["dip_step"] is None:
        return math.nan
    return float(x["close_fall_step"] <= x["dip_step"])


# ------------------------------------------------------------------------------ the tests
def _per(xs: Sequence[Mapping[str, Any]], f: Callable[[Mapping[str, Any]], float]) -> list[float]:
    return [float(f(x)) for x in xs]


def _diff(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [x - y for x, y in zip(a, b)]


def _nseeds(m: Mapping[str, Sequence[Any]]) -> int:
    n = {len(v) for v in m.values()}
    if len(n) != 1:
        raise ValueError(f"every arm needs the same seeds; got seed counts {sorted(n)}")
    return n.pop()


def _evaluate(ts: Sequence[Test2], n: int, **bootstrap: Any) -> dict[str, dict[str, Any]]:
    return {t.name: t.evaluate(n, **bootstrap) for t in ts}


def stability(m: Mapping[str, Sequence[Mapping[str, Any]]], style: Sequence[str],
              **bootstrap: Any) -> dict[str, dict[str, Any]]:
    """Experiment S: claim -> {"verdict", "decides", "tests"} (``m``: arm -> per-seed measures)."""
    g = m["grpo"]
    worst = {a: _per(m[a], lambda x: x["worst"]) for a in ("grpo", "tg", "placebo")}
    fin = {a: _per(m[a], lambda x: x["pass"]) for a in ("grpo", "tg")}
    lrn = {a: _per(m[a], lambda x: learned(x, style)) for a in ("tg", "placebo")}
    ts = [Test2("grpo_learns", "final pass - start, grpo", "greater", S_GRPO_LEARNS,
                C.paired(_diff(fin["grpo"], _per(g, lambda x: x["start"])))),
          Test2("worst_vs_grpo", "worst rolling3 pass, tg - grpo", "not_worse", S_WORST_VS_GRPO,
                C.paired(_diff(worst["tg"], worst["grpo"]))),
          Test2("final_pass_vs_grpo", "final pass, tg - grpo", "not_worse", S_FINAL_PASS_VS_GRPO,
                C.paired(_diff(fin["tg"], fin["grpo"]))),
          Test2("worst_vs_placebo", "worst rolling3 pass, tg - placebo", "not_worse", S_WORST_VS_PLACEBO,
                C.paired(_diff(worst["tg"], worst["placebo"]))),
          Test2("learned_vs_placebo", "style criteria learned, tg - placebo", "greater", S_LEARNED_VS_PLACEBO,
                C.paired(_diff(lrn["tg"], lrn["placebo"])))]
    ev = _evaluate(ts, _nseeds(m), **bootstrap)
    ok = {k: v["passed"] for k, v in ev.items()}
    if not ok["grpo_learns"]:
        nd = "decides nothing (against a GRPO that did not learn)"
    else:
        nd = "reproduced" if ok["worst_vs_grpo"] and ok["final_pass_vs_grpo"] else "NOT reproduced"
    return {"no_degradation": {"verdict": nd, "decides": ["grpo_learns", "worst_vs_grpo", "final_pass_vs_grpo"],
                               "tests": {k: ev[k] for k in ("grpo_learns", "worst_vs_grpo", "final_pass_vs_grpo")}},
            "from_feedback": {"verdict": "reproduced" if ok["learned_vs_placebo"] else "NOT reproduced",
                              "decides": ["learned_vs_placebo"],
                              "tests": {k: ev[k] for k in ("learned_vs_placebo", "worst_vs_placebo")}}}


def dip(m: Mapping[str, Sequence[Mapping[str, Any]]], style: Sequence[str],
        **bootstrap: Any) -> dict[str, dict[str, Any]]:
    """Experiment D: hypothesis (and ``fix`` when ``m`` has a ``tg_fix`` arm) -> verdict and tests."""
    n = _nseeds(m)
    tg = m["tg"]
    dp = {a: _per(xs, lambda x: x["dip"]) for a, xs in m.items()}
    h1 = _evaluate([
        Test2("update_ratio_lambda", f"log of the mean update-norm ratio over steps 1..{RATIO_STEPS}, "
              "lambda_10 / tg", "within", D_UPDATE_RATIO_LOG,
              C.paired([_log(update_ratio(a, b)) for a, b in zip(m["lambda_10"], tg)])),
        Test2("lr_dip", "dip, lr_low - tg", "greater", D_LR_DIP, C.paired(_diff(dp["lr_low"], dp["tg"]))),
        Test2("abs_mean_over_lr", "tg's mean update_abs_mean_over_lr over steps 1..t*", "reported", 0.0,
              C.paired(_per(tg, lambda x: x["abs_mean_over_lr_to_dip"])))], n, **bootstrap)
    h2 = _evaluate([
        Test2("close_falls", f"tg's close fall (min over steps 1..{CLOSE_STEPS} of p_close_logmean "
              "minus step 0, nats)", "falls", D_CLOSE_FALLS, C.paired(_per(tg, lambda x: x["close_fall"]))),
        Test2("close_leads", "fraction of seeds whose close-fall step is at or before tg's dip step",
              "at_least", D_CLOSE_LEADS, C.paired(_per(tg, leads))),
        Test2("global_dip", "dip, norm_global - tg", "greater", D_GLOBAL_DIP,
              C.paired(_diff(dp["norm_global"], dp["tg"])))], n, **bootstrap)
    h3 = _evaluate([
        Test2("no_thinking_dip", "dip, no_thinking - tg", "greater", D_NO_THINKING_DIP,
              C.paired(_diff(dp["no_thinking"], dp["tg"]))),
        Test2("thinking_only_dips", "dip, thinking_only - tg", "not_better", D_THINKING_ONLY_DIPS,
              C.paired(_diff(dp["thinking_only"], dp["tg"]))),
        Test2("weight_frac_thinking", "tg's mean kl/weight_frac_thinking over steps 1..t*", "reported", 0.0,
              C.paired(_per(tg, lambda x: x["weight_frac_thinking_to_dip"])))], n, **bootstrap)

    def both(ev: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> str:
        return "confirmed" if all(ev[k]["passed"] for k in names) else "refuted"
    if not (h2["close_falls"]["passed"] and h2["close_leads"]["passed"]):
        v2 = "refuted"
    else:
        v2 = "confirmed" if h2["global_dip"]["passed"] else \
            "seen (the probability falls, first) but not removed by the normalisation"
    out = {"H1": {"verdict": both(h1, ("update_ratio_lambda", "lr_dip")), "decides": ["update_ratio_lambda", "lr_dip"],
                  "tests": h1},
           "H2": {"verdict": v2, "decides": ["close_falls", "close_leads", "global_dip"], "tests": h2},
           "H3": {"verdict": both(h3, ("no_thinking_dip", "thinking_only_dips")),
                  "decides": ["no_thinking_dip", "thinking_only_dips"], "tests": h3}}
    if "tg_fix" in m:
        pas = {a: _per(m[a], lambda x: x["pass"]) for a in ("tg", "tg_fix")}
        lrn = {a: _per(m[a], lambda x: learned(x, style)) for a in ("tg", "tg_fix")}
        fx = _evaluate([
            Test2("fix_dip", "dip, tg_fix - tg", "greater", D_FIX_DIP, C.paired(_diff(dp["tg_fix"], dp["tg"]))),
            Test2("fix_learned", "style criteria learned, tg_fix - tg", "not_worse", D_FIX_LEARNED,
                  C.paired(_diff(lrn["tg_fix"], lrn["tg"]))),
            Test2("fix_pass", "final pass, tg_fix - tg", "not_worse", D_FIX_PASS,
                  C.paired(_diff(pas["tg_fix"], pas["tg"])))], n, **bootstrap)
        out["fix"] = {"verdict": "validated" if all(v["passed"] for v in fx.values()) else "NOT validated",
                      "decides": list(fx), "tests": fx}
    return out


def paper_config(m: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
                 **bootstrap: Any) -> dict[str, Any]:
    """Experiment P (``m``: level -> arm -> per-seed measures): per level its verdict and tests,
    and the phase boundary."""
    levels: dict[str, dict[str, Any]] = {}
    for lvl, arms in m.items():
        tg, g = arms["paper_tg"], arms["grpo"]
        sl = {a: _per(x, lambda r: r["final"]["search_lines"]) for a, x in (("tg", tg), ("grpo", g))}
        ev = _evaluate([
            Test2(f"tg_learns_{lvl}", "paper_tg's final search_lines", "at_least", P_TG_LEARNS, C.paired(sl["tg"])),
            Test2(f"tg_vs_grpo_{lvl}", "final search_lines, paper_tg - grpo", "greater", P_TG_VS_GRPO,
                  C.paired(_diff(sl["tg"], sl["grpo"]))),
            Test2(f"pass_vs_grpo_{lvl}", "final pass, paper_tg - grpo", "not_worse", P_PASS_VS_GRPO,
                  C.paired(_diff(_per(tg, lambda r: r["pass"]), _per(g, lambda r: r["pass"]))))],
            _nseeds(arms), **bootstrap)
        ok = all(v["passed"] for v in ev.values())
        levels[lvl] = {"verdict": "reproduced" if ok else "NOT reproduced", "decides": list(ev), "tests": ev}
    return {"levels": levels, "boundary": boundary({k: v["verdict"] == "reproduced" for k, v in levels.items()})}


def boundary(reproduced: Mapping[str, bool]) -> str:
    """The lowest level reproduced with every higher level reproduced too; when the levels
    disagree with that order, each level's verdict."""
    order = sorted(reproduced, key=float)
    flags = [reproduced[k] for k in order]
    if any(a and not b for a, b in zip(flags, flags[1:])):
        return "levels out of order: " + ", ".join(f"{k} {'reproduced' if reproduced[k] else 'NOT reproduced'}"
                                                   for k in order)
    lowest = next((k for k, f in zip(order, flags) if f), None)
    return f"phase boundary at {lowest}" if lowest else "reproduced at no level"


# ------------------------------------------------------------------------------ seeds, provenance
def seed_set(seeds: Sequence[int], steps: int, reported: Sequence[int] = HELDOUT_SEEDS) -> str:
    """What a call on these seeds and steps is, against part 2's pre-registration."""
    s = tuple(seeds)
    if s == tuple(reported) and steps == STEPS:
        return "held-out (the pre-registered report)" if s == HELDOUT_SEEDS else "fix seeds (the fix's validation)"
    why = []
    if set(s) <= set(DEV_SEEDS):
        why.append("development seeds")
    else:
        if set(s) & set(range(3, 8)):
            why.append("seeds 3-7 are part 1's held-out seeds, not used by part 2")
        why.append(f"not the pre-registered seeds {','.join(map(str, reported))}")
    if steps != STEPS:
        why.append(f"{steps} steps, not the pre-registered {STEPS}")
    return "NOT the pre-registered report: " + "; ".join(why)


def provenance(root: Path = ROOT, files: Sequence[str] = RULE_FILES) -> dict[str, Any]:
    """Part 1's provenance of part 2's files; the document commit is ``docs/claims-2.md``'s."""
    p = C.provenance(root, files)
    if p["head"] is not None:
        p["claims_commit"] = C._git(Path(root), "log", "-1", "--format=%H", "--", CLAIMS2_DOC) or None
    return p


def provenance_lines(p: Mapping[str, Any]) -> list[str]:
    files = p["files"]
    lines = [f"rules: {CLAIMS2_DOC} {files.get(CLAIMS2_DOC, 'missing')[:12]}, "
             + ", ".join(f"{Path(f).name} {h[:12]}" for f, h in files.items() if f != CLAIMS2_DOC)
             + " (git blob hashes)"]
    if p["head"] is None:
        lines.append(f"HEAD: {p['git']}")
    else:
        mod = p["modified"]
        lines.append(f"HEAD {p['head'][:12]}; {CLAIMS2_DOC} last committed in "
                     f"{(p['claims_commit'] or 'no commit (untracked)')[:12]}; "
                     + (f"MODIFIED since HEAD: {', '.join(mod)}" if mod else "rule files as committed"))
    return lines
