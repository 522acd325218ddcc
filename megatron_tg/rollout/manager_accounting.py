"""The rollout manager's accounting (mixed into
:class:`~megatron_tg.rollout.manager.RolloutManager`): why groups are dropped, the counters it
logs, its capacity figures, the invariants that hold between them, and the state a checkpoint
keeps.

Every prompt taken from the dataset is exactly one of trained (returned in a batch), dropped
(with a reason) or in flight (queued again, generating, or buffered):
``taken == trained + dropped + in_flight`` (:meth:`ManagerAccounting.check_invariants`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Any

from megatron_tg.rollout.context import VersionGate
from megatron_tg.rollout.group_producer import PromptItem

DROP_REASONS = ("stale", "engine_error", "malformed", "judge_error", "rollout_error", "wrong_version")
"""stale: too old for the trainer; engine_error: generation failed after retries; malformed:
the engine's output or the built rollout is invalid; judge_error: reported by the trainer;
rollout_error: the rollout function raised something else (a harness bug; logged);
wrong_version: every answer to a turn came from an engine at another weight version (each
such answer is also counted in ``wrong_version``, whether or not a retry saved the turn)."""
STATE_FORMAT = 1


class ManagerAccounting:
    """Counters, invariants and checkpoint state over the manager's queues (set up by
    ``RolloutManager.__init__``)."""

    def _drop(self, reason: str) -> None:
        self._c["dropped"] += 1
        self._c[f"dropped_{reason}"] += 1

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
        self._requeue = deque(PromptItem(int(i), int(a)) for i, a in state["pending"])
        self._running, self._buffer = {}, deque()
        self._c = Counter(state["counters"])
        self._delivered = OrderedDict((g, int(i)) for g, i in state.get("delivered", []))
        self.gate = VersionGate(int(state["policy_version"]))
        self.check_invariants()
