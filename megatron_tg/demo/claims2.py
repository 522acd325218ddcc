"""Part 2 of the paper's claims (``docs/claims-2.md``): its numbers, measures, seeds and provenance.

The tests and verdicts of experiments S, D and P are :mod:`.claims2_verdicts`'s; the Student-t
intervals and the test kinds :mod:`.tinterval`'s. Part 1's rule file (:mod:`.claims`) is not
touched: its held-out record keeps its hash; only its final-rate window, its "learned" and its
provenance helpers are used.

Measures of one run come from its ``metrics.jsonl`` rows (:func:`measure`). Step t's rollouts
come from the weights after update t-1 (version t-1); the call probe logged at step s read the
weights after update s (version s), step 0 the base's. A measure the rows cannot give (too few
steps, an instrument off) is NaN; an onset that does not happen is None.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from megatron_tg.demo import claims as C

ROOT = C.ROOT
CLAIMS2_DOC = "docs/claims-2.md"
RULE_FILES = (CLAIMS2_DOC, "megatron_tg/demo/claims2.py", "megatron_tg/demo/claims2_verdicts.py",
              "megatron_tg/demo/tinterval.py", "megatron_tg/demo/claims.py",
              "megatron_tg/demo/suite2.py", "megatron_tg/demo/stability_suite.py",
              "megatron_tg/demo/dip_suite.py", "megatron_tg/demo/paper_config_suite.py",
              "recipes/demo_paper_cpu.yaml", "recipes/demo_cpu.yaml")
"""The pre-registration, the rule code (with part 1's learned/final rate), the suites' arms and recipes."""

# ------------------------------------------------------------------------------ the numbers
DEV_SEEDS = (0, 1, 2)
HELDOUT_SEEDS = (8, 9, 10, 11, 12)
FIX_SEEDS = (13, 14, 15, 16, 17)
STEPS = 25
CONFIDENCE = 0.95
HYPOTHESIS_FAMILY = 3
S_SKIP_SEARCH_FRACTION = 0.3
S_BASE_SUCCESS_RANGE = (0.3, 0.7)
S_GRPO_LEARNS, S_WORST_VS_GRPO, S_FINAL_PASS_VS_GRPO = 0.1, 0.1, 0.05
S_WORST_VS_PLACEBO, S_LEARNED_VS_PLACEBO, S_LEARNED_VS_GRPO = 0.1, 1.0, 1.0
S_POWER_HALF_WIDTH = 0.1
D_LR_LOW = 1.0e-4
D_ACTION_WEIGHT = 4
D_TG_DIPS, D_DIPPING_SEED, D_ONSET_DROP, D_CLOSE_ONSET_NATS = -0.15, -0.1, 0.1, 0.5
D_LAMBDA_DIP, D_LR_DIP = 0.1, 0.1
D_CLOSE_FALLS, D_BRANCH_RISES, D_CLOSE_LEADS, D_ACTION_X4_DIP = -0.5, 1.0, 0.8, 0.1
D_NO_THINKING_DIP, D_THINKING_ONLY_DIPS = 0.1, 0.1
D_FIX_DIP, D_FIX_LEARNED, D_FIX_PASS = 0.1, 0.5, 0.05
P_LEVELS = ("1e-4", "1e-3", "1e-2")
P_LEVEL_FACTOR = 3
P_TG_LEARNS, P_TG_VS_GRPO, P_PASS_VS_GRPO = 0.8, 0.3, 0.05

HYPOTHESIS_CONFIDENCE = 1 - (1 - CONFIDENCE) / HYPOTHESIS_FAMILY
"""1 - 0.05/3: the confidence of the tests that decide H1-H3 (one family per hypothesis)."""
LAST, ROLLING, PROBE_VERSIONS, RATIO_STEPS = C.LAST, 3, 25, 10
"""Part 1's final-rate window; rolling3's window; close fall, close onset and branch rise over
versions 1..25; update ratio over steps 1..10."""
PASS, CLOSE, BRANCH = "criteria/answer", "probe/p_close_logmean", "probe/p_branch_logmean"
UPDATE_NORM, ABS_MEAN = "optim/update_norm", "optim/update_abs_mean_over_lr"
WEIGHT_THINK, GATED_THINK = "kl/weight_frac_thinking", "kl/frac_gated_thinking"
TO_DIP = {"abs_mean_over_lr_to_dip": ABS_MEAN, "weight_frac_thinking_to_dip": WEIGHT_THINK,
          "frac_gated_thinking_to_dip": GATED_THINK}
"""Measure -> the metric averaged over steps 1..t* (reported in H1 and H2)."""


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
    """start (pass_1), dip, dip step t* (first t of the minimum), worst and the pass onset
    s_p (version t_p - 1 of the first t_p >= 2 with pass <= start - 0.1; None if none)."""
    roll = rolling3(pas)
    if 1 not in pas or not roll:
        return {"start": math.nan, "dip": math.nan, "dip_step": None, "worst": math.nan, "pass_onset": None}
    start, worst = pas[1], min(roll.values())
    onset = next((t - 1 for t in sorted(pas) if t >= 2 and pas[t] <= start - D_ONSET_DROP), None)
    return {"start": start, "dip": worst - start, "dip_step": min(t for t, v in roll.items() if v == worst),
            "worst": worst, "pass_onset": onset}


def probe_change(series: Mapping[int, float], versions: int = PROBE_VERSIONS) -> dict[str, float]:
    """{min, max}: the extreme of the probe over versions 1..versions minus version 0's (NaN
    without version 0 or any later one)."""
    after = [v for s, v in series.items() if 1 <= s <= versions]
    if 0 not in series or not after:
        return {"min": math.nan, "max": math.nan}
    return {"min": min(after) - series[0], "max": max(after) - series[0]}


def close_onset(close: Mapping[int, float], versions: int = PROBE_VERSIONS) -> int | None:
    """The first version in 1..versions whose close log-mean is 0.5 nats or more below version 0's."""
    if 0 not in close:
        return None
    return next((s for s in sorted(close) if 1 <= s <= versions and close[s] <= close[0] - D_CLOSE_ONSET_NATS),
                None)


def final(series: Mapping[int, float], last: int = LAST) -> float:
    xs = [series[t] for t in sorted(series) if t >= 1][-last:]
    return _mean(xs)


def measure(rows: Sequence[Mapping[str, Any]], criteria: Sequence[str]) -> dict[str, Any]:
    """One run's measures; ``criteria``: the judge's criteria whose final rates are kept
    (``criteria/<name>``)."""
    pas = {t: v for t, v in by_step(rows, PASS).items() if t >= 1}
    d = dip_measures(pas)
    close = by_step(rows, CLOSE)
    upto = d["dip_step"]

    def mean_to_dip(key: str) -> float:
        s = by_step(rows, key)
        return _mean([v for t, v in s.items() if upto is not None and 1 <= t <= upto])
    return {**d, "pass": final(pas), "final": {c: final(by_step(rows, f"criteria/{c}")) for c in criteria},
            "close_fall": probe_change(close)["min"], "close_onset": close_onset(close),
            "branch_rise": probe_change(by_step(rows, BRANCH))["max"],
            "update_norm": {str(t): v for t, v in by_step(rows, UPDATE_NORM).items()},
            **{k: mean_to_dip(key) for k, key in TO_DIP.items()}, "steps": len(pas)}


def update_ratio(a: Mapping[str, Any], b: Mapping[str, Any], steps: int = RATIO_STEPS) -> float:
    """Mean over steps 1..steps (those both logged) of a's update norm over b's."""
    ua, ub = a["update_norm"], b["update_norm"]
    ks = [str(t) for t in range(1, steps + 1) if str(t) in ua and str(t) in ub]
    if not ks or any(ub[k] <= 0 for k in ks):
        return math.nan
    return _mean([ua[k] / ub[k] for k in ks])


def learned(x: Mapping[str, Any], style: Sequence[str]) -> float:
    """Style criteria learned (part 1's: final rate >= :data:`.claims.LEARNED`); NaN when a
    final rate is missing."""
    rates = {c: x["final"][c] for c in style}
    return math.nan if any(v != v for v in rates.values()) else float(C.learned(rates))


def dips(x: Mapping[str, Any]) -> bool | None:
    """Whether a tg run is a dipping seed (dip <= -0.1); None when its dip is unmeasured."""
    return None if x["dip"] != x["dip"] else x["dip"] <= D_DIPPING_SEED


def leads(x: Mapping[str, Any]) -> float:
    """1 when the close onset is strictly before the pass onset (s_c < s_p), 0 when not or
    when there is no close onset; NaN when the probe or the pass rate is unmeasured."""
    if x["close_fall"] != x["close_fall"] or x["dip"] != x["dip"]:
        return math.nan
    if x["close_onset"] is None:
        return 0.0
    if x["pass_onset"] is None:  # the task never fails by 0.1: nothing to lead (not a dipping seed)
        return math.nan
    return float(x["close_onset"] < x["pass_onset"])


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
