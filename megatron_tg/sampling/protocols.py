"""The typed interface between the training loop and the rollout side.

The loop (:mod:`megatron_tg.train.loop`) holds a :class:`RolloutSource` on global rank 0 and
nothing else of the rollout machinery: engines, client, manager, judge and their event loop
stay behind it. :class:`megatron_tg.sampling.rollouts.RolloutSide` is the in-process
implementation; :class:`megatron_tg.sampling.service.client.RolloutServiceClient` implements the
same methods over HTTP for a side running as its own process (``rollout.service``,
docs/rollout-service.md).

Weight sync is split by who does what. The trainer's ranks stream the weights (collective,
:mod:`megatron_tg.weight_sync.sync`); the rollout side says where they go
(:meth:`RolloutSource.weight_target`: the engines' client and the weight-update group) and
runs the push while its engines are paused and their version is bumped
(:meth:`RolloutSource.run_sync`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Coroutine, Protocol, Sequence, TypeVar

if TYPE_CHECKING:  # types only: the loop never imports the rollout machinery itself
    from megatron_tg.judge.judge import JudgeResult
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.rollout.types import Rollout
    from megatron_tg.rollout.weight_client import TrainerWeightGroup
    from megatron_tg.sampling.train_sample import TrainSample
    from megatron_tg.train.trainer import Trainer

T = TypeVar("T")


class SyncResult(Protocol):
    """What a weight push returns (``weight_sync.checks.SyncStats``): metrics of the sync."""

    def as_metrics(self) -> dict[str, float]: ...


@dataclass
class WeightTarget:
    """Where a weight push goes: the engines' admin client and the weight-update group."""

    client: "SGLangClient"
    group: "TrainerWeightGroup"
    """Replaced when an engine is lost or comes back (:mod:`megatron_tg.weight_sync.engine_loss`)."""
    formations: int = 0
    """How many groups were formed for this run (each formation gets a fresh group name)."""
    router: str | None = None
    """The sglang-router in front of the engines, if any: an engine lost or being admitted
    is taken out of it (:mod:`megatron_tg.weight_sync.engine_loss`)."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    """Part of every group name of this trainer process: engines that outlive a trainer (a
    requeued job, a remote service) may still hold the names a previous one used, and torch
    refuses a second group of a name it holds (SGLang's ``init_weights_update_group``)."""


class RolloutSource(Protocol):
    """Rank 0's rollout side, as the training loop uses it."""

    last_judged: "Sequence[tuple[Rollout, JudgeResult | None]]"
    """Every rollout of the last batch with its judge result (for per-sample records)."""

    def next_batch(self, version: int) -> "tuple[list[TrainSample], dict[str, float]]":
        """Judged samples for policy ``version`` (blocks until a batch is ready) and metrics."""

    def weight_target(self) -> WeightTarget:
        """The engines' client and the weight-update group (formed on first use)."""

    def run_sync(self, push: Callable[[], Awaitable[SyncResult]], version: int, *,
                 restart: bool = False) -> SyncResult:
        """Run ``push`` while generation is paused, then serve ``version``. ``restart``: the
        engines just started and nothing generates yet, so push without a version bump."""

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the rollout side's event loop (engine probes)."""

    def probe_metrics(self, step: int) -> dict[str, float]:
        """Measurements due after the sync of ``step`` (a failing probe is counted, not raised)."""

    def identity(self) -> dict[str, Any]:
        """The judge and the engines, for the run manifest."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


MakeRolloutSource = Callable[["Trainer"], RolloutSource]
"""``make_rollout_side(trainer) -> RolloutSource``, called on global rank 0 only."""
