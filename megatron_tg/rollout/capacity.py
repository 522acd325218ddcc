"""Admission to the environment workers: a bound on tool calls running at once, and the
time split of each rollout turn into generation and tools.

A rollout holds its workspace for its whole life (the manager bounds how many rollouts are in
flight, ``rollout.max_inflight_rollouts``), but it runs sandboxed processes only while a tool
call executes. :class:`ToolSlots` bounds those: ``rollout.env_workers_per_node`` slots per
rollout-side process (0 = the node's CPU count), a call that finds them all busy waits for
one, so a burst of tool calls queues instead of forking thousands of sandboxes on one node.

:meth:`ToolSlots.take` reads and resets the interval's figures for the step's metrics:
``capacity/sandbox_utilisation`` (busy slot-seconds / (slots x seconds)), ``capacity/
tool_wait_s`` (time calls waited for a slot), ``turn/gen_s`` and ``turn/tool_s`` (mean
seconds per assistant turn spent generating and in tools).
"""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator


def env_workers(configured: int) -> int:
    """The slot count for ``rollout.env_workers_per_node`` (0 = this node's CPUs)."""
    return configured if configured > 0 else (os.cpu_count() or 1)


class ToolSlots:
    """At most ``limit`` tool calls at once (one event loop), with utilisation accounting."""

    def __init__(self, limit: int, clock=time.monotonic) -> None:
        if limit < 1:
            raise ValueError(f"tool slots: limit must be >= 1, got {limit}")
        self.limit = limit
        self._sem = asyncio.Semaphore(limit)
        self._clock = clock
        self.busy = 0
        self.peak = 0
        """Most calls ever running at once (never above ``limit``)."""
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._since = self._mark = now
        self._busy_area = self._wait = self._tool = self._gen = 0.0
        self._turns = self._calls = 0

    def _advance(self) -> None:
        now = self._clock()
        self._busy_area += self.busy * (now - self._mark)
        self._mark = now

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot around a tool call (waits while all are busy)."""
        t0 = self._clock()
        await self._sem.acquire()
        t1 = self._clock()
        self._advance()
        self.busy += 1
        self.peak = max(self.peak, self.busy)
        try:
            yield
        finally:
            self._advance()
            self.busy -= 1
            self._sem.release()
            self._wait += t1 - t0
            self._tool += self._clock() - t1
            self._calls += 1

    def add_generation(self, seconds: float) -> None:
        """One assistant turn's generation time (RolloutContext.generate reports it)."""
        self._gen += seconds
        self._turns += 1

    def peek(self) -> dict[str, float]:
        """Now: busy slots, the limit and the peak (no reset)."""
        return {"tool_slots_busy": self.busy, "tool_slots": self.limit, "tool_slots_peak": self.peak}

    def take(self) -> dict[str, float]:
        """The figures since the last take (then reset)."""
        self._advance()
        span = max(self._mark - self._since, 1e-9)
        out = {"capacity/sandbox_utilisation": self._busy_area / (self.limit * span),
               "capacity/tool_slots": float(self.limit), "capacity/tool_slots_peak": float(self.peak),
               "capacity/tool_calls": float(self._calls), "capacity/tool_wait_s": self._wait}
        if self._turns:  # per generated turn; none when no rollout called generate()
            out.update({"turn/gen_s": self._gen / self._turns, "turn/tool_s": self._tool / self._turns})
        self._reset(self._mark)
        return out
