"""Every wait of a run that has a limit, in one place (``timeouts.*``).

Why one group: on a cluster the limits interact. A collective that waits for something slow
(rank 0's first batch of 50-turn rollouts, an engine that died mid-broadcast) dies at the
collective timeout, so each slow wait gets its own limit on a channel built for waiting (the
default store, an HTTP call) and the collectives keep a limit sized for collectives. The
limits of single generation and judge requests stay where they always were
(``rollout.request_timeout_s``, ``judge.timeout_s``); :func:`TimeoutsConfig.table` lists
them with these, and ``megatron-tg config --dry-run`` and ``megatron-tg plan`` print it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from megatron_tg.config.base import check_range
from megatron_tg.config.rollout import JudgeConfig, RolloutConfig


class RunLimits(Protocol):
    """What :meth:`TimeoutsConfig.rollout_wait` and :meth:`TimeoutsConfig.table` read of a
    run's config (a :class:`~megatron_tg.config.schema.TGConfig`, which holds this group:
    the schema imports this module, never the reverse)."""

    rollout: RolloutConfig
    judge: JudgeConfig


@dataclass
class TimeoutsConfig:
    """Limits of the trainer's collectives, the weight-update group, HTTP calls to the engines,
    health probes and the wait for rollouts (all in seconds)."""

    collective_s: float = 1800.0
    """Timeout of the trainer ranks' process groups: the default group (NCCL on GPUs, gloo on
    CPU) and megatron's model-parallel groups. Every collective must finish within it; no rank
    waits for rollouts inside one (see ``rollout_wait_s``)."""

    weight_sync_s: float = 300.0
    """Timeout of the trainer-engines weight-update group (NCCL or gloo): its rendezvous and
    each bucket's broadcast. An engine that dies mid-sync is noticed by its HTTP call failing,
    the broadcast then waits at most this long."""

    http_admin_s: float = 1800.0
    """Longest admin call to an engine (pause, a weight-update bucket, flush, weight checker)."""

    http_connect_s: float = 5.0
    """TCP connect limit of every HTTP call to an engine or router; a dead host fails this fast."""

    health_s: float = 5.0
    """Limit of one health probe (``GET /health``, ``/model_info`` while paused) of an engine."""

    health_interval_s: float = 5.0
    """Seconds between re-probes of an engine marked unhealthy (dead, or behind on weights)."""

    rollout_wait_s: Optional[float] = None
    """Longest the ranks other than rank 0 wait for rank 0's batch of a step, on the default
    store (not in a collective). None = derived from the rollout config: one rollout whose
    every turn runs to ``rollout.request_timeout_s``, then judged with every retry
    (``rollout.max_turns * rollout.request_timeout_s + (judge.max_retries + 1) * judge.timeout_s``)."""

    def validate(self) -> None:
        for name in ("collective_s", "weight_sync_s", "http_admin_s", "http_connect_s", "health_s",
                     "health_interval_s"):
            check_range(f"timeouts.{name}", getattr(self, name), gt=0)
        if self.rollout_wait_s is not None:
            check_range("timeouts.rollout_wait_s", self.rollout_wait_s, gt=0)

    def rollout_wait(self, cfg: RunLimits) -> float:
        """``rollout_wait_s``, derived from the rollout and judge config when None."""
        if self.rollout_wait_s is not None:
            return float(self.rollout_wait_s)
        r, j = cfg.rollout, cfg.judge
        return float(r.max_turns * r.request_timeout_s + (j.max_retries + 1) * j.timeout_s)

    def table(self, cfg: RunLimits) -> dict[str, float]:
        """Every limit of a run, resolved, by its config path (what the dry-runs print)."""
        out = {f"timeouts.{k}": float(getattr(self, k)) for k in
               ("collective_s", "weight_sync_s", "http_admin_s", "http_connect_s", "health_s",
                "health_interval_s")}
        out["timeouts.rollout_wait_s"] = self.rollout_wait(cfg)
        out["rollout.request_timeout_s"] = float(cfg.rollout.request_timeout_s)
        out["judge.timeout_s"] = float(cfg.judge.timeout_s)
        return out
