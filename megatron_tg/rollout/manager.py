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

Here: the lifecycle, staleness, and the trainer's side (``get_batch``, ``report_dropped``,
weight updates). The producer (admission, the run of one group, :class:`RolloutGroup`) is
:mod:`~megatron_tg.rollout.group_producer`; the drop reasons, counters, invariants and
checkpoint state are :mod:`~megatron_tg.rollout.manager_accounting`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import Counter, OrderedDict, deque
from typing import Any, Callable, Sequence

from megatron_tg.rollout.capacity import ToolSlots, env_workers
from megatron_tg.rollout.context import VersionGate
from megatron_tg.rollout.group_producer import GroupProducer, PromptItem, RolloutFn, RolloutGroup
from megatron_tg.rollout.manager_accounting import DROP_REASONS, ManagerAccounting

log = logging.getLogger(__name__)

_DELIVERED_KEEP = 4096  # delivered group ids remembered for report_dropped


class RolloutManager(GroupProducer, ManagerAccounting):
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
        self._requeue: deque[PromptItem] = deque()
        self._running: dict[int, PromptItem] = {}
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

    # ------------------------------------------------------------------ staleness / drops
    def _is_stale(self, g: RolloutGroup, current_version: int) -> bool:
        return g.version < current_version - self.cfg.max_staleness

    def _stale(self, g: RolloutGroup) -> None:
        if self.cfg.stale_policy == "regenerate" and g.attempt < self.cfg.max_retries:
            self._requeue.append(PromptItem(g.index, g.attempt + 1))
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
