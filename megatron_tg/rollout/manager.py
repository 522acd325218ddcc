"""Asynchronous rollout manager (PipelineRL-style): generation runs continuously, in the
background, while the trainer trains; the trainer pulls finished GRPO groups.

Model::

    dataset --take--> [generating groups] --finish--> [buffer of groups] --get_batch--> trainer
                 ^            |                            |
                 +-- requeue -+ (stop / resume / stale, "regenerate" policy)

* A group is ``group_size`` rollouts of one prompt, produced concurrently by the rollout
  function (the agent harness) through a :class:`~megatron_tg.rollout.context.RolloutContext`.
* **Backpressure**: a new prompt starts only while fewer than ``buffer_size`` finished groups
  wait for the trainer and fewer than ``max_inflight_rollouts`` rollouts are generating (room
  for a whole group). When the buffer is full generation waits; the groups already generating
  still finish into it, so it holds at most ``buffer_size + max_inflight_rollouts / G`` groups.
  Slots are counted per rollout, so a group's finished rollouts free engine capacity while its
  stragglers run (the engines stay as busy as a plain request loop). Tool calls take one of
  ``env_workers_per_node`` environment-worker slots (:mod:`megatron_tg.rollout.capacity`):
  a rollout waits for a slot instead of forking another sandbox. :meth:`capacity_metrics`
  reports queue depth, in-flight rollouts against their bound, sandbox utilisation and the
  generation vs tool time per turn.
* **Staleness**: a group's version is the OLDEST policy version of any of its turns.
  ``get_batch(current_version)`` never returns a group older than
  ``current_version - max_staleness``; older groups are dropped (reason ``stale``) or, with
  ``stale_policy="regenerate"``, their prompt is generated again (at most ``max_retries``
  times). The manager also does not start prompts that are sure to be stale: after the
  trainer took a batch at version T it waits for version ``T + 1 - max_staleness`` unless
  the trainer is already waiting for more.
* **Weight updates**: :meth:`update_weights` closes the version gate (no new turn starts),
  pauses the engines (``pause_mode``: ``retract``, the default, and ``in_place`` keep
  in-flight requests, ``abort`` cuts them and the context resubmits the rest), runs the
  update (the protocol is :mod:`megatron_tg.weight_sync.sync`'s), bumps the version
  and resumes. Multi-turn rollouts simply carry on; each turn keeps its own version.
* **Accounting**: every prompt taken from the dataset is exactly one of trained (returned in
  a batch), dropped (with a reason) or in flight (queued again, generating, or buffered):
  ``taken == trained + dropped + in_flight`` (:meth:`check_invariants`). The trainer moves a
  delivered group to dropped with :meth:`report_dropped` (e.g. a judge error).
* **Checkpoints**: :meth:`state_dict` holds the data position, the counters and every
  in-flight prompt; after :meth:`load_state_dict` those prompts are generated again — none
  lost, none counted twice.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from megatron_tg.rollout.capacity import ToolSlots, env_workers
from megatron_tg.rollout.client import SGLangClientError
from megatron_tg.rollout.context import (EngineError, MalformedOutputError, RolloutContext, VersionGate,
                                         WrongVersionError, request_seed)
from megatron_tg.rollout.types import FramingError, Rollout, RolloutFormatError

log = logging.getLogger(__name__)

DROP_REASONS = ("stale", "engine_error", "malformed", "judge_error", "rollout_error", "wrong_version")
"""stale: too old for the trainer; engine_error: generation failed after retries; malformed:
the engine's output or the built rollout is invalid; judge_error: reported by the trainer;
rollout_error: the rollout function raised something else (a harness bug; logged);
wrong_version: every answer to a turn came from an engine at another weight version (each
such answer is also counted in ``wrong_version``, whether or not a retry saved the turn)."""
STATE_FORMAT = 1
_DELIVERED_KEEP = 4096  # delivered group ids remembered for report_dropped

RolloutFn = Callable[[RolloutContext], Awaitable[Rollout]]


@dataclass
class _Item:
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


class RolloutManager:
    def __init__(self, client, rollout_fn: RolloutFn, tasks: Sequence[Any], config, *,
                 sampling_params: dict[str, Any] | None = None, epochs: int | None = 1,
                 vocab_size: int | None = None, initial_version: int = 0, max_consecutive_failures: int = 16,
                 routing: dict[str, Any] | None = None):
        """``config``: a :class:`~megatron_tg.config.rollout.RolloutConfig` (group_size,
        buffer_size, prompts_per_step, max_staleness, stale_policy, pause_mode, max_retries,
        max_inflight_rollouts and the sampling defaults). ``epochs=None`` cycles the tasks
        forever. After ``max_consecutive_failures`` groups in a row fail (engine error,
        malformed output, rollout error), get_batch raises instead of burning the dataset."""
        if not tasks:
            raise ValueError("RolloutManager needs at least one task")
        self.client, self.rollout_fn, self.tasks, self.cfg = client, rollout_fn, list(tasks), config
        self.epochs = epochs
        self.vocab_size = vocab_size
        # Routing replay: RoutedExpertsBuilder arguments (the model's MoE layout), or None.
        self.routing = routing
        self.sampling_params = {"temperature": config.temperature, "top_p": config.top_p,
                                "max_new_tokens": config.max_new_tokens, **(sampling_params or {})}
        self.gate = VersionGate(initial_version)
        self._cond = asyncio.Condition()
        self._update_lock = asyncio.Lock()
        self._next = 0
        self._requeue: deque[_Item] = deque()
        self._running: dict[int, _Item] = {}
        self._buffer: deque[RolloutGroup] = deque()
        self._delivered: OrderedDict[str, int] = OrderedDict()
        self._c: Counter = Counter()
        self._trainer_version: int | None = None
        self._waiters = 0
        self._rollouts_running = 0
        self.max_inflight_rollouts = config.max_inflight_rollouts or config.buffer_size * config.group_size
        if self.max_inflight_rollouts < config.group_size:
            raise ValueError(f"max_inflight_rollouts={self.max_inflight_rollouts} < group_size={config.group_size}: "
                             "no group could ever start")
        self.tool_slots = ToolSlots(env_workers(getattr(config, "env_workers_per_node", 0)))
        self._tasks: set[asyncio.Task] = set()
        self._producer: asyncio.Task | None = None
        self._error: BaseException | None = None
        self.max_consecutive_failures = max_consecutive_failures
        self._failures_in_a_row = 0
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def version(self) -> int:
        return self.gate.version

    async def start(self) -> "RolloutManager":
        if self._producer is None:
            self._stopping = False
            self._producer = asyncio.create_task(self._produce(), name="rollout-producer")
        return self

    async def stop(self) -> None:
        """Cancel generation; unfinished prompts go back to the queue (still in flight)."""
        self._stopping = True
        async with self._cond:
            self._cond.notify_all()
        todo = list(self._tasks) + ([self._producer] if self._producer else [])
        for t in todo:
            t.cancel()
        await asyncio.gather(*todo, return_exceptions=True)
        self._producer = None
        self._rollouts_running = 0
        # Whatever was generating is still in flight: first in line when generation restarts.
        for item in sorted(self._running.values(), key=lambda i: i.index, reverse=True):
            self._requeue.appendleft(item)
        self._running.clear()

    async def __aenter__(self) -> "RolloutManager":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ------------------------------------------------------------------ producer
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
                        item = _Item(self._next)
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

    async def _run_group(self, item: _Item) -> None:
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
            reason = _reason(e)
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

    # ------------------------------------------------------------------ staleness / drops
    def _is_stale(self, g: RolloutGroup, current_version: int) -> bool:
        return g.version < current_version - self.cfg.max_staleness

    def _drop(self, reason: str) -> None:
        self._c["dropped"] += 1
        self._c[f"dropped_{reason}"] += 1

    def _stale(self, g: RolloutGroup) -> None:
        if self.cfg.stale_policy == "regenerate" and g.attempt < self.cfg.max_retries:
            self._requeue.append(_Item(g.index, g.attempt + 1))
            self._c["regenerated"] += 1
        else:
            self._drop("stale")

    def _purge(self, current_version: int) -> None:
        keep = deque()
        for g in self._buffer:
            (self._stale(g) if self._is_stale(g, current_version) else keep.append(g))
        self._buffer = keep

    def report_dropped(self, group_id: str, reason: str = "judge_error") -> None:
        """The trainer could not use a delivered group (e.g. the judge failed on it): count
        it as dropped instead of trained."""
        if reason not in DROP_REASONS:
            raise ValueError(f"reason must be one of {DROP_REASONS}, got {reason!r}")
        if group_id not in self._delivered:
            raise KeyError(f"group {group_id!r} was not delivered recently (or was already reported)")
        del self._delivered[group_id]
        self._c["trained"] -= 1
        self._drop(reason)

    # ------------------------------------------------------------------ trainer side
    async def get_batch(self, current_version: int, num_groups: int | None = None,
                        timeout: float | None = None) -> list[RolloutGroup]:
        """Wait for ``num_groups`` (default ``prompts_per_step``) groups no older than
        ``current_version - max_staleness`` and return them, oldest first. Returns fewer
        (possibly none) only when the dataset is used up. Raises TimeoutError after
        ``timeout`` seconds (the groups found so far stay buffered)."""
        n = num_groups or self.cfg.prompts_per_step
        if not 1 <= n <= self.cfg.buffer_size:
            raise ValueError(f"num_groups must be in [1, buffer_size={self.cfg.buffer_size}], got {n}")
        if current_version - self.cfg.max_staleness > self.version:
            raise ValueError(f"trainer at version {current_version} but engines at {self.version}: with "
                             f"max_staleness={self.cfg.max_staleness} nothing they generate is usable; "
                             "update the engines' weights first (update_weights)")
        await self.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        async with self._cond:
            self._trainer_version = current_version
            self._waiters += 1
            self._cond.notify_all()
            try:
                while True:
                    if self._error is not None:
                        raise RuntimeError(f"rollout generation failed: {self._error}") from self._error
                    self._purge(current_version)
                    if len(self._buffer) >= n or (not self._has_prompt() and not self._running):
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"get_batch: {len(self._buffer)}/{n} groups after {timeout}s")
                    try:
                        await asyncio.wait_for(self._cond.wait(), left)
                    except asyncio.TimeoutError:
                        pass
                batch = [self._buffer.popleft() for _ in range(min(n, len(self._buffer)))]
                # Oldest weights first, then data order: the batch's order (and so the float
                # summation order of the loss) does not depend on which group finished first.
                batch.sort(key=lambda g: (g.version, g.index))
                for g in batch:
                    self._c["trained"] += 1
                    self._delivered[g.group_id] = g.index
                    self._c["max_staleness_delivered"] = max(self._c["max_staleness_delivered"],
                                                             g.staleness(current_version))
                while len(self._delivered) > _DELIVERED_KEEP:
                    self._delivered.popitem(last=False)
                self._c["batches"] += 1
                self._cond.notify_all()  # slots freed
                return batch
            finally:
                self._waiters -= 1

    def adopt_version(self, version: int) -> None:
        """The engines were just given the weights of policy ``version`` outside
        :meth:`update_weights` (a push right after they started, nothing generating): serve
        it from now on. A trainer resumed from a checkpoint that holds no rollout state (an
        SFT checkpoint, ``megatron-tg eval``) would otherwise send rollouts at version 0 and
        discard every answer, which the engines report at ``version``."""
        version = int(version)
        if version < self.version:
            raise ValueError(f"version {version} is older than the one served, {self.version}")
        if version != self.version:
            self.gate.set_version(version)
        self.client.expected_weight_version = str(version)

    async def update_weights(self, fn: Callable[..., Any], *args: Any, version: int | None = None,
                             **kwargs: Any) -> Any:
        """Pause generation, run ``fn(*args, **kwargs)`` (sync or async: the actual weight
        transfer), bump the policy version (to ``version`` if given) and resume. In-flight
        rollouts continue afterwards. If ``fn`` raises, the version is unchanged and
        generation resumes on the old weights."""
        async with self._update_lock:
            new = self.version + 1 if version is None else int(version)
            if new <= self.version:
                raise ValueError(f"new version {new} must be > current {self.version}")
            t0 = time.monotonic()
            self.gate.close()
            paused = False
            try:
                await self.client.pause_generation(mode=self.cfg.pause_mode)
                paused = True
                out = fn(*args, **kwargs)
                if inspect.isawaitable(out):
                    out = await out
                self.gate.set_version(new)
                # the engines now report str(new): the client routes only to those that do (a
                # rollout service's client learns it here, the trainer pushed the weights)
                self.client.expected_weight_version = str(new)
            finally:
                try:
                    await self.client.continue_generation()
                except Exception:
                    if paused:  # engines stay paused: nothing can proceed
                        raise
                    log.warning("continue_generation after a failed pause failed too", exc_info=True)
                finally:
                    self.gate.open()
            dt = time.monotonic() - t0
            async with self._cond:
                self._c["weight_updates"] += 1
                self._c["update_seconds"] += dt
                self._purge(new)
                self._cond.notify_all()
            return out

    # ------------------------------------------------------------------ accounting
    def counters(self) -> dict[str, Any]:
        """Flat dict for logging (``rollout/<key>``)."""
        c = {k: self._c[k] for k in ("taken", "trained", "dropped", "regenerated", "rollouts", "turns",
                                     "tokens_generated", "batches", "weight_updates", "max_staleness_delivered",
                                     "wrong_version")}
        c.update({f"dropped_{r}": self._c[f"dropped_{r}"] for r in DROP_REASONS})
        c.update(in_flight=len(self._requeue) + len(self._running) + len(self._buffer),
                 queued=len(self._requeue), generating=len(self._running), buffered=len(self._buffer),
                 rollouts_generating=self._rollouts_running,
                 data_position=self._next, policy_version=self.version,
                 update_seconds=round(float(self._c["update_seconds"]), 6))
        return c

    def capacity_metrics(self) -> dict[str, float]:
        """``capacity/*`` and ``turn/*`` for the step's metrics: the buffer and in-flight
        bounds and how full they are now, and the tool slots' figures since the last call."""
        return {"capacity/queue_depth": float(len(self._buffer)),
                "capacity/buffer_size": float(self.cfg.buffer_size),
                "capacity/rollouts_in_flight": float(self._rollouts_running),
                "capacity/inflight_limit": float(self.max_inflight_rollouts),
                "capacity/groups_queued": float(len(self._requeue)),
                **self.tool_slots.take()}

    def check_invariants(self) -> None:
        """Raise AssertionError naming every broken accounting rule."""
        c = self.counters()
        pending = [i.index for i in self._requeue] + list(self._running) + [g.index for g in self._buffer]
        errs = []
        if c["taken"] != c["trained"] + c["dropped"] + c["in_flight"]:
            errs.append(f"taken {c['taken']} != trained {c['trained']} + dropped {c['dropped']} "
                        f"+ in_flight {c['in_flight']}")
        if c["dropped"] != sum(c[f"dropped_{r}"] for r in DROP_REASONS):
            errs.append("dropped != sum of the per-reason drops")
        if c["taken"] != self._next:
            errs.append(f"taken {c['taken']} != data position {self._next}")
        if len(set(pending)) != len(pending):
            errs.append(f"a prompt is in flight twice: {sorted(pending)}")
        if not 0 <= self._rollouts_running <= self.max_inflight_rollouts:
            errs.append(f"{self._rollouts_running} rollouts generating (limit {self.max_inflight_rollouts})")
        cap = self.cfg.buffer_size + -(-self.max_inflight_rollouts // self.cfg.group_size)
        if len(self._running) + len(self._buffer) > cap:
            errs.append(f"{len(self._running)} generating + {len(self._buffer)} buffered groups > {cap}")
        if any(len(g.rollouts) != self.cfg.group_size for g in self._buffer):
            errs.append("a buffered group has the wrong size")
        negative = [k for k, v in c.items() if v < 0]
        if negative:
            errs.append(f"negative counters {negative}")
        if errs:
            raise AssertionError("rollout accounting: " + "; ".join(errs))

    def state_dict(self) -> dict[str, Any]:
        """Data position, counters, version, and the in-flight prompts (re-queued on load)."""
        pending = sorted([(i.index, i.attempt) for i in self._requeue] + [(i.index, i.attempt) for i in
                         self._running.values()] + [(g.index, g.attempt) for g in self._buffer])
        return {"format": STATE_FORMAT, "next_index": self._next, "pending": [list(p) for p in pending],
                "counters": {k: v for k, v in self._c.items() if v}, "policy_version": self.version,
                "delivered": list(self._delivered.items()), "num_tasks": len(self.tasks), "epochs": self.epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._producer is not None:
            raise RuntimeError("load_state_dict before start()")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unsupported rollout manager state format {state.get('format')!r}")
        if state["num_tasks"] != len(self.tasks):
            raise ValueError(f"checkpoint was taken with {state['num_tasks']} tasks, now {len(self.tasks)}")
        self._next = int(state["next_index"])
        self._requeue = deque(_Item(int(i), int(a)) for i, a in state["pending"])
        self._running, self._buffer = {}, deque()
        self._c = Counter(state["counters"])
        self._delivered = OrderedDict((g, int(i)) for g, i in state.get("delivered", []))
        self.gate = VersionGate(int(state["policy_version"]))
        self.check_invariants()


def _reason(e: BaseException) -> str:
    if isinstance(e, WrongVersionError):
        return "wrong_version"
    if isinstance(e, (SGLangClientError, EngineError, ConnectionError, TimeoutError)):
        return "engine_error"
    if isinstance(e, (MalformedOutputError, RolloutFormatError, FramingError)):
        return "malformed"
    return "rollout_error"
