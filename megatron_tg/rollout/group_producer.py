"""The rollout manager's producer (mixed into
:class:`~megatron_tg.rollout.manager.RolloutManager`): which prompt starts when, and how one
group of rollouts runs.

* **Admission**: a prompt starts only while there is room for its whole group among the
  rollouts generating and the buffer is not full, unless it is sure to be stale when the
  trainer next asks, or (fully on-policy) one step's worth of groups is already generating
  or buffered. Regenerated and resumed prompts come first.
* **One group**: ``group_size`` rollouts of one prompt run concurrently, each through its own
  :class:`~megatron_tg.rollout.context.RolloutContext` (per-request seeds from the data
  position and rollout index); each finished rollout frees its slot at once. One rollout
  failing drops the whole group with a reason (:func:`drop_reason`); a finished group is a
  :class:`RolloutGroup`, buffered unless already stale.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from megatron_tg.rollout.context import (EngineError, MalformedOutputError, RolloutContext, WrongVersionError,
                                         request_seed)
from megatron_tg.rollout.errors import FramingError, RolloutFormatError, SGLangClientError
from megatron_tg.rollout.types import Rollout

log = logging.getLogger(__name__)

RolloutFn = Callable[[RolloutContext], Awaitable[Rollout]]


@dataclass
class PromptItem:
    """One prompt taken from the dataset, while it is in flight."""

    index: int  # data position (epoch * len(tasks) + task number)
    attempt: int = 0  # > 0 when regenerated after going stale


@dataclass
class RolloutGroup:
    group_id: str
    index: int
    task: Any
    rollouts: list[Rollout]
    version: int
    """Oldest policy version of any turn of any rollout (staleness is judged on it)."""
    newest_version: int
    attempt: int = 0
    """How many times this prompt was regenerated after going stale (stale_policy=regenerate)."""
    gen_seconds: float = 0.0

    def staleness(self, current_version: int) -> int:
        return current_version - self.version


class GroupProducer:
    """The producer task and the run of one group; reads the manager's configuration, queues
    and counters (set up by ``RolloutManager.__init__``)."""

    def _total(self) -> int | None:
        return None if self.epochs is None else len(self.tasks) * self.epochs

    def _has_prompt(self) -> bool:
        total = self._total()
        return bool(self._requeue) or total is None or self._next < total

    def _doomed(self) -> bool:
        """Would a prompt started now be stale when the trainer next asks?"""
        t = self._trainer_version
        return t is not None and self._waiters == 0 and self.version < t + 1 - self.cfg.max_staleness

    def _can_admit(self) -> bool:
        return (self._rollouts_running + self.cfg.group_size <= self.max_inflight_rollouts
                and len(self._buffer) < self.cfg.buffer_size and self._has_prompt() and not self._doomed()
                and not self._enough_for_one_step())

    def _enough_for_one_step(self) -> bool:
        """Fully on-policy (max_staleness=0): every group of this version beyond one step's
        worth would be stale before the trainer could use it, so none is started. This also
        makes the data of each step exactly the next prompts_per_step prompts, whatever the
        timing (what a reproducible, resumable run needs)."""
        return (self.cfg.max_staleness == 0
                and len(self._buffer) + len(self._running) >= self.cfg.prompts_per_step)

    async def _produce(self) -> None:
        try:
            while True:
                async with self._cond:
                    await self._cond.wait_for(lambda: self._stopping or self._can_admit())
                    if self._stopping:
                        return
                    if self._requeue:
                        item = self._requeue.popleft()
                    else:
                        item = PromptItem(self._next)
                        self._next += 1
                        self._c["taken"] += 1
                    self._running[item.index] = item
                    self._rollouts_running += self.cfg.group_size
                t = asyncio.create_task(self._run_group(item))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a manager bug: surface it to the trainer, don't hang
            log.exception("rollout producer failed")
            self._error = e
            async with self._cond:
                self._cond.notify_all()

    def _task_id(self, task: Any, index: int) -> str:
        tid = getattr(task, "id", None) or (task.get("id") if isinstance(task, dict) else None)
        return str(tid) if tid else f"task{index % len(self.tasks)}"

    async def _run_group(self, item: PromptItem) -> None:
        task = self.tasks[item.index % len(self.tasks)]
        gid = f"{self._task_id(task, item.index)}@{item.index}" + (f".r{item.attempt}" if item.attempt else "")
        t0 = time.monotonic()
        start_version = self.version
        base_seed = self.cfg.sampling_seed
        # Seeds depend on the data position and rollout index, not on the attempt: a group
        # regenerated on the same weights (after a resume) samples the same tokens.
        ctxs = [RolloutContext(self.client, task, group_id=gid, rollout_id=f"{gid}/{i}", index=i, gate=self.gate,
                               sampling_params=self.sampling_params, max_aborts=self.cfg.max_retries,
                               vocab_size=self.vocab_size, routing=self.routing, tools=self.tool_slots,
                               seed=None if base_seed is None else request_seed(base_seed, item.index, i))
                for i in range(self.cfg.group_size)]
        subs = [asyncio.create_task(self.rollout_fn(c)) for c in ctxs]
        pending = set(subs)
        try:
            return await self._finish_group(item, task, gid, t0, start_version, ctxs, subs, pending)
        finally:  # discarded answers count whatever became of the group
            self._c["wrong_version"] += sum(c.wrong_version for c in ctxs)

    async def _finish_group(self, item, task, gid, t0, start_version, ctxs, subs, pending) -> None:
        try:
            failed: BaseException | None = None
            while pending and failed is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                async with self._cond:  # each finished rollout frees an engine slot at once
                    self._rollouts_running -= len(done)
                    self._cond.notify_all()
                for s in done:
                    if s.cancelled():
                        failed = failed or RuntimeError("rollout task cancelled")
                    elif s.exception() is not None:
                        failed = failed or s.exception()
            if pending:  # one rollout failed: the whole group is dropped
                for s in pending:
                    s.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                async with self._cond:
                    self._rollouts_running -= len(pending)
                    self._cond.notify_all()
                pending = set()
            if failed is not None:
                raise failed
            rollouts = [s.result() for s in subs]
            for ctx, r in zip(ctxs, rollouts):
                if not isinstance(r, Rollout):
                    raise TypeError(f"rollout function returned {type(r).__name__}, not Rollout")
                r.group_id, r.rollout_id = gid, r.rollout_id or ctx.rollout_id
                if ctx.routed is not None and r.routed_experts is None:
                    r.routed_experts = ctx.routed.for_rollout(r.token_ids)
                r.validate(self.vocab_size)
        except asyncio.CancelledError:  # stop(): the prompt stays in _running; stop() requeues it
            for s in pending:
                s.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise
        except Exception as e:
            reason = drop_reason(e)
            (log.error if reason == "rollout_error" else log.warning)(
                "dropping group %s (%s): %s: %s", gid, reason, type(e).__name__, e,
                exc_info=reason == "rollout_error")
            async with self._cond:
                self._running.pop(item.index, None)
                self._drop(reason)
                self._failures_in_a_row += 1
                if self._failures_in_a_row >= self.max_consecutive_failures and self._error is None:
                    self._error = RuntimeError(f"{self._failures_in_a_row} groups in a row failed; the last "
                                               f"({reason}): {type(e).__name__}: {e}")
                    self._stopping = True  # stop taking prompts: they would all be dropped
                self._cond.notify_all()
            return
        versions = [s.policy_version for r in rollouts for s in r.assistant_turns()]
        spanned = [v for r in rollouts for s in r.assistant_turns() for v in s.meta.get("versions", ())]
        group = RolloutGroup(gid, item.index, task, rollouts, min(versions, default=start_version),
                             max(versions + spanned, default=start_version), item.attempt, time.monotonic() - t0)
        async with self._cond:
            self._running.pop(item.index, None)
            self._failures_in_a_row = 0
            self._c["rollouts"] += len(rollouts)
            self._c["turns"] += sum(r.num_turns for r in rollouts)
            self._c["tokens_generated"] += sum(sum(s.end - s.start for s in r.assistant_turns()) for r in rollouts)
            ref = max(self.version, self._trainer_version or 0)
            if self._is_stale(group, ref):
                self._stale(group)
            else:
                self._buffer.append(group)
            self._cond.notify_all()


def drop_reason(e: BaseException) -> str:
    """The reason (one of ``manager_accounting.DROP_REASONS``) a group that raised ``e`` is dropped for."""
    if isinstance(e, WrongVersionError):
        return "wrong_version"
    if isinstance(e, (SGLangClientError, EngineError, ConnectionError, TimeoutError)):
        return "engine_error"
    if isinstance(e, (MalformedOutputError, RolloutFormatError, FramingError)):
        return "malformed"
    return "rollout_error"
