"""Per-step metrics to JSONL (always), TensorBoard and W&B (when configured), and a progress bar.

Only global rank 0 writes. The JSONL file (``RUN_DIR/metrics.jsonl``, one object per step
with ``step`` and ``time``) is appended and flushed every step, so a killed run keeps every
step it finished; on resume, lines of steps past the checkpoint are dropped first so the
curve has no duplicated steps.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, cfg, run_dir: str | Path, *, enabled: bool, total_steps: int,
                 start_step: int = 0) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = self._wandb = self._bar = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        self._file = open(self.path, "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError("logging.wandb_project is set but wandb is not installed "
                                   "(pip install wandb)") from exc
            self._wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), resume="allow")
        if cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                s = json.loads(line).get("step", 0)
                # A restart from scratch redoes the step-0 baselines (held-out evaluation): drop
                # the old ones too, so no step appears twice.
                if s <= step and (step > 0 or s < 0):
                    keep.append(line)
            except ValueError:
                continue  # a line cut by a kill mid-write
        self.path.write_text("".join(k + "\n" for k in keep))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(),
               **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, allow_nan=True) + "\n")
        self._file.flush()
        numeric = {k: v for k, v in row.items() if isinstance(v, float) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._bar is not None:
            shown = {k.split("/")[-1]: f"{numeric[k]:.3g}" for k in
                     ("loss", "criteria/primary", "kl/mean_gated", "entropy/all") if k in numeric}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (skipping a last line cut by a kill)."""
    rows = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
