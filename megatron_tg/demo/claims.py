"""The paper suite's pre-registered rules (``docs/claims.md``), their bootstrap, and provenance.

Every claim is a conjunction of *tests*; a test is a statistic over the seeds of the suite
(paired: one seed's runs of every arm share its sampling seed), a kind and a margin:

* ``greater``: reproduced when the point estimate is at least ``margin`` and the lower end of
  the bootstrap interval is above 0;
* ``not_worse``: reproduced when the lower end of the bootstrap interval is at least
  ``-margin`` (non-inferiority);
* ``at_least`` / ``at_most``: the point estimate against a level (``margin`` is the level).

The interval: :data:`BOOTSTRAP` resamples of the seeds with replacement (the same resample
for every arm of a test), the 2.5 and 97.5 percentiles of the statistic, from a
``random.Random(BOOTSTRAP_SEED)`` made afresh per test (so a test's interval does not
depend on the others). A statistic that is NaN on the data (a run logged too few steps)
makes its test, and so its claim, not reproduced.

:func:`provenance` records what decided the verdicts: the git blob hash (what
``git hash-object`` prints) of ``docs/claims.md`` and of every file of the rules and arms
(:data:`RULE_FILES`), the checkout's HEAD, the last commit that changed ``docs/claims.md``,
and which of those files differ from HEAD; outside a git checkout the blob hashes are still
computed (they need no git) and ``git`` says ``"not a git checkout"``.

The numbers of this module are the pre-registration's (``docs/claims.md`` states them in
words); a test checks the two agree.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[2]
CLAIMS_DOC = "docs/claims.md"
RULE_FILES = (CLAIMS_DOC, "megatron_tg/demo/claims.py", "megatron_tg/demo/paper_suite.py",
              "recipes/demo_paper_cpu.yaml", "recipes/demo_cpu.yaml")
"""The pre-registration, the rule code, the arms and the recipes they run (repo-relative)."""

DEV_SEEDS = (0, 1, 2)
"""Seeds every tuning decision of the suite's arms was made on."""
HELDOUT_SEEDS = (3, 4, 5, 6, 7)
"""The reported seeds: never used for tuning, run once after the arms and rules are frozen."""
STEPS, LAST = 25, 5
"""Steps per run; final rate = mean over the last ``LAST`` steps."""
BOOTSTRAP, BOOTSTRAP_SEED, CONFIDENCE = 10_000, 0, 0.95

LEARNED = 0.9
"""A style criterion is learned by a run when its final rate is at least this."""
T1_LEARNED_VS_OPSD, T1_SPREAD_VS_OPSD = 0.5, 0.05
T1_LEARNED_VS_GRPO, T1_PASS_VS_GRPO = 1.0, 0.05
F5_PASS_VS_ALWAYS_ON, F5_TG_EVERY_TURN = 0.05, 0.9
F6_SPIKE, F6_COLLAPSE_EXCESS = 2.0, 0.6
F7_REVERSALS = 1.0
STABILITY_GAP, ROLLING = 0.1, 3
FEEDBACK_REVERSALS = 1.0


# ------------------------------------------------------------------------------ bootstrap
def bootstrap_interval(stat: Callable[[Sequence[int]], float], n: int, *, b: int = BOOTSTRAP,
                       seed: int = BOOTSTRAP_SEED, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile interval of ``stat(indices)`` over ``b`` resamples of ``range(n)`` with
    replacement. NaN if the statistic is NaN on any resample, or ``n`` is 0."""
    if n < 1:
        return math.nan, math.nan
    vals = []
    for idx in _resamples(n, b, seed):
        v = stat(idx)
        if v != v:
            return math.nan, math.nan
        vals.append(v)
    vals.sort()
    tail = (1.0 - confidence) / 2
    lo = vals[min(b - 1, max(0, math.floor(tail * b)))]
    hi = vals[min(b - 1, max(0, math.ceil((1.0 - tail) * b) - 1))]
    return lo, hi


@functools.lru_cache(maxsize=8)
def _resamples(n: int, b: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """The ``b`` resamples of ``range(n)`` that ``random.Random(seed)`` draws (the same for
    every test: each makes its generator afresh)."""
    rng = random.Random(seed)
    return tuple(tuple(rng.randrange(n) for _ in range(n)) for _ in range(b))


@dataclass(frozen=True)
class Test:
    name: str
    what: str
    """The statistic, in words."""
    kind: str
    margin: float
    stat: Callable[[Sequence[int]], float]
    """The statistic on a list of indices into the seeds (``range(n)`` = the data)."""

    def rule(self) -> str:
        return {"greater": f">= {self.margin:g} and interval low > 0",
                "not_worse": f"interval low >= {-self.margin:g}",
                "at_least": f">= {self.margin:g}", "at_most": f"<= {self.margin:g}"}[self.kind]

    def evaluate(self, n: int, **bootstrap: Any) -> dict[str, Any]:
        point = self.stat(list(range(n))) if n else math.nan
        lo, hi = bootstrap_interval(self.stat, n, **bootstrap)
        if point != point or lo != lo:
            ok = False
        elif self.kind == "greater":
            ok = point >= self.margin and lo > 0
        elif self.kind == "not_worse":
            ok = lo >= -self.margin
        elif self.kind == "at_least":
            ok = point >= self.margin
        elif self.kind == "at_most":
            ok = point <= self.margin
        else:
            raise ValueError(f"test {self.name}: unknown kind {self.kind!r}")
        return {"what": self.what, "rule": self.rule(), "estimate": point, "interval": [lo, hi],
                "passed": bool(ok)}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if len(xs) else math.nan


def _pstdev(xs: Sequence[float]) -> float:
    """Population standard deviation (floats; ``statistics.pstdev`` is exact and slow)."""
    mu = _mean(xs)
    return math.sqrt(max(0.0, sum((x - mu) ** 2 for x in xs) / len(xs)))


def paired(values: Sequence[float]) -> Callable[[Sequence[int]], float]:
    """The statistic "mean over seeds" of per-seed values."""
    vals = list(values)
    return lambda idx: _mean([vals[i] for i in idx])


def spread(per_seed: Sequence[Mapping[str, float]], criteria: Sequence[str], idx: Sequence[int]) -> float:
    """Mean over ``criteria`` of the population std over the seeds ``idx`` of the final rate."""
    return _mean([_pstdev([per_seed[i][c] for i in idx]) for c in criteria])


# ------------------------------------------------------------------------------ per-run quantities
def learned(style: Mapping[str, float]) -> int:
    return sum(1 for v in style.values() if v == v and v >= LEARNED)


def relative_spike(run: Mapping[str, Any], grpo: Mapping[str, Any]) -> float:
    """Largest ``entropy/all`` of ``run`` over the largest of the same seed's GRPO run, on the
    steps both logged (NaN when either has none or GRPO's largest is 0)."""
    a, g = run["entropy_series"], grpo["entropy_series"]
    k = min(len(a), len(g))
    if k == 0 or max(g[:k]) <= 0:
        return math.nan
    return max(a[:k]) / max(g[:k])


def spiked_collapse(run: Mapping[str, Any], grpo: Mapping[str, Any]) -> bool:
    """The run collapsed (:func:`.paper_suite.collapse_step`) and its entropy peaked, at least
    :data:`F6_SPIKE` times the same seed's GRPO peak, at or before the collapse."""
    col, peak = run["collapse_step"], run["entropy_peak_step"]
    rel = relative_spike(run, grpo)
    return col is not None and peak is not None and rel == rel and rel >= F6_SPIKE and peak <= col


def rolling_gap(run: Mapping[str, Any], base: Mapping[str, Any], window: int = ROLLING) -> float:
    """min over steps of (``run``'s ``window``-step rolling pass rate − ``base``'s), on the
    steps both logged; NaN with fewer than ``window`` common steps."""
    a = dict(zip(run["steps_series"], run["pass_series"]))
    b = dict(zip(base["steps_series"], base["pass_series"]))
    steps = sorted(set(a) & set(b))
    if len(steps) < window:
        return math.nan
    ra = [_mean([a[s] for s in steps[i:i + window]]) for i in range(len(steps) - window + 1)]
    rb = [_mean([b[s] for s in steps[i:i + window]]) for i in range(len(steps) - window + 1)]
    return min(x - y for x, y in zip(ra, rb))


def total_reversals(run: Mapping[str, Any]) -> int:
    return sum(run["reversals"].values())


# ------------------------------------------------------------------------------ the claims
CLAIM_ARMS = {"table1": ("grpo", "opsd", "tg"), "fig5": ("opsd", "tg", "grpo"),
              "fig6": ("grpo", "lambda_0.1", "lambda_10"), "fig7": ("tg", "no_thinking"),
              "stability": ("grpo", "tg"), "feedback": ("tg", "tg_failing")}
PAPER_CLAIMS = ("table1", "fig5", "fig6", "fig7", "stability")
"""The paper's claims; ``feedback`` is reported too but is not one of them."""


def tests(m: Mapping[str, Sequence[Mapping[str, Any]]], style_criteria: Sequence[str],
          every_turn: str = "brief_thinking") -> dict[str, list[Test]]:
    """Claim -> its tests, on ``m`` (arm -> per-seed measures, the same seeds in the same
    order for every arm)."""
    def per(arm: str, f: Callable[[Mapping[str, Any]], float]) -> list[float]:
        return [float(f(x)) for x in m[arm]]

    def diff(a: Sequence[float], b: Sequence[float]) -> list[float]:
        return [x - y for x, y in zip(a, b)]

    lrn = {a: per(a, lambda x: learned(x["style"])) for a in ("grpo", "opsd", "tg", "tg_failing") if a in m}
    pas = {a: per(a, lambda x: x["pass"]) for a in m}
    rev = {a: per(a, total_reversals) for a in ("tg", "no_thinking", "tg_failing") if a in m}
    t1_spread = lambda idx: (spread([x["style"] for x in m["opsd"]], style_criteria, idx)
                             - spread([x["style"] for x in m["tg"]], style_criteria, idx))
    grpo = m["grpo"]
    hi = [float(spiked_collapse(x, g)) for x, g in zip(m["lambda_10"], grpo)]
    lo = [float(x["collapse_step"] is not None) for x in m["lambda_0.1"]]
    return {
        "table1": [
            Test("learned_vs_opsd", f"style criteria learned (final >= {LEARNED}) per seed, tg - opsd",
                 "greater", T1_LEARNED_VS_OPSD, paired(diff(lrn["tg"], lrn["opsd"]))),
            Test("spread_vs_opsd", "per-criterion std over seeds of the final rate (mean of the "
                 "criteria), opsd - tg", "greater", T1_SPREAD_VS_OPSD, t1_spread),
            Test("learned_vs_grpo", f"style criteria learned (final >= {LEARNED}) per seed, tg - grpo",
                 "greater", T1_LEARNED_VS_GRPO, paired(diff(lrn["tg"], lrn["grpo"]))),
            Test("pass_vs_grpo", "final task pass rate, tg - grpo", "not_worse", T1_PASS_VS_GRPO,
                 paired(diff(pas["tg"], pas["grpo"])))],
        "fig5": [
            Test("pass_vs_always_on", "final task pass rate, tg - opsd (feedback on every turn)",
                 "greater", F5_PASS_VS_ALWAYS_ON, paired(diff(pas["tg"], pas["opsd"]))),
            Test("tg_every_turn", f"tg's final {every_turn} rate (the every-turn criterion)",
                 "at_least", F5_TG_EVERY_TURN, paired(per("tg", lambda x: x["style"][every_turn])))],
        "fig6": [
            Test("collapse_excess", f"fraction of seeds where lambda 10 collapses after an entropy "
                 f"peak >= {F6_SPIKE:g}x the same seed's grpo peak, minus the fraction where "
                 "lambda 0.1 collapses", "greater", F6_COLLAPSE_EXCESS, paired(diff(hi, lo))),
            Test("low_lambda_stable", "fraction of seeds where lambda 0.1 collapses", "at_most", 0.0,
                 paired(lo))],
        "fig7": [
            Test("reversals", "style-criterion reversals per seed, no_thinking - tg", "greater",
                 F7_REVERSALS, paired(diff(rev["no_thinking"], rev["tg"])))],
        "stability": [
            Test("rolling_gap", f"lowest over steps of tg's {ROLLING}-step rolling pass rate minus the "
                 "same seed's grpo's, mean over seeds", "not_worse", STABILITY_GAP,
                 paired([rolling_gap(x, g) for x, g in zip(m["tg"], grpo)]))],
        "feedback": [
            Test("reversals", "style-criterion reversals per seed, tg_failing - tg", "greater",
                 FEEDBACK_REVERSALS, paired(diff(rev["tg_failing"], rev["tg"])))],
    }


def verdicts(m: Mapping[str, Sequence[Mapping[str, Any]]], style_criteria: Sequence[str],
             **bootstrap: Any) -> dict[str, dict[str, Any]]:
    """Claim -> {"reproduced", "paper_claim", "arms", "tests": name -> evaluated test}."""
    n = {len(v) for v in m.values()}
    if len(n) != 1:
        raise ValueError(f"every arm needs the same seeds; got seed counts {sorted(n)}")
    seeds = n.pop()
    out = {}
    for claim, ts in tests(m, style_criteria).items():
        ev = {t.name: t.evaluate(seeds, **bootstrap) for t in ts}
        out[claim] = {"reproduced": all(v["passed"] for v in ev.values()),
                      "paper_claim": claim in PAPER_CLAIMS, "arms": list(CLAIM_ARMS[claim]), "tests": ev}
    return out


def seed_set(seeds: Sequence[int], steps: int) -> str:
    """What a run of these seeds and steps is, against the pre-registration."""
    if tuple(seeds) == HELDOUT_SEEDS and steps == STEPS:
        return "held-out (the pre-registered report)"
    why = []
    if set(seeds) <= set(DEV_SEEDS):
        why.append("development seeds (used for tuning)")
    elif tuple(seeds) != HELDOUT_SEEDS:
        why.append(f"not the pre-registered seeds {','.join(map(str, HELDOUT_SEEDS))}")
    if steps != STEPS:
        why.append(f"{steps} steps, not the pre-registered {STEPS}")
    return "NOT the pre-registered report: " + "; ".join(why)


# ------------------------------------------------------------------------------ provenance
def blob_hash(path: Path) -> str:
    """The git blob id of a file's bytes (what ``git hash-object`` prints, without filters)."""
    data = Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _git(root: Path, *args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def provenance(root: Path = ROOT, files: Sequence[str] = RULE_FILES) -> dict[str, Any]:
    root = Path(root)
    hashes = {f: (blob_hash(root / f) if (root / f).is_file() else "missing") for f in files}
    head = _git(root, "rev-parse", "HEAD") if _git(root, "rev-parse", "--is-inside-work-tree") == "true" else None
    if head is None:
        return {"git": "not a git checkout: HEAD unknown; file hashes computed as git hash-object would",
                "head": None, "claims_commit": None, "modified": None, "files": hashes}
    changed = (_git(root, "diff", "--name-only", "HEAD", "--", *files) or "").splitlines()
    untracked = (_git(root, "ls-files", "--others", "--exclude-standard", "--", *files) or "").splitlines()
    modified = sorted({f.strip() for f in changed + untracked if f.strip()})
    return {"git": "checkout", "head": head,
            "claims_commit": _git(root, "log", "-1", "--format=%H", "--", CLAIMS_DOC) or None,
            "modified": modified, "files": hashes}


def provenance_lines(p: Mapping[str, Any]) -> list[str]:
    files = p["files"]
    lines = [f"rules: {CLAIMS_DOC} {files.get(CLAIMS_DOC, 'missing')[:12]}, "
             + ", ".join(f"{Path(f).name} {h[:12]}" for f, h in files.items() if f != CLAIMS_DOC)
             + " (git blob hashes)"]
    if p["head"] is None:
        lines.append(f"HEAD: {p['git']}")
    else:
        mod = p["modified"]
        lines.append(f"HEAD {p['head'][:12]}; {CLAIMS_DOC} last committed in "
                     f"{(p['claims_commit'] or 'no commit (untracked)')[:12]}; "
                     + (f"MODIFIED since HEAD: {', '.join(mod)}" if mod else "rule files as committed"))
    return lines


def amendment(first: Mapping[str, Any] | None, now: Mapping[str, Any]) -> dict[str, Any] | None:
    """Against the first held-out verdicts of an output directory (``first``: its record):
    None when the rule files are the same; else which changed, and the first verdicts, to be
    reported as a rule changed after seeing held-out results."""
    if not first:
        return None
    changed = sorted(f for f in set(first["provenance"]["files"]) | set(now["files"])
                     if first["provenance"]["files"].get(f) != now["files"].get(f))
    if not changed:
        return None
    return {"changed_after_heldout": changed, "first_head": first["provenance"].get("head"),
            "first_verdicts": {k: v["reproduced"] for k, v in first["claims"].items()}}
