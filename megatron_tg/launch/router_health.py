"""The sglang-router's health-check flags, derived from the recipe so that a weight-sync pause
never takes the engines out of the router.

sglang-router 0.3.2 (the version ``pyproject.toml`` pins and ``tests/rollout/test_router.py``
runs) checks each worker with ``GET /health`` every ``--health-check-interval-secs`` (60),
gives a check ``--health-check-timeout-secs`` (5), and marks a worker unhealthy after
``--health-failure-threshold`` (3) failures in a row; it routes nothing to an unhealthy
worker until ``--health-success-threshold`` (2) checks pass again. SGLang's ``/health``
generates one token, so a paused engine answers it 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT``
(20 s) without scheduler progress: with the defaults a pause of about 3 minutes (a first sync
with its coverage check) takes every worker out, and each rollout then fails at the router.

The flags below make a check wait for the engine's own verdict (its 20 s plus
``timeouts.health_s``), and count enough failures in a row to outlast the longest pause the
plan allows: every push of a sync given ``timeouts.weight_sync_s`` (the weight-update group's
limit), two pushes at the first sync when ``rollout.sync_verify_coverage`` is on. A worker
that really died is still dropped, after that pause plus a few intervals; the router's retries
and the trainer's client cover the requests in between, and the trainer removes an engine it
found lost from the router at once (:mod:`megatron_tg.weight_sync.engine_loss`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from megatron_tg.config.schema import TGConfig

ROUTER_VERSION = "0.3.2"
"""The sglang-router release whose flags and health rules this module follows (pinned in
``pyproject.toml``'s gpu and test extras)."""
SGLANG_HEALTH_CHECK_TIMEOUT_S = 20
"""SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT`` default: a paused engine answers /health 503 after it."""
ROUTER_DEFAULTS = {"--health-check-interval-secs": 60, "--health-check-timeout-secs": 5,
                   "--health-failure-threshold": 3}
"""sglang-router 0.3.2's own defaults (its ``RouterArgs``), what a router started without
these flags uses."""


@dataclass(frozen=True)
class RouterHealth:
    interval_s: int
    timeout_s: int
    failure_threshold: int
    pause_s: float
    """The longest weight-sync pause the plan allows, which the flags must outlast."""
    disabled: bool = False
    """No health checks at all (``--disable-health-check``): colocated engines are released for
    a whole train phase, during which SGLang's /health (it generates a token) must not reach
    them, and no threshold outlasts a phase of hours without hiding a dead worker for as long."""

    def flags(self) -> list[str]:
        return ["--health-check-interval-secs", str(self.interval_s),
                "--health-check-timeout-secs", str(self.timeout_s),
                "--health-failure-threshold", str(self.failure_threshold),
                *(["--disable-health-check"] if self.disabled else [])]


def failing_checks(pause_s: float, interval_s: float, timeout_s: float) -> int:
    """Most checks in a row a pause of ``pause_s`` can fail: every check that starts within
    ``timeout_s`` before the pause (it is still waiting when the pause begins) or during it."""
    return math.floor((pause_s + timeout_s) / interval_s) + 1


def tolerated_pause_s(interval_s: float, timeout_s: float, threshold: int) -> float:
    """Pauses shorter than this fail fewer than ``threshold`` checks in a row (the inverse of
    :func:`failing_checks`)."""
    return (threshold - 1) * interval_s - timeout_s


def longest_pause_s(cfg: "TGConfig") -> float:
    """Every push of the first sync at ``timeouts.weight_sync_s`` (the coverage check pushes
    twice; its checksums and resets take seconds, not counted)."""
    pushes = 2 if cfg.rollout.sync_verify_coverage else 1
    return pushes * float(cfg.timeouts.weight_sync_s)


def router_health(cfg: "TGConfig") -> RouterHealth:
    t = cfg.timeouts
    timeout = SGLANG_HEALTH_CHECK_TIMEOUT_S + math.ceil(t.health_s)
    # checks must not overlap (one in flight per worker), so the interval exceeds the timeout
    interval = max(math.ceil(t.health_interval_s), timeout + 1)
    pause = longest_pause_s(cfg)
    threshold = failing_checks(pause, interval, timeout) + 1
    return RouterHealth(interval, timeout, threshold, pause, disabled=cfg.rollout.placement == "colocated")


def effective_flags(argv: Sequence[str]) -> dict[str, int]:
    """The health flags a router command line sets (argparse: the last occurrence wins;
    ``--flag=value`` or ``--flag value``), over the router's own defaults."""
    out = dict(ROUTER_DEFAULTS)
    args = list(argv)
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in out:
            raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                out[name] = int(raw)
            except ValueError:
                raise ValueError(f"router command line: {name} needs an integer, got {raw!r}") from None
    return out


def check_router_argv(cfg: "TGConfig", argv: Sequence[str]) -> tuple[str, str]:
    """(PASS or FAIL, what was seen) for a router started with ``argv``: FAIL when its health
    flags let a pause the plan allows mark every worker unhealthy."""
    if cfg.rollout.placement == "colocated":  # released engines must not be health-checked
        if "--disable-health-check" in argv:
            return "PASS", "health checks disabled (colocated: the engines are released while the trainer trains)"
        return "FAIL", ("health checks on, but rollout.placement='colocated' releases the engines for every "
                        "train phase: start the router with --disable-health-check")
    f = effective_flags(argv)
    interval, timeout, threshold = (f["--health-check-interval-secs"], f["--health-check-timeout-secs"],
                                    f["--health-failure-threshold"])
    pause = longest_pause_s(cfg)
    tolerated = tolerated_pause_s(interval, timeout, threshold)
    seen = (f"interval {interval} s, timeout {timeout} s, failure threshold {threshold}: tolerates "
            f"pauses under {tolerated:g} s; the plan's longest is {pause:g} s")
    if timeout < SGLANG_HEALTH_CHECK_TIMEOUT_S:
        seen += (f"; a check times out before a paused engine's own {SGLANG_HEALTH_CHECK_TIMEOUT_S} s "
                 "health verdict")
    if tolerated <= pause:
        need = router_health(cfg)
        return "FAIL", f"{seen}; start the router with {' '.join(need.flags())}"
    return "PASS", seen
