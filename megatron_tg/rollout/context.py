"""What a rollout function gets for one rollout: the task, ids, and a ``generate`` that is
aware of policy versions and in-flight weight updates.

:class:`RolloutContext.generate` is the only way rollout functions (the agent harness) should
call the engine under the :class:`~megatron_tg.rollout.manager.RolloutManager`:

* it waits while a weight update is in progress (the manager's :class:`VersionGate` is
  closed), so a new turn never starts on weights that are being replaced;
* it reports the policy version of the turn: the version when the turn was first submitted,
  i.e. the OLDEST weights that produced any of its tokens (what the staleness filter must
  see; see :attr:`megatron_tg.rollout.types.Segment.policy_version`), plus every version it
  spanned when an in-place pause let it continue on new weights;
* a turn aborted by a weight update (pause mode ``abort``) is resubmitted after the update
  with the tokens generated so far appended to the input, and the pieces are concatenated,
  so the turn's token ids and log-probs stay exactly what the engine sampled;
* it checks the engine's answer (log-probs present, one per token, ids in the vocabulary);
* it times the turn (``gen_seconds``), and :meth:`RolloutContext.tool_slot` admits and times
  the rollout's tool calls (:mod:`megatron_tg.rollout.capacity`);
* with ``routing`` (routing replay) it asks each request for the routed experts of the
  positions not covered yet (``routed_experts_start_len``) and collects them in
  ``self.routed`` (:class:`~megatron_tg.rollout.routed_experts.RoutedExpertsBuilder`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from megatron_tg.rollout.engine.routing import decode_routed_experts
from megatron_tg.rollout.routed_experts import RoutedExpertsBuilder

if TYPE_CHECKING:
    from megatron_tg.rollout.capacity import ToolSlots


class EngineError(RuntimeError):
    """Generation failed for good (after the client's retries / repeated aborts)."""


class MalformedOutputError(ValueError):
    """The engine's answer cannot be used for training (no log-probs, ids out of range...)."""


class WrongVersionError(EngineError):
    """Every answer to a turn came from an engine serving other weights than the turn's
    policy version (an engine back on its base weights, or one caught mid-load)."""


# What an engine reports before its first weight update (SGLang's --weight-version default):
# the base weights, i.e. policy version 0.
BASE_WEIGHT_VERSION = "default"


def serves(weight_version: str | None, versions: Sequence[int]) -> bool:
    """Whether an answer reporting ``weight_version`` came from one of the policy ``versions``
    (the sync sets engine version ``str(v)``; version 0 is the base weights). An engine that
    reports no version cannot be checked and is taken at its word."""
    if weight_version is None:
        return True
    w = str(weight_version)
    return any(w == str(v) or (v == 0 and w == BASE_WEIGHT_VERSION) for v in versions)


class VersionGate:
    """The engines' current policy version, and a gate closed while weights are replaced."""

    def __init__(self, version: int = 0):
        self.epoch = 0  # bumped whenever an update starts: "was this request cut by an update?"
        self.history = [int(version)]  # every version set, in order (what a long turn spanned)
        self._open = asyncio.Event()
        self._open.set()

    @property
    def version(self) -> int:
        return self.history[-1]

    def set_version(self, version: int) -> None:
        self.history.append(int(version))

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self.epoch += 1
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        if not self._open.is_set():
            await self._open.wait()


@dataclass
class TurnOutput:
    ids: list[int]
    logprobs: list[float]
    version: int
    """Oldest policy version that generated any of these tokens."""
    versions: list[int]
    """All versions the turn may span (more than one after an in-flight weight update)."""
    finish_type: str
    """The engine's finish reason type: "stop", "length" or "abort"."""
    finish_reason: dict[str, Any] = field(default_factory=dict)
    resubmits: int = 0
    """Times the turn was resubmitted after an abort (each continues where it stopped)."""
    weight_version: str | None = None
    """The engine's own weight-version string at the end of the turn."""

    def segment_meta(self) -> dict[str, Any]:
        """What the harness stores in the assistant segment's ``meta``."""
        meta: dict[str, Any] = {"finish": self.finish_type, "versions": list(self.versions)}
        if self.resubmits:
            meta["resubmits"] = self.resubmits
        if self.weight_version is not None:
            meta["weight_version"] = self.weight_version
        return meta


def request_seed(*parts: int) -> int:
    """A 31-bit sampling seed from integers (stable across processes and Python versions)."""
    digest = hashlib.sha256(":".join(str(int(x)) for x in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class RolloutContext:
    def __init__(self, client, task: Any, *, group_id: str, rollout_id: str, index: int = 0,
                 gate: VersionGate | None = None, sampling_params: dict[str, Any] | None = None,
                 max_aborts: int = 3, vocab_size: int | None = None, seed: int | None = None,
                 routing: dict[str, Any] | None = None, tools: "ToolSlots | None" = None):
        self.client = client
        self.task = task
        self.group_id = group_id
        self.rollout_id = rollout_id
        self.index = index
        """Position of this rollout within its GRPO group."""
        self.gate = gate if gate is not None else VersionGate()
        self.sampling_params = dict(sampling_params or {})
        self.max_aborts = max_aborts
        self.vocab_size = vocab_size
        self.seed = seed
        """Base of this rollout's per-request sampling seeds (None: the engine's own RNG)."""
        self.turns = 0
        self.routed = RoutedExpertsBuilder(**routing) if routing else None
        """The engine's routed experts of this rollout's tokens (routing replay), or None."""
        self.tools = tools
        """The manager's tool slots (the environment workers' admission), or None: unbounded."""
        self.gen_seconds = self.tool_seconds = 0.0
        self.wrong_version = 0
        """Answers discarded because the engine served other weights than the turn's version."""

    def tool_slot(self):
        """``async with ctx.tool_slot():`` around a tool call: waits for a free environment
        worker slot (rollout.env_workers_per_node) and counts the call's time as tool time."""
        return _timed(self, self.tools.slot() if self.tools is not None else None)

    @property
    def version(self) -> int:
        return self.gate.version

    async def generate(self, input_ids: Sequence[int], max_new_tokens: int | None = None,
                       **sampling_overrides: Any) -> TurnOutput:
        params = {**self.sampling_params, **sampling_overrides}
        if max_new_tokens is not None:
            params["max_new_tokens"] = int(max_new_tokens)
        budget = params.get("max_new_tokens")
        prompt = [int(t) for t in input_ids]
        turn, self.turns = self.turns, self.turns + 1
        t0 = time.monotonic()
        try:
            return await self._generate(prompt, params, budget, turn)
        finally:
            dt = time.monotonic() - t0
            self.gen_seconds += dt
            if self.tools is not None:
                self.tools.add_generation(dt)

    async def _generate(self, prompt: list[int], params: dict[str, Any], budget, turn: int) -> TurnOutput:
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        aborts = resubmits = 0
        k = 0
        while True:
            await self.gate.wait_open()
            v, epoch, seen = self.gate.version, self.gate.epoch, len(self.gate.history)
            if not versions or versions[-1] != v:
                versions.append(v)
            p = dict(params)
            if self.seed is not None and "sampling_seed" not in p:
                p["sampling_seed"] = request_seed(self.seed, turn, k)
            if budget is not None:
                p["max_new_tokens"] = budget - len(ids)
            sent = prompt + ids
            start = self.routed.start_for(sent) if self.routed is not None else 0
            routing = ({"extra": {"return_routed_experts": True, "routed_experts_start_len": start}}
                       if self.routed is not None else {})
            res = await self.client.generate(sent, p, return_logprob=True,
                                             rid=f"{self.rollout_id}/t{turn}.{k}", **routing)
            k += 1
            # The versions this attempt may have run on: the one it was sent at, and any set
            # while it ran (an in-place pause continues it on the new weights).
            spans = [v, *self.gate.history[seen:]]
            if not serves(res.weight_version, spans):
                # Generated on weights no policy version names (an engine restarted on its
                # base weights, or mid-load behind a router): training it as version v would
                # be wrong, so its tokens are discarded and the attempt is sent again.
                self.wrong_version += 1
                if self.wrong_version > self.max_aborts:
                    raise WrongVersionError(
                        f"{self.rollout_id}: turn {turn}: {self.wrong_version} answers from {res.server} "
                        f"and others at weight version {res.weight_version!r}, not policy version(s) {spans}")
                continue
            self._check(res)
            self._collect_routing(sent, start, res)
            ids += [int(t) for t in res.output_ids]
            lps += [float(x) for x in res.output_logprobs]
            if res.finish_type != "abort":
                versions += self.gate.history[seen:]  # continued in place on newer weights
            if res.finish_type == "abort":
                if self.gate.epoch != epoch or not self.gate.is_open:  # cut by a weight update
                    if budget is not None and len(ids) >= budget:
                        return self._out(ids, lps, versions, "length", res, resubmits)
                    resubmits += 1
                    continue
                aborts += 1  # aborted for another reason (server-side): retry a few times
                if aborts > self.max_aborts:
                    raise EngineError(f"{self.rollout_id}: turn {turn} aborted {aborts} times "
                                      f"({res.finish_reason})")
                resubmits += 1
                continue
            return self._out(ids, lps, versions, res.finish_type, res, resubmits)

    @staticmethod
    def _out(ids, lps, versions, finish_type, res, resubmits) -> TurnOutput:
        return TurnOutput(ids, lps, min(versions), sorted(set(versions)), finish_type,
                          dict(res.finish_reason or {}), resubmits, res.weight_version)

    def _collect_routing(self, sent: list[int], start: int, res) -> None:
        if self.routed is None:
            return
        payload = res.meta_info.get("routed_experts")
        if payload is None:
            if res.finish_type == "abort":  # the resubmitted request covers these positions
                return
            raise MalformedOutputError(f"{self.rollout_id}: the engine returned no routed_experts "
                                       "(SGLang needs --enable-return-routed-experts)")
        fed = (sent + [int(t) for t in res.output_ids])[:-1]  # the last token is never fed
        try:
            rows = decode_routed_experts(payload, 1, self.routed.top_k)
            self.routed.add(start, rows.reshape(len(fed) - start, -1, self.routed.top_k),
                            fed[start:])
        except ValueError as e:
            raise MalformedOutputError(f"{self.rollout_id}: routed_experts from position {start} "
                                       f"for {len(fed)} fed tokens: {e}") from e

    def _check(self, res) -> None:
        if res.output_logprobs is None:
            raise MalformedOutputError(f"{self.rollout_id}: engine returned no log-probs")
        if len(res.output_logprobs) != len(res.output_ids):
            raise MalformedOutputError(f"{self.rollout_id}: {len(res.output_logprobs)} log-probs for "
                                       f"{len(res.output_ids)} tokens")
        if self.vocab_size is not None:
            bad = [t for t in res.output_ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise MalformedOutputError(f"{self.rollout_id}: token ids {bad[:5]} outside the "
                                           f"vocabulary [0, {self.vocab_size})")


@asynccontextmanager
async def _timed(ctx: RolloutContext, slot):
    t0 = time.monotonic()
    try:
        if slot is None:
            yield
        else:
            async with slot:
                yield
    finally:
        ctx.tool_seconds += time.monotonic() - t0
