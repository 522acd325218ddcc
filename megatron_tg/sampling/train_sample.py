"""The rollout side's product: one judged rollout, ready to train on (:class:`TrainSample`).

The rollout side builds it (:func:`megatron_tg.sampling.rollouts.judged_samples`, the
service's :func:`~megatron_tg.sampling.service.wire.decode_batch`); the trainer consumes it
(:func:`megatron_tg.train.batching.build_micro_batch`). It lives in a module of its own below
``train`` in the layer order (docs/architecture.md) so that both sides import it without the
trainer importing the rollout machinery: it needs only the rollout data model and the
hinted turns' data (:mod:`megatron_tg.sampling.hinted`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_tg.rollout.types import Rollout
from megatron_tg.sampling.hinted import HintedTurn


@dataclass
class TrainSample:
    """One judged rollout, ready to train on."""

    rollout: Rollout
    advantage: float
    feedback_by_turn: dict[int, str] = field(default_factory=dict)
    """Assistant-turn index -> feedback text: the turns that get an expert (and a KL gate)."""
    reward: float | None = None
    """The scalar reward the advantage was computed from (for the per-sample records)."""
    hinted: list[HintedTurn] = field(default_factory=list)
    """Samples of failing turns drawn with their feedback in context (``objective.hinted_samples``,
    :mod:`megatron_tg.sampling.hinted`): KL-only sequences of this rollout."""

    @property
    def num_tokens(self) -> int:
        """Student tokens this sample packs: the rollout and its hinted sequences."""
        n = len(self.rollout.token_ids)
        if self.hinted:
            starts = [seg.start for seg in self.rollout.assistant_turns()]
            n += sum(starts[h.turn] + len(h.token_ids) for h in self.hinted)
        return n
