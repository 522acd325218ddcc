"""Curves of one or more runs side by side, like the paper's figures (criterion rates, pass
rate, entropy, KL), from each run's ``metrics.jsonl``.

    megatron-tg plot RUN_DIR [RUN_DIR ...] --out curves.png [--labels a b ...]
    (or: python tools/plot_run.py ...)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from megatron_tg.train.metrics import read_metrics

PANELS = [
    ("criteria/", "criterion pass rates"),
    ("criteria/primary", "primary (task) pass rate"),
    ("entropy/all", "token entropy (all assistant tokens)"),
    ("kl/mean_gated", "KL on gated tokens"),
]
# Drawn when a run has held-out evaluation rows (evaluation.*): the rates at the evaluated
# steps, each with its confidence interval as a band (the ``_lo`` / ``_hi`` metrics).
EVAL_PANELS = [
    ("eval/pass@1", "held-out pass@1"),
    ("eval/criteria/", "held-out criterion rates"),
]
_BOUNDS = ("_lo", "_hi")


def _series(rows, key):
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and v == v:  # skip missing and NaN
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _smoothed(ys: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    if window <= 1:
        return list(ys)
    return [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1])
            for i in range(len(ys))]


def curves(run_dirs: Sequence[str | Path], labels: Sequence[str] | None = None,
           smooth: int = 1) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """What :func:`plot_runs` draws: panel title -> line name -> (steps, values)."""
    labels = list(labels or [Path(d).name for d in run_dirs])
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [read_metrics(d) for d in run_dirs]
    out: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for key, title in panels(runs):
        panel = out.setdefault(title, {})
        for rows, label in zip(runs, labels):
            if key.endswith("/"):  # a family of metrics, one line each (not the primary rate)
                keys = sorted({k for r in rows for k in r if k.startswith(key)
                               and k != "criteria/primary" and not k.endswith(_BOUNDS)})
            else:
                keys = [key]
            for k in keys:
                xs, ys = _series(rows, k)
                name = label if len(keys) == 1 else f"{label}: {k.split('/', 1)[1]}"
                panel[name] = (xs, _smoothed(ys, smooth))
    return out


def panels(runs: Sequence[Sequence[dict]]) -> list[tuple[str, str]]:
    held_out = any(k.startswith("eval/") for rows in runs for r in rows for k in r)
    return PANELS + (EVAL_PANELS if held_out else [])


def bands(run_dirs: Sequence[str | Path], labels: Sequence[str] | None = None
          ) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """Confidence bands of the held-out lines: line name (as in :func:`curves`) -> (steps, lo, hi)."""
    labels = list(labels or [Path(d).name for d in run_dirs])
    out = {}
    for d, label in zip(run_dirs, labels):
        rows = read_metrics(d)
        for key, _ in EVAL_PANELS:
            keys = [key] if not key.endswith("/") else sorted(
                {k for r in rows for k in r if k.startswith(key) and not k.endswith(_BOUNDS)})
            for k in keys:
                xs, lo = _series(rows, k + "_lo")
                _, hi = _series(rows, k + "_hi")
                if xs and len(lo) == len(hi):
                    out[label if len(keys) == 1 else f"{label}: {k.split('/', 1)[1]}"] = (xs, lo, hi)
    return out


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None,
              smooth: int = 1) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on training machines
    import matplotlib.pyplot as plt

    data = curves(run_dirs, labels, smooth)
    band = bands(run_dirs, labels)
    held_out = {t for _, t in EVAL_PANELS}
    fig, axes = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.4))
    for ax, (title, lines) in zip(axes, data.items()):
        for name, (xs, ys) in lines.items():
            (line,) = ax.plot(xs, ys, label=name, marker="o" if title in held_out else None)
            if title in held_out and name in band:
                bx, lo, hi = band[name]
                ax.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="megatron-tg plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--labels", nargs="*", help="one label per run (default: directory names)")
    ap.add_argument("--smooth", type=int, default=1, help="moving-average window in steps")


def run(args: argparse.Namespace) -> int:
    print(plot_runs(args.runs, args.out, args.labels, args.smooth))
    return 0
