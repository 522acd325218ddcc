"""Entropy-spike guard: lower λ fast when gated-token entropy rises too fast, restore slowly.

Paper §5.4: a sharp rise of policy entropy is the early predictor of collapse under
self-distillation (the expert shares the weights, so entropy increase feeds on itself); a low
static λ avoids it. This controller is the "dynamic weighting" the paper leaves open. Off by
default.

Rule, once per optimizer step with h = mean entropy on gated tokens of that step:

* baseline b: EMA of h, b ← s·b + (1−s)·h (``smoothing`` s), initialised to the first h;
* rise = h − b (before updating b). If rise > ``rise_threshold``:
  λ ← max(λ · ``decay_factor``, ``min_coef``)  → event "lowered";
* else, if λ < λ₀ (the configured ``kl_coef``): λ ← λ + ``recover_rate`` · (λ₀ − λ), snapping
  to λ₀ within 1e-3 relative  → event "restored";
* a step without gated tokens (h is None/NaN) changes nothing.

The λ returned by :attr:`EntropyGuard.coef` applies to the *next* step's loss (the entropy
is only known after this step's forward), so the controller never sees its own decision's
effect in the same step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from megatron_tg.config.objective import EntropyGuardConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardEvent:
    """What the guard did on a step; log it."""

    step: int
    action: str
    """"lowered" or "restored"."""
    entropy: float
    baseline: float
    rise: float
    old_coef: float
    new_coef: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class EntropyGuard:
    def __init__(self, cfg: EntropyGuardConfig, base_coef: float) -> None:
        self.cfg = cfg
        self.base_coef = float(base_coef)
        self.coef = float(base_coef)
        self.baseline: Optional[float] = None
        self.step = 0

    def update(self, gated_entropy: Optional[float]) -> Optional[GuardEvent]:
        """Feed one step's gated-token entropy; returns an event when λ changed."""
        self.step += 1
        if not self.cfg.enabled or gated_entropy is None or math.isnan(gated_entropy):
            return None
        h = float(gated_entropy)
        if self.baseline is None:
            self.baseline = h
            return None
        baseline = self.baseline
        rise = h - baseline
        self.baseline = self.cfg.smoothing * baseline + (1.0 - self.cfg.smoothing) * h
        old = self.coef
        if rise > self.cfg.rise_threshold:
            self.coef = max(old * self.cfg.decay_factor, self.cfg.min_coef)
            action = "lowered"
        elif old < self.base_coef:
            new = old + self.cfg.recover_rate * (self.base_coef - old)
            if self.base_coef - new <= 1e-3 * self.base_coef:
                new = self.base_coef
            self.coef = new
            action = "restored"
        else:
            return None
        if self.coef == old:
            return None
        event = GuardEvent(self.step, action, h, baseline, rise, old, self.coef)
        log.info("entropy guard %s λ %.4g -> %.4g at step %d (gated entropy %.4f, baseline %.4f)",
                 action, old, self.coef, self.step, h, baseline)
        return event

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "baseline": self.baseline, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state["coef"])
        self.baseline = state["baseline"]
        self.step = int(state["step"])
