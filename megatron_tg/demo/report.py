"""The demo's numbers: per-run summaries from ``metrics.jsonl``, the Table-1-like table, the plot.

    python -m megatron_tg.demo.report RUN_DIR [RUN_DIR ...] [--baseline GRPO_RUN_DIR]

prints each run's per-step diagnosis table (:data:`STEP_COLUMNS`: task and format rates,
what went wrong, the KL and its diagnostics, entropy) and, with ``--baseline``, the stability
summary against that run (lowest task rate, lowest 3-step rolling mean, the rolling gap).

Definitions (the same for every run, whatever its method):

* criterion rate: ``demo/new_format`` — the fraction of a step's training rollouts whose
  search calls all pass ``lines=`` (at least one call). Stricter than the rubric's
  ``search_lines`` criterion, which passes vacuously when no search is made;
* pass rate: ``criteria/answer`` — the judge's primary (task) criterion;
* final values: mean ± std over the last ``last`` steps of a run (Table 1 of the paper
  reports final rates the same way);
* steps to 0.8: the first step whose criterion rate reaches 0.8 (None: never);
* collapsed: the pass rate fell below half its start (the mean of the first 3 steps) at
  some step — the prototype's failure mode (``lines= N`` loops, task success 0.015);
  recovered: collapsed, yet the final pass rate is back to at least 0.9 x its start;
* rolling: the mean over a window of 3 consecutive steps (``rolling_mean``); the stability
  target compares TG's rolling pass rate with GRPO's on the same seed, step by step
  (``rolling_gap``: the lowest difference). ``pass_rate_start`` / ``pass_rate_min`` are the
  unsmoothed start (first 3 steps) and lowest step;
* held-out (``evaluation.num_tasks`` episodes of the ``eval`` split, never trained on, at
  step 0 and the last step): the same criterion rate (``eval/demo/new_format``) and pass rate
  (``eval/criteria/answer``) on the current weights, with 95% Wilson intervals. Training-batch
  rates are on prompts each trained on once, generated one step behind the weights.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from megatron_tg.judge.intervals import wilson_interval
from megatron_tg.train.metrics import read_metrics

CRITERION = "demo/new_format"
PASS = "criteria/answer"
HELD_OUT_CRITERION = "eval/demo/new_format"
HELD_OUT_PASS = "eval/criteria/answer"
THRESHOLD = 0.8


def series(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.pstdev(xs) if len(xs) > 1 else 0.0)


def summarize_run(run_dir: str | Path, last: int) -> dict[str, Any]:
    rows = read_metrics(run_dir)
    crit, passed = series(rows, CRITERION), series(rows, PASS)
    if not crit or not passed:
        raise ValueError(f"{run_dir}: metrics.jsonl has no {CRITERION!r}/{PASS!r} rows "
                         "(did the run fail? see its stdout.log)")
    c, cs = _mean_std(crit[-last:])
    p, ps = _mean_std(passed[-last:])
    start = statistics.fmean(passed[:3])
    hit = next((r["step"] for r in rows if r.get(CRITERION, 0.0) >= THRESHOLD), None)
    out = {"criterion_rate": c, "criterion_rate_std": cs, "pass_rate": p, "pass_rate_std": ps,
           "steps": sum(1 for r in rows if r["step"] >= 1), "steps_to_0.8": hit,
           "collapsed": bool(min(passed) < 0.5 * start),
           "recovered": bool(min(passed) < 0.5 * start and p >= 0.9 * start),
           "pass_rate_start": start,
           "pass_rate_min": min(passed)}
    for key, name in (("kl/mean_gated", "kl_gated"), ("entropy/all", "entropy"),
                      ("kl/rescue_mass", "kl_rescue_mass"), ("kl/grad_norm_reverse", "kl_grad_norm_reverse"),
                      ("kl/grad_norm_forward", "kl_grad_norm_forward"),
                      ("probe/new_format", "expert_probe_criterion_rate"),
                      ("probe/success", "expert_probe_pass_rate")):
        xs = series(rows, key)
        if xs:
            out[f"final_{name}"] = statistics.fmean(xs[-last:]) if name.startswith("kl") or \
                name == "entropy" else xs[-1]
            if name.startswith("expert_probe"):
                out[f"min_{name}"] = min(xs)
    out.update(held_out(rows))
    times = series(rows, "time/step")
    out["seconds_per_step"] = statistics.fmean(times) if times else math.nan
    return out


def rolling_mean(xs: Sequence[float], window: int = 3) -> list[float]:
    """Means of every ``window`` consecutive values (len(xs) − window + 1 of them)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return [statistics.fmean(xs[i:i + window]) for i in range(len(xs) - window + 1)]


def _pass_by_step(run_dir: str | Path) -> dict[int, float]:
    return {int(r["step"]): float(r[PASS]) for r in read_metrics(run_dir)
            if r.get("step", 0) >= 1 and isinstance(r.get(PASS), (int, float)) and r[PASS] == r[PASS]}


def rolling_min(run_dir: str | Path, window: int = 3) -> float:
    """The lowest ``window``-step rolling mean of a run's pass rate (NaN: too few steps)."""
    xs = rolling_mean([v for _, v in sorted(_pass_by_step(run_dir).items())], window)
    return min(xs) if xs else math.nan


def rolling_gap(run_dir: str | Path, baseline_dir: str | Path, window: int = 3) -> float:
    """min over steps of (run's rolling pass rate − baseline's), on the steps both logged;
    NaN when they share fewer than ``window`` steps."""
    a, b = _pass_by_step(run_dir), _pass_by_step(baseline_dir)
    steps = sorted(set(a) & set(b))
    diffs = [x - y for x, y in zip(rolling_mean([a[s] for s in steps], window),
                                   rolling_mean([b[s] for s in steps], window))]
    return min(diffs) if diffs else math.nan


def held_out(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """First (step 0) and last held-out evaluation: rates and 95% intervals; {} if none."""
    evals = [r for r in rows if isinstance(r.get("eval/n"), (int, float))]
    if not evals:
        return {}
    out: dict[str, Any] = {"heldout_episodes": int(evals[-1]["eval/n"]),
                           "heldout_steps": [r["step"] for r in evals]}
    for when, r in (("start", evals[0]), ("final", evals[-1])):
        n = int(r["eval/n"])
        crit = r.get(HELD_OUT_CRITERION, math.nan)
        out[f"heldout_criterion_rate_{when}"] = crit
        # eval/demo/* are per-episode fractions: their interval from the episode count
        out[f"heldout_criterion_ci_{when}"] = list(wilson_interval(round(crit * n), n)) \
            if crit == crit else None
        out[f"heldout_pass_rate_{when}"] = r.get(HELD_OUT_PASS, math.nan)
        out[f"heldout_pass_ci_{when}"] = [r.get(HELD_OUT_PASS + "_lo"), r.get(HELD_OUT_PASS + "_hi")]
    return out


def aggregate(per_seed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Across seeds: means ± std of the final rates, and the per-seed lists."""
    crit = [r["criterion_rate"] for r in per_seed]
    pas = [r["pass_rate"] for r in per_seed]
    c, cs = _mean_std(crit)
    p, ps = _mean_std(pas)
    return {"seeds": len(per_seed), "criterion_rate": c, "criterion_rate_std": cs,
            "pass_rate": p, "pass_rate_std": ps, "criterion_rate_per_seed": crit,
            "pass_rate_per_seed": pas,
            "steps_to_0.8": [r["steps_to_0.8"] for r in per_seed],
            "collapsed": [r["collapsed"] for r in per_seed],
            "collapsed_runs": sum(bool(r["collapsed"]) for r in per_seed),
            "recovered_runs": sum(bool(r["recovered"]) for r in per_seed),
            "expert_probe_final": [r.get("final_expert_probe_criterion_rate") for r in per_seed],
            "expert_probe_min": [r.get("min_expert_probe_criterion_rate") for r in per_seed]}


def _pm(m: float, s: float) -> str:
    return f"{m:.3f} ± {s:.3f}" if m == m else "n/a"


def _probe(xs) -> str:
    xs = [x for x in xs if x is not None]
    return ",".join(f"{x:.2f}" for x in xs) if xs else "-"


def methods_table(methods: Mapping[str, Mapping[str, Any]], last: int) -> str:
    lines = [f"Final rates (mean ± std over the last {last} steps; base = SFT model before RL)",
             f"{'method':<8} {'new format (criterion)':>24} {'task (pass)':>16} {'base criterion':>15}"
             f" {'steps to 0.8':>13} {'collapsed':>10} {'rolling3 pass min':>18}",]
    for name, m in methods.items():
        lines.append(f"{name:<8} {_pm(m['criterion_rate'], m['criterion_rate_std']):>24} "
                     f"{_pm(m['pass_rate'], m['pass_rate_std']):>16} "
                     f"{m['base_criterion_rate']:>15.3f} {str(m['steps_to_0.8']):>13} "
                     f"{str(m['collapsed']):>10} {m.get('rolling_pass_min', math.nan):>18.3f}")
    held = {k: m for k, m in methods.items() if "heldout_episodes" in m}
    if held:
        n = next(iter(held.values()))["heldout_episodes"]
        lines += ["", f"Held-out ({n} episodes never trained on; step 0 -> last step [95% interval "
                      "at the last step])",
                  f"{'method':<8} {'new format (criterion)':>30} {'task (pass)':>30}"]
        for name, m in held.items():
            lines.append(f"{name:<8} {_held(m, 'criterion'):>30} {_held(m, 'pass'):>30}")
    return "\n".join(lines)


def _held(m: Mapping[str, Any], what: str) -> str:
    rate = "criterion_rate" if what == "criterion" else "pass_rate"
    ci = m.get(f"heldout_{what}_ci_final") or [None, None]
    a, b = m.get(f"heldout_{rate}_start", math.nan), m.get(f"heldout_{rate}_final", math.nan)
    band = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if None not in ci else ""
    return f"{a:.3f} -> {b:.3f}{band}"


def directions_table(variants: Mapping[str, Mapping[str, Any]]) -> str:
    lines = ["KL direction / expert comparison (final rates: mean ± std across seeds; "
             "expert probe: the expert's own new-format rate with the hint, lowest per seed)",
             f"{'variant':<16} {'seeds':>5} {'new format':>16} {'task':>16} {'steps to 0.8':>18}"
             f" {'collapsed':>9} {'recovered':>9} {'expert probe min':>17} {'rolling3 pass min':>18}"]
    for name, v in variants.items():
        steps = ",".join("-" if s is None else str(s) for s in v["steps_to_0.8"])
        lines.append(f"{name:<16} {v['seeds']:>5} {_pm(v['criterion_rate'], v['criterion_rate_std']):>16} "
                     f"{_pm(v['pass_rate'], v['pass_rate_std']):>16} {steps:>18} "
                     f"{v['collapsed_runs']:>7}/{v['seeds']} {v['recovered_runs']:>7}/{v['seeds']} "
                     f"{_probe(v['expert_probe_min']):>17} {_probe(v.get('rolling_pass_min', [])):>18}")
    return "\n".join(lines)


def plot(out: str | Path, method_runs: Mapping[str, str | Path],
         variant_runs: Mapping[str, Sequence[str | Path]] | None = None) -> Path:
    """Top row: the methods' criterion rate, pass rate and gated KL per step (the paper's
    Figure 3), and (with ``objective.kl_diagnostics``) both KL directions' logit-gradient norms
    on the gated tokens; bottom row (if given): each KL-direction variant's seed-mean
    criterion and pass rates, the expert probe and the rescue mass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_n = 2 if variant_runs else 1
    fig, axes = plt.subplots(rows_n, 4, figsize=(17, 3.4 * rows_n), squeeze=False)

    def line(ax, rows, key, **kw):
        pts = [(r["step"], float(r[key])) for r in rows
               if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], **kw)

    for i, (name, d) in enumerate(method_runs.items()):
        rows = read_metrics(d)
        for ax, key in zip(axes[0], (CRITERION, PASS, "kl/mean_gated")):
            line(ax, rows, key, label=name)
        line(axes[0][3], rows, "kl/grad_norm_forward", color=f"C{i}", label=f"{name} forward")
        line(axes[0][3], rows, "kl/grad_norm_reverse", color=f"C{i}", ls="--", label=f"{name} reverse")
    for ax, title in zip(axes[0], ("new tool format (criterion)", "task success (pass)",
                                   "KL on gated tokens", "|dKL/d logits|, gated tokens")):
        ax.set_title(title, fontsize=10)
    if variant_runs:
        for name, dirs in variant_runs.items():
            runs = [read_metrics(d) for d in dirs]
            for ax, key in zip(axes[1], (CRITERION, PASS, "probe/new_format", "kl/rescue_mass")):
                per = [series(r, key) for r in runs]
                per = [p for p in per if p]
                if not per:
                    continue
                n = min(len(p) for p in per)
                steps = [r["step"] for r in runs[0] if key in r][:n]
                ax.plot(steps, [statistics.fmean(p[i] for p in per) for i in range(n)], label=name)
        for ax, title in zip(axes[1], ("new format, seed mean", "task success, seed mean",
                                       "expert probe: new format with hint",
                                       "rescue mass (expert on p_student < 1e-4)")):
            ax.set_title(title, fontsize=10)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


STEP_COLUMNS = (
    ("task", PASS), ("new_fmt", CRITERION), ("fmt_crit", "criteria/search_lines"),
    ("malformed", "demo/malformed"), ("tool_err", "demo/tool_error"), ("no_answer", "demo/no_answer"),
    ("turns", "demo/turns"), ("gated", "kl/frac_gated"), ("kl_tok", "kl/token_mean"),
    ("rescue", "kl/rescue_mass"), ("g_rev", "kl/grad_norm_reverse"), ("g_fwd", "kl/grad_norm_forward"),
    ("entropy", "entropy/all"), ("reward", "reward/mean"), ("resp_tok", "rollout/response_tokens"))
"""(header, metric) of the per-step table: ``-`` where a step did not log the metric (e.g.
the KL columns on a step where nothing was gated)."""


def step_table(run_dir: str | Path) -> str:
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) >= 1]
    lines = [f"{'step':>4} " + " ".join(f"{h:>9}" for h, _ in STEP_COLUMNS)]
    for r in rows:
        cells = [f"{float(r[k]):>9.3f}" if isinstance(r.get(k), (int, float)) and r[k] == r[k]
                 else f"{'-':>9}" for _, k in STEP_COLUMNS]
        lines.append(f"{r['step']:>4} " + " ".join(cells))
    return "\n".join(lines)


def stability_line(run_dir: str | Path, baseline_dir: str | Path, window: int = 3) -> str:
    passed = list(_pass_by_step(run_dir).values())
    return (f"task min {min(passed):.3f}, rolling{window} min {rolling_min(run_dir, window):.3f}, "
            f"rolling{window} gap to baseline {rolling_gap(run_dir, baseline_dir, window):+.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m megatron_tg.demo.report",
                                 description="Per-step diagnosis tables of demo runs.")
    ap.add_argument("runs", nargs="+", help="run directories (holding metrics.jsonl)")
    ap.add_argument("--baseline", help="a GRPO run of the same seed: print the stability summary")
    a = ap.parse_args(argv)
    for d in a.runs:
        print(f"{d}")
        print(step_table(d))
        if a.baseline:
            print(stability_line(d, a.baseline))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
