"""The paper suite: Table 1 and Figures 5-7 at toy scale, on :mod:`.paper_env`.

    python -m megatron_tg.demo --suite paper --out runs/paper [--seeds 3] [--jobs 2]

One base model (:mod:`.paper_base`: thinks before it acts, never meets the three style
criteria without their feedback), then the RL runs of :func:`plan` (25 steps, seeded sampling, no
staleness, ``recipes/demo_paper_cpu.yaml``, ``--env paper``) on every seed:

============  ==================================  ============================================
run           what                                 used by
============  ==================================  ============================================
grpo          GRPO alone (all four rewards)        Table 1
opsd          KL on every turn, task reward only   Table 1
tg            failure-gated KL, λ = 1              Table 1, Figures 5-7 (the reference)
always_on     KL on every turn, all rewards        Figure 5
lambda_0.1    tg with λ = 0.1                      Figure 6
lambda_10     tg with λ = 10                       Figure 6
no_thinking   tg without KL on thinking tokens     Figure 7
tg_failing    tg, the expert told only the failed  the expert's feedback (the recipe's tg
              criteria (the paper's f_t)           tells it every criterion of the turn)
============  ==================================  ============================================

Each claim is checked by a rule fixed here, before any run (:func:`claims`); the command
prints each as ``reproduced`` or ``NOT reproduced`` with the numbers, writes
``OUT/paper.json`` and ``OUT/paper.png``, and exits 0 either way (1: a run failed).

* **Table 1**: final rates (mean of the last :data:`LAST` steps, then over seeds) of the three
  style criteria; reproduced when GRPO < OPSD < TG on their mean and TG's pass rate is at
  least GRPO's − 0.05. "OPSD less consistent" is reported as the seed spread of the two.
* **Figure 5**: on the every-turn criterion (``brief_thinking``), feedback on every turn
  (``always_on``) against failure-gated (``tg``): reproduced when always-on's final pass rate is
  more than 0.05 below TG's.
* **Figure 6**: per λ, the entropy spike (largest ``entropy/all`` over the first step's), the
  response-length spike (same, ``rollout/response_tokens``) and collapse (a 3-step rolling pass
  rate below half the first 3 steps'); reproduced when λ = 10 collapses after a spike
  (entropy ≥ 2x) on at least 2 of the seeds and λ = 0.1 collapses on none.
* **Figure 7**: oscillation = the number of *reversals*: a style criterion's rate falling by
  more than :data:`REVERSAL_DROP` from one :data:`WINDOW`-step window to the next
  (non-overlapping windows, summed over the three criteria); reproduced when the runs without
  KL on thinking reverse more often, summed over seeds, than TG.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from megatron_tg.demo import paper_base as PB
from megatron_tg.demo import paper_env as P
from megatron_tg.demo import report as R
from megatron_tg.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "demo_paper_cpu.yaml"
STEPS, LAST, SEEDS = 25, 5, 3
WINDOW, REVERSAL_DROP = 3, 0.2
LAMBDAS = {"lambda_0.1": 0.1, "tg": 1.0, "lambda_10": 10.0}
"""Figure 6's λ sweep: run name -> λ (the recipe's λ = 1 is the ``tg`` run)."""
RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("grpo", "grpo", ()), ("opsd", "opsd", ()), ("tg", "tg", ()),
    ("always_on", "always_on", ()), ("no_thinking", "no_thinking", ()),
    ("lambda_0.1", "tg", ("objective.kl_coef=0.1",)), ("lambda_10", "tg", ("objective.kl_coef=10.0",)),
    ("tg_failing", "tg", ("objective.expert_feedback=failing",)))
"""(run, objective.mode, extra overrides), in the order each seed makes them."""
STYLE_KEYS = tuple(f"criteria/{c}" for c in P.STYLE_CRITERIA)
PASS = "criteria/answer"


def plan(steps: int = STEPS):
    from megatron_tg.demo.__main__ import Plan

    return Plan(steps=steps, seeds=tuple(range(SEEDS)), last=LAST, variants=(), probe_every=0,
                heldout=0, seeded=True, rl_args=("--env", "paper"))


def run_specs(seeds: Sequence[int]):
    from megatron_tg.demo.__main__ import RunSpec

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


def spike(rows, key: str) -> float:
    """Largest value of ``key`` over its first step's."""
    xs = _series(rows, key)
    return max(xs) / xs[0] if xs and xs[0] > 0 else math.nan


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
    col = collapse_step(rows)
    peak = (1 + max(range(len(ent)), key=ent.__getitem__)) if ent else None
    return {"pass": final(rows, PASS), "style": style,
            "style_mean": statistics.fmean(style.values()),
            "all_criteria": final(rows, "demo/all_criteria"),
            "reversals": {c: reversals(_series(rows, k)) for c, k in zip(P.STYLE_CRITERIA, STYLE_KEYS)},
            "entropy_spike": spike(rows, "entropy/all"),
            "length_spike": spike(rows, "rollout/response_tokens"),
            "entropy_peak_step": peak, "collapse_step": col,
            "rolling_pass_min": R.rolling_min(run_dir), "steps": len(_series(rows, PASS))}


def _agg(xs: Sequence[float]) -> tuple[float, float]:
    xs = [x for x in xs if x == x]
    return (statistics.fmean(xs), statistics.pstdev(xs) if len(xs) > 1 else 0.0) if xs else (math.nan, math.nan)


def claims(m: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The four claims by the rules of the module docstring; ``m``: run name -> per-seed measures."""
    def mean(name: str, key: str) -> float:
        return _agg([x[key] for x in m[name]])[0]

    g, o, t = (mean(n, "style_mean") for n in ("grpo", "opsd", "tg"))
    tg_pass, grpo_pass = mean("tg", "pass"), mean("grpo", "pass")
    out = {"table1": {"rule": "grpo < opsd < tg on the style criteria' mean final rate; tg pass >= grpo pass - 0.05",
                      "measured": {"grpo": g, "opsd": o, "tg": t, "tg_pass": tg_pass, "grpo_pass": grpo_pass,
                                   "opsd_seed_std": _agg([x["style_mean"] for x in m["opsd"]])[1],
                                   "tg_seed_std": _agg([x["style_mean"] for x in m["tg"]])[1]},
                      "reproduced": bool(g < o < t and tg_pass >= grpo_pass - 0.05)}}
    a_pass = mean("always_on", "pass")
    out["fig5"] = {"rule": "always_on final pass rate < tg's - 0.05",
                   "measured": {"always_on_pass": a_pass, "tg_pass": tg_pass,
                                "always_on_brief": _agg([x["style"]["brief_thinking"] for x in m["always_on"]])[0],
                                "tg_brief": _agg([x["style"]["brief_thinking"] for x in m["tg"]])[0]},
                   "reproduced": bool(a_pass < tg_pass - 0.05)}

    def spiked_collapse(x) -> bool:
        return (x["collapse_step"] is not None and x["entropy_spike"] >= 2.0
                and x["entropy_peak_step"] is not None and x["entropy_peak_step"] <= x["collapse_step"])

    hi = sum(spiked_collapse(x) for x in m["lambda_10"])
    lo = sum(x["collapse_step"] is not None for x in m["lambda_0.1"])
    out["fig6"] = {"rule": "lambda 10: entropy spike (>= 2x) then collapse on >= 2 seeds; lambda 0.1: no collapse",
                   "measured": {name: {"entropy_spike": [x["entropy_spike"] for x in m[name]],
                                       "length_spike": [x["length_spike"] for x in m[name]],
                                       "collapse_step": [x["collapse_step"] for x in m[name]],
                                       "pass": mean(name, "pass")} for name in LAMBDAS},
                   "reproduced": bool(hi >= min(2, len(m["lambda_10"])) and lo == 0)}
    rev = {n: sum(sum(x["reversals"].values()) for x in m[n]) for n in ("tg", "no_thinking")}
    out["fig7"] = {"rule": f"reversals (a style criterion's rate falling > {REVERSAL_DROP} between "
                           f"{WINDOW}-step windows), summed over seeds: no_thinking > tg",
                   "measured": {**rev, "no_thinking_style": mean("no_thinking", "style_mean"),
                                "tg_style": t},
                   "reproduced": bool(rev["no_thinking"] > rev["tg"])}
    fail_rev = sum(sum(x["reversals"].values()) for x in m["tg_failing"])
    out["feedback"] = {"rule": "not a paper claim: the expert told only the failed criteria "
                               "(tg_failing) reverses more often than told all (tg)",
                       "measured": {"tg": rev["tg"], "tg_failing": fail_rev,
                                    "tg_failing_style": mean("tg_failing", "style_mean"), "tg_style": t},
                       "reproduced": bool(fail_rev > rev["tg"])}
    return out


# ------------------------------------------------------------------------------ printing
def table(m: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    head = (f"{'run':<12} {'seeds':>5} " + " ".join(f"{c:>15}" for c in P.STYLE_CRITERIA)
            + f" {'all style+task':>15} {'task (pass)':>15} {'reversals':>10} {'entropy x':>10} {'collapse at':>12}")
    lines = [head]
    for name, xs in m.items():
        def pm(vals):
            mu, sd = _agg(vals)
            return f"{mu:.3f} ± {sd:.3f}"
        cells = [pm([x["style"][c] for x in xs]) for c in P.STYLE_CRITERIA]
        rev = ",".join(str(sum(x["reversals"].values())) for x in xs)
        ent = ",".join(f"{x['entropy_spike']:.1f}" for x in xs)
        col = ",".join("-" if x["collapse_step"] is None else str(x["collapse_step"]) for x in xs)
        lines.append(f"{name:<12} {len(xs):>5} " + " ".join(f"{c:>15}" for c in cells)
                     + f" {pm([x['all_criteria'] for x in xs]):>15} {pm([x['pass'] for x in xs]):>15}"
                     f" {rev:>10} {ent:>10} {col:>12}")
    return "\n".join(lines)


def plot(out: Path, dirs: Mapping[str, Sequence[Path]]) -> Path:
    """Seed-mean curves: style-criteria mean per method (Table 1); pass rate, tg vs always-on
    (Fig. 5); entropy and pass rate per λ (Fig. 6); each criterion, tg vs no_thinking (Fig. 7);
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
    for name in ("tg", "always_on"):
        ax[1].plot(*curve(name, PASS), label=f"{name} pass")
        ax[1].plot(*curve(name, "criteria/brief_thinking"), ls="--", label=f"{name} brief_thinking")
    ax[1].set_title("Fig. 5: gated vs always-on feedback", fontsize=10)
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
def run(a, py: str, log) -> int:
    """The suite (``a``: the demo's parsed arguments: ``out``, ``jobs``, ``seeds``, ``steps``, ``recipe``)."""
    from megatron_tg.demo.__main__ import _write_atomic, convert, run_all

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from megatron_tg.demo.__main__ import RECIPE as MAIN_RECIPE

    # the demo's default recipe means "this suite's default"; any other is used as given
    recipe = RECIPE if Path(a.recipe).resolve() == MAIN_RECIPE.resolve() else Path(a.recipe).resolve()
    seeds = tuple(range(a.seeds if a.seeds else SEEDS))
    p = plan(a.steps or STEPS)
    t0 = time.perf_counter()
    log(f"paper base -> {out / 'base'}")
    base = PB.build(out / "base", seed=0, log=lambda s: log("  " + s))
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
    _write_atomic(out / "paper.json", json.dumps({
        "steps": p.steps, "seeds": list(seeds), "last_steps_averaged": LAST, "wall_seconds": round(wall, 1),
        "run_seconds": seconds, "base": {k: v for k, v in base.items() if isinstance(v, (int, float, str))},
        "measures": m, "claims": c}, indent=2) + "\n")
    png = plot(out / "paper.png", dirs)
    print()
    print(table(m))
    print()
    for k, v in c.items():
        print(f"claim {k:<7} {'reproduced    ' if v['reproduced'] else 'NOT reproduced'}  {v['rule']}")
        print(f"        measured {json.dumps(v['measured'], default=float)}")
    print(f"\nwall {wall:.0f} s; {out / 'paper.json'}; plot {png}")
    return 0
