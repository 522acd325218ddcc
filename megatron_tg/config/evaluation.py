"""Held-out evaluation: tasks the policy never trains on, rolled out on the current weights."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tg.config.base import ConfigError, check_range


@dataclass
class EvaluationConfig:
    """At step 0, every ``every`` steps and after the last step, ``samples`` rollouts of each
    held-out task on the engines' current weights, judged by the run's rubric; never trained
    on. Logged as ``eval/*``: pass@1 and every criterion's rate with confidence intervals.
    Rank 0 evaluates while the other trainer ranks wait for the next step's batch on the
    store, so one evaluation plus that batch must finish within ``timeouts.rollout_wait_s``."""

    tasks: str = ""
    """JSONL of held-out tasks, in the format of ``rollout.tasks`` (the coding harness). Empty:
    no held-out evaluation, unless the entry point brings its own held-out split (the demo's
    ``eval`` split of its task generator)."""

    num_tasks: int = 0
    """Evaluate on the first ``num_tasks`` held-out tasks (0: all of them). For generated
    splits (the demo) it is the split's size."""

    every: int = 0
    """Evaluate every ``every`` optimizer steps, plus step 0 (the baseline) and the last step;
    0: step 0 and the last step only."""

    samples: int = 1
    """Rollouts per held-out task. pass@1 is the mean over all of them."""

    confidence: float = 0.95
    """Coverage of the Wilson score intervals logged beside each rate (``_lo`` / ``_hi``)."""

    temperature: float = 1.0
    """Sampling temperature of the held-out rollouts (0: greedy)."""

    def enabled(self) -> bool:
        return bool(self.tasks) or self.num_tasks > 0

    def validate(self) -> None:
        check_range("evaluation.num_tasks", self.num_tasks, ge=0)
        check_range("evaluation.every", self.every, ge=0)
        check_range("evaluation.samples", self.samples, ge=1)
        check_range("evaluation.confidence", self.confidence, gt=0, lt=1)
        check_range("evaluation.temperature", self.temperature, ge=0)
        if not isinstance(self.tasks, str):
            raise ConfigError(f"evaluation.tasks: must be a path string; got {self.tasks!r}")
