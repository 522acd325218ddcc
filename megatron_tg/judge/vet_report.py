"""Feedback vetting's statistics and report: each arm's tally, the with-vs-without comparison of a
criterion and its verdict, and the printed table (the procedure is :mod:`megatron_tg.judge.vetting`).

Statistics, per criterion (rollouts whose judging failed are excluded from both arms):

* pass rate without (p0 = k0/n0), with (p1 = k1/n1), and d = p1 − p0 with Newcombe's hybrid
  score interval (Newcombe 1998, method 10: built from the two Wilson score intervals). It
  treats the arms as independent samples; for the branched final-turn design the arms share
  their prefixes (positively correlated), which makes the interval conservative.
* the primary criterion (all of the rubric's ``primary`` criteria pass) the same way, plus the
  mean weighted primary reward of each arm.
* verdict ``keep`` iff the criterion's CI lower bound > ``min_improvement`` (default 0) AND the
  primary pass rate does not drop by more than ``max_primary_drop`` (point estimate: with a
  few dozen samples the CI of a drop is too wide to demand its bound). No multiple-comparison
  correction across criteria. A rubric without a primary criterion skips the primary check.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from megatron_tg.judge.intervals import newcombe_interval
from megatron_tg.judge.judge import JudgeResult
from megatron_tg.judge.rubric import Criterion
from megatron_tg.rollout.types import Rollout

CI_METHOD = "newcombe-hybrid-score (Wilson), independent arms"


@dataclass
class Arm:
    """One condition (with / without feedback) of one criterion."""

    rollouts: int = 0        # generated
    rollout_errors: int = 0  # the rollout itself failed (engine / harness exception)
    judge_errors: int = 0    # judged with an error: excluded (never a silent pass or fail)
    n: int = 0               # judged without error: the denominator
    passed: int = 0          # criterion passed
    primary_passed: int | None = None   # every primary criterion passed (None: rubric has none)
    primary_reward: float | None = None  # mean weighted reward of the primary criteria

    @property
    def rate(self) -> float:
        return self.passed / self.n if self.n else math.nan

    @property
    def primary_rate(self) -> float | None:
        if self.primary_passed is None:
            return None
        return self.primary_passed / self.n if self.n else math.nan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rate"] = _num(self.rate)
        d["primary_rate"] = _num(self.primary_rate)
        return d


@dataclass
class CriterionReport:
    name: str
    scope: str
    feedback: str
    design: str
    """"fresh": independent rollouts with F before every turn; "branch_final_turn": each
    without-rollout's last turn regenerated with F (see :mod:`megatron_tg.judge.vetting`)."""
    without: Arm
    with_: Arm
    diff: float
    ci: tuple[float, float]
    primary_diff: float | None
    primary_ci: tuple[float, float] | None
    verdict: str
    reasons: list[str] = field(default_factory=list)
    replay_mismatches: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scope": self.scope, "feedback": self.feedback,
                "design": self.design, "without": self.without.to_dict(),
                "with": self.with_.to_dict(), "diff": _num(self.diff),
                "ci": [_num(x) for x in self.ci], "primary_diff": _num(self.primary_diff),
                "primary_ci": None if self.primary_ci is None else [_num(x) for x in self.primary_ci],
                "verdict": self.verdict, "reasons": list(self.reasons),
                "replay_mismatches": self.replay_mismatches}


def _num(x: float | None) -> float | None:
    """JSON-safe number (NaN -> None, so the report stays strict JSON)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return float(x)


def tally_arm(results: Sequence[tuple[Rollout, Any, JudgeResult]], failed: int, name: str,
              primary: Sequence[str]) -> Arm:
    """One arm of criterion ``name`` from its judged rollouts (``(rollout, ctx, result)``) and
    the count of rollouts that failed before judging."""
    arm = Arm(rollouts=len(results) + failed, rollout_errors=failed)
    good = [res for _, _, res in results if res.trainable and name in res.criteria]
    arm.judge_errors = len(results) - len(good)
    arm.n = len(good)
    arm.passed = sum(res.criteria[name].passed for res in good)
    if primary:
        arm.primary_passed = sum(all(res.criteria[p].passed for p in primary if p in res.criteria)
                                 for res in good)
        rewards = [res.reward_sum(primary) for res in good]
        rewards = [r for r in rewards if r is not None]
        arm.primary_reward = sum(rewards) / len(rewards) if rewards else None
    return arm


def criterion_report(c: Criterion, fb: str, design: str, a0: Arm, a1: Arm, primary: Sequence[str],
                     *, confidence: float, min_improvement: float, max_primary_drop: float,
                     mismatches: int) -> CriterionReport:
    """The criterion's comparison of its two arms (without: ``a0``, with: ``a1``) and the
    verdict (see the module docstring)."""
    d, lo, hi = newcombe_interval(a1.passed, a1.n, a0.passed, a0.n, confidence)
    reasons = []
    if a0.n == 0 or a1.n == 0:
        reasons.append("no judged rollouts in one arm")
    elif not lo > min_improvement:
        reasons.append(f"pass-rate gain not significant: CI lower bound {lo:+.3f} <= "
                       f"{min_improvement:+.3f}")
    pd = pci = None
    if primary and a0.n and a1.n:
        pd, plo, phi = newcombe_interval(a1.primary_passed, a1.n, a0.primary_passed, a0.n,
                                         confidence)
        pci = (plo, phi)
        if pd < -max_primary_drop - 1e-12:
            reasons.append(f"primary pass rate drops by {-pd:.3f} > {max_primary_drop:.3f}")
    return CriterionReport(c.name, c.scope, fb, design, a0, a1, d, (lo, hi), pd, pci,
                           "reject" if reasons else "keep", reasons, mismatches)


# ---------------------------------------------------------------------- printing
def format_report(report: Mapping[str, Any]) -> str:
    conf = int(round(100 * report["confidence"]))
    lines = [f"rubric {report['rubric']!r}: {len(report['tasks'])} task(s) x "
             f"{report['samples_per_task']} sample(s) per arm; {conf}% CI: {report['ci_method']}; "
             f"keep if CI low > {report['thresholds']['min_improvement']:+.2f} and primary drop "
             f"<= {report['thresholds']['max_primary_drop']:.2f}",
             ""]
    hdr = (f"{'criterion':<24} {'scope':<13} {'without':>12} {'with':>12} {'diff [CI]':>24} "
           f"{'primary pass w/o -> with':>28}  verdict")
    lines.append(hdr)

    def rate(arm):
        return f"{arm['passed']}/{arm['n']} {_fmt(arm['rate'])}"

    for r in report["criteria"]:
        ci = f"{_fmt(r['diff'], True)} [{_fmt(r['ci'][0], True)}, {_fmt(r['ci'][1], True)}]"
        if r["primary_diff"] is None:
            prim = "-"
        else:
            prim = (f"{_fmt(r['without']['primary_rate'])} -> {_fmt(r['with']['primary_rate'])} "
                    f"({_fmt(r['primary_diff'], True)})")
        lines.append(f"{r['name']:<24} {r['scope']:<13} {rate(r['without']):>12} "
                     f"{rate(r['with']):>12} {ci:>24} {prim:>28}  {r['verdict']}")
        for why in r["reasons"]:
            lines.append(f"    {why}")
        errs = sum(r[a][k] for a in ("without", "with") for k in ("rollout_errors", "judge_errors"))
        if errs or r["replay_mismatches"]:
            lines.append(f"    excluded: {errs} rollout(s) with rollout/judge errors; "
                         f"replay mismatches: {r['replay_mismatches']}")
    return "\n".join(lines)


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.2f}" if signed else f"{x:.2f}"
