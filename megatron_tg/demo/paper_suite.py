"""The paper suite: Table 1 and Figures 5-7 at toy scale, on :mod:`.paper_env`.

    python -m megatron_tg.demo --suite paper --out runs/paper [--seeds 3,4,5,6,7] [--jobs 2]

One base model (:mod:`.paper_base`: thinks before it acts, never meets the three style
criteria without their feedback), then the RL runs of :func:`plan` (25 steps, seeded sampling, no
staleness, ``recipes/demo_paper_cpu.yaml``, ``--env paper``) on every seed. Every arm gets the
same reward (all four criteria, the recipe's weights and ``style_reward``); the arms differ in
their KL term only:

============  ======================================  ======================================
run           what                                     used by
============  ======================================  ======================================
grpo          GRPO alone (no KL)                       Table 1, Figure 5, Figure 6, stability
opsd          KL on every turn, ungated (mode          Table 1 (OPSD), Figure 5 (always-on
              ``always_on``: OPSD with TG's reward)    feedback)
tg            failure-gated KL, λ = 1                  Table 1, Figures 5 and 7, stability
no_thinking   tg without KL on thinking tokens         Figure 7
lambda_0.1    tg with λ = 0.1                          Figure 6
lambda_10     tg with λ = 10                           Figure 6
tg_failing    tg, the expert told only the failed      ``feedback`` (not a paper claim; the
              criteria (the paper's f_t)               recipe's tg tells it every criterion)
============  ======================================  ======================================

The paper's OPSD has the task reward only, and its Figure 5 always-on arm has TG's rewards;
with the same reward for every arm the two are one method, run once (``opsd``). The main
demo's ``opsd`` (``objective.mode=opsd``) keeps the paper's definition.

Each claim is decided by the rules pre-registered in ``docs/claims.md`` and coded in
:mod:`.claims` (metric, margin, bootstrap interval over seeds); the command prints each as
``reproduced`` or ``NOT reproduced`` with every test's estimate and interval, the git hashes
of the claims document and the rule code (:func:`.claims.provenance`), and whether the seeds
are the pre-registered held-out ones (3-7) or development seeds (0-2, the default). It writes
``OUT/paper.json`` and ``OUT/paper.png``, and exits 0 either way (1: a run failed). The first
held-out verdicts of an output directory are kept in ``OUT/heldout_first.json``; a later call
whose rule files differ reports the change and the first verdicts with its own.

Measures of one run (:func:`measure`): final rates (mean of the last :data:`LAST` steps);
*reversals*, a style criterion's rate falling by more than :data:`REVERSAL_DROP` from one
:data:`WINDOW`-step window to the next (non-overlapping windows, summed over the three
criteria); *collapse*, the first step whose 3-step rolling pass rate is below half the first
3 steps'; and the per-step series the paired rules need (entropy, pass rate).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from megatron_tg.demo import claims as C
from megatron_tg.demo import paper_base as PB
from megatron_tg.demo import paper_env as P
from megatron_tg.demo import report as R
from megatron_tg.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "demo_paper_cpu.yaml"
STEPS, LAST, SEEDS = C.STEPS, C.LAST, C.DEV_SEEDS
WINDOW, REVERSAL_DROP = 3, 0.2
LAMBDAS = {"lambda_0.1": 0.1, "tg": 1.0, "lambda_10": 10.0}
"""Figure 6's λ sweep: run name -> λ (the recipe's λ = 1 is the ``tg`` run)."""
RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("grpo", "grpo", ()), ("opsd", "always_on", ()), ("tg", "tg", ()),
    ("no_thinking", "no_thinking", ()),
    ("lambda_0.1", "tg", ("objective.kl_coef=0.1",)), ("lambda_10", "tg", ("objective.kl_coef=10.0",)),
    ("tg_failing", "tg", ("objective.expert_feedback=failing",)))
"""(run, objective.mode, extra overrides), in the order each seed makes them. No arm changes
the reward: ``opsd`` is mode ``always_on`` (ungated KL, TG's reward), not mode ``opsd``
(task reward only)."""
STYLE_KEYS = tuple(f"criteria/{c}" for c in P.STYLE_CRITERIA)
PASS = "criteria/answer"


def plan(steps: int = STEPS):
    from megatron_tg.demo.runs import Plan

    return Plan(steps=steps, seeds=tuple(SEEDS), last=LAST, variants=(), probe_every=0,
                heldout=0, seeded=True, rl_args=("--env", "paper"))


def run_specs(seeds: Sequence[int]):
    from megatron_tg.demo.runs import RunSpec

    return [RunSpec(f"{name}-s{s}", mode, s, extra=extra) for s in seeds for name, mode, extra in RUNS]


# ------------------------------------------------------------------------------ measures
def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return R.series([r for r in rows if r.get("step", 0) >= 1], key)


def final(rows, key: str, last: int = LAST) -> float:
    xs = _series(rows, key)
    return statistics.fmean(xs[-last:]) if xs else math.nan


def reversals(xs: Sequence[float], window: int = WINDOW, drop: float = REVERSAL_DROP) -> int:
    """Falls of more than ``drop`` between consecutive non-overlapping ``window``-step means."""
    w = [statistics.fmean(xs[i:i + window]) for i in range(0, len(xs) - window + 1, window)]
    return sum(1 for a, b in zip(w, w[1:]) if a - b > drop)


def collapse_step(rows) -> int | None:
    """First step whose 3-step rolling pass rate is below half the first 3 steps' mean."""
    steps = [int(r["step"]) for r in rows if r.get("step", 0) >= 1 and PASS in r]
    xs = _series(rows, PASS)
    if len(xs) < 3:
        return None
    start = statistics.fmean(xs[:3])
    roll = R.rolling_mean(xs, 3)
    return next((steps[i + 2] for i, v in enumerate(roll) if v < 0.5 * start), None)


def measure(run_dir: Path) -> dict[str, Any]:
    rows = read_metrics(run_dir)
    style = {c: final(rows, k) for c, k in zip(P.STYLE_CRITERIA, STYLE_KEYS)}
    ent = _series(rows, "entropy/all")
    peak = (1 + max(range(len(ent)), key=ent.__getitem__)) if ent else None
    return {"pass": final(rows, PASS), "style": style,
            "style_mean": statistics.fmean(style.values()),
            "all_criteria": final(rows, "demo/all_criteria"),
            "reversals": {c: reversals(_series(rows, k)) for c, k in zip(P.STYLE_CRITERIA, STYLE_KEYS)},
            "entropy_peak_step": peak, "collapse_step": collapse_step(rows),
            "entropy_series": ent, "length_series": _series(rows, "rollout/response_tokens"),
            "steps_series": [int(r["step"]) for r in rows if r.get("step", 0) >= 1
                             and isinstance(r.get(PASS), (int, float)) and r[PASS] == r[PASS]],
            "pass_series": _series(rows, PASS),
            "rolling_pass_min": R.rolling_min(run_dir), "steps": len(_series(rows, PASS))}


def _agg(xs: Sequence[float]) -> tuple[float, float]:
    xs = [x for x in xs if x == x]
    return (statistics.fmean(xs), statistics.pstdev(xs) if len(xs) > 1 else 0.0) if xs else (math.nan, math.nan)


def claims(m: Mapping[str, Sequence[Mapping[str, Any]]], **bootstrap: Any) -> dict[str, dict[str, Any]]:
    """Every claim's verdict under the pre-registered rules (:func:`.claims.verdicts`);
    ``m``: run name -> per-seed measures (the same seeds, in the same order, for every run)."""
    return C.verdicts(m, P.STYLE_CRITERIA, **bootstrap)


# ------------------------------------------------------------------------------ printing
def table(m: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """Per run: final rates (mean ± std over seeds), and per seed the reversals, the entropy
    peak over the same seed's GRPO peak, and the collapse step."""
    head = (f"{'run':<12} {'seeds':>5} " + " ".join(f"{c:>15}" for c in P.STYLE_CRITERIA)
            + f" {'all style+task':>15} {'task (pass)':>15} {'learned':>9} {'reversals':>10}"
            f" {'entropy/grpo':>16} {'collapse at':>12}")
    lines = [head]
    grpo = m.get("grpo")
    for name, xs in m.items():
        def pm(vals):
            mu, sd = _agg(vals)
            return f"{mu:.3f} ± {sd:.3f}"
        cells = [pm([x["style"][c] for x in xs]) for c in P.STYLE_CRITERIA]
        lrn = ",".join(str(C.learned(x["style"])) for x in xs)
        rev = ",".join(str(sum(x["reversals"].values())) for x in xs)
        ent = ",".join(f"{C.relative_spike(x, g):.2f}" for x, g in zip(xs, grpo)) if grpo else "-"
        col = ",".join("-" if x["collapse_step"] is None else str(x["collapse_step"]) for x in xs)
        lines.append(f"{name:<12} {len(xs):>5} " + " ".join(f"{c:>15}" for c in cells)
                     + f" {pm([x['all_criteria'] for x in xs]):>15} {pm([x['pass'] for x in xs]):>15}"
                     f" {lrn:>9} {rev:>10} {ent:>16} {col:>12}")
    return "\n".join(lines)


def verdict_lines(c: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each claim's verdict and, under it, each test: estimate, interval, rule, pass/fail."""
    out = []
    for k, v in c.items():
        tag = "" if v["paper_claim"] else "  (not a paper claim)"
        out.append(f"claim {k:<9} {'reproduced    ' if v['reproduced'] else 'NOT reproduced'}"
                   f"  arms {', '.join(v['arms'])}{tag}")
        for name, t in v["tests"].items():
            lo, hi = t["interval"]
            out.append(f"    {name:<18} {t['estimate']:+.3f} [{lo:+.3f}, {hi:+.3f}]  rule {t['rule']}: "
                       f"{'passes' if t['passed'] else 'FAILS'}  ({t['what']})")
    return out


def plot(out: Path, dirs: Mapping[str, Sequence[Path]]) -> Path:
    """Seed-mean curves: style-criteria mean per method (Table 1); pass rate, tg vs opsd, the
    always-on arm (Fig. 5); entropy and pass rate per λ (Fig. 6); each criterion, tg vs no_thinking (Fig. 7);
    tg vs tg_failing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(name: str, key: str) -> tuple[list[int], list[float]]:
        per = [_series(read_metrics(d), key) for d in dirs[name]]
        per = [p for p in per if p]
        if not per:
            return [], []
        n = min(len(p) for p in per)
        return list(range(1, n + 1)), [statistics.fmean(p[i] for p in per) for i in range(n)]

    def style_curve(name: str):
        cs = [curve(name, k) for k in STYLE_KEYS]
        n = min(len(c[0]) for c in cs)
        return list(range(1, n + 1)), [statistics.fmean(c[1][i] for c in cs) for i in range(n)]

    fig, axes = plt.subplots(2, 3, figsize=(16, 7.2))
    ax = axes.flat
    for name in ("grpo", "opsd", "tg"):
        ax[0].plot(*style_curve(name), label=name)
    ax[0].set_title("Table 1: style criteria (mean of 3)", fontsize=10)
    for name in ("tg", "opsd"):
        ax[1].plot(*curve(name, PASS), label=f"{name} pass")
        ax[1].plot(*curve(name, "criteria/brief_thinking"), ls="--", label=f"{name} brief_thinking")
    ax[1].set_title("Fig. 5: gated vs always-on feedback (opsd)", fontsize=10)
    for name, lam in LAMBDAS.items():
        ax[2].plot(*curve(name, "entropy/all"), label=f"λ={lam:g}")
        ax[3].plot(*curve(name, PASS), label=f"λ={lam:g}")
    ax[2].set_title("Fig. 6: entropy (all tokens)", fontsize=10)
    ax[3].set_title("Fig. 6: task pass rate", fontsize=10)
    for i, (c, k) in enumerate(zip(P.STYLE_CRITERIA, STYLE_KEYS)):
        ax[4].plot(*curve("tg", k), color=f"C{i}", label=f"tg {c}")
        ax[4].plot(*curve("no_thinking", k), color=f"C{i}", ls="--", label=f"no_thinking {c}")
    ax[4].set_title("Fig. 7: criteria with / without KL on thinking", fontsize=10)
    for name in ("tg", "tg_failing"):
        ax[5].plot(*style_curve(name), label=f"{name} style mean")
        ax[5].plot(*curve(name, PASS), ls="--", label=f"{name} pass")
    ax[5].set_title("expert told every criterion (tg) or the failed ones", fontsize=10)
    for a in ax:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------ the command
def run(a, py: str, log, base_overrides: Mapping[str, Any] | None = None) -> int:
    """The suite (``a``: the demo's parsed arguments: ``out``, ``jobs``, ``seeds`` (a tuple;
    None: the development seeds), ``steps``, ``recipe``). ``base_overrides``: the base
    model's build settings (tests build a tiny one)."""
    from megatron_tg.demo.runs import _write_atomic, convert, run_all

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from megatron_tg.demo.runs import RECIPE as MAIN_RECIPE

    # the demo's default recipe means "this suite's default"; any other is used as given
    recipe = RECIPE if Path(a.recipe).resolve() == MAIN_RECIPE.resolve() else Path(a.recipe).resolve()
    seeds = tuple(a.seeds) if a.seeds else tuple(SEEDS)
    p = plan(a.steps or STEPS)
    kind = C.seed_set(seeds, p.steps)
    prov = C.provenance()
    t0 = time.perf_counter()
    log(f"seeds {','.join(map(str, seeds))}, {p.steps} steps: {kind}")
    for line in C.provenance_lines(prov):
        log(line)
    log(f"paper base -> {out / 'base'}")
    base = PB.build(out / "base", seed=0, log=lambda s: log("  " + s), **dict(base_overrides or {}))
    log("paper base: " + ", ".join(f"{k} {base[k]:.3f}" for k in (
        "success_no_hint", "search_lines_no_hint", "answer_style_no_hint", "brief_thinking_no_hint",
        "search_lines_all_hints", "answer_style_all_hints", "brief_thinking_all_hints", "success_all_hints"))
        + (" (cached)" if base.get("cached") else ""))
    convert(out / "base", out / "base_megatron", py)
    specs = run_specs(seeds)
    inputs = {"base_build": base["build_hash"], "recipe_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest()}
    log(f"{len(specs)} RL runs of {p.steps} steps, {a.jobs} at a time (seeded, no staleness): "
        + ", ".join(s.name for s in specs))
    got = run_all(specs, out, p, py, recipe, a.jobs, inputs)
    dirs = {name: [got[f"{name}-s{s}"] for s in seeds] for name, _, _ in RUNS}
    m = {name: [measure(d) for d in ds] for name, ds in dirs.items()}
    c = claims(m)
    wall = time.perf_counter() - t0
    seconds = {s.name: json.loads((got[s.name] / "done.json").read_text())["seconds"] for s in specs}
    record = {"seeds": list(seeds), "steps": p.steps, "seed_set": kind, "provenance": prov,
              "claims": c}
    amended = None
    if kind.startswith("held-out"):
        first_path = out / "heldout_first.json"
        try:
            first = json.loads(first_path.read_text())
        except (OSError, ValueError):
            first = None
            _write_atomic(first_path, json.dumps(record, indent=2, default=float) + "\n")
        amended = C.amendment(first, prov)
    _write_atomic(out / "paper.json", json.dumps({
        **record, "last_steps_averaged": LAST, "wall_seconds": round(wall, 1),
        "bootstrap": {"resamples": C.BOOTSTRAP, "seed": C.BOOTSTRAP_SEED, "confidence": C.CONFIDENCE},
        "amended_after_heldout": amended, "run_seconds": seconds,
        "base": {k: v for k, v in base.items() if isinstance(v, (int, float, str))},
        "recipe": str(recipe), "measures": m}, indent=2, default=float) + "\n")
    png = plot(out / "paper.png", dirs)
    print()
    print(table(m))
    print()
    print(f"seeds {','.join(map(str, seeds))}, {p.steps} steps: {kind}; interval: "
          f"{C.CONFIDENCE:.0%} bootstrap over seeds ({C.BOOTSTRAP} resamples, seed {C.BOOTSTRAP_SEED})")
    for line in C.provenance_lines(prov):
        print(line)
    if amended:
        print(f"RULES CHANGED after the first held-out verdicts in {out}: {', '.join(amended['changed_after_heldout'])}"
              f" (first verdicts: {json.dumps(amended['first_verdicts'])})")
    for line in verdict_lines(c):
        print(line)
    print(f"\nwall {wall:.0f} s; {out / 'paper.json'}; plot {png}")
    return 0
