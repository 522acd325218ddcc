"""Feedback in the agent loop, for vetting: a rollout context whose engine requests carry the
framed feedback message F before the generation prompt of the targeted turns, and the recorded
turns of a rollout replayed as engine answers (the branched final-turn design of
:mod:`megatron_tg.judge.vetting`)."""

from __future__ import annotations

from typing import Any, Sequence

from megatron_tg.rollout.context import TurnOutput
from megatron_tg.rollout.types import FramingError, Rollout


class FeedbackContext:
    """A rollout context whose engine requests carry the feedback message.

    The agent loop calls ``generate(ids)`` with its own (student) context, which always ends
    with the generation prompt G of the turn to generate and always extends the previous
    request plus its output. Turn k's insertion point is just before that G. Turns before
    ``start_turn`` are not targeted; turns listed in ``replay`` are answered from the
    recording (no engine call). Everything else is delegated to ``inner``.
    """

    def __init__(self, inner, feedback_ids: Sequence[int], gen_prompt_ids: Sequence[int], *,
                 start_turn: int = 0, persist: bool = True,
                 replay: Sequence[tuple[list[int], TurnOutput]] = ()):
        self.inner = inner
        self.feedback_ids = list(feedback_ids)
        self.gen = list(gen_prompt_ids)
        self.start_turn = int(start_turn)
        self.persist = bool(persist)
        self.replay = list(replay)
        self.points: list[int] = []     # insertion point of each turn so far (student positions)
        self.requests: list[list[int]] = []  # what the engine was sent (diagnostics, tests)
        self.replay_mismatches = 0
        self._prev: list[int] | None = None

    def __getattr__(self, name: str) -> Any:  # task, group_id, rollout_id, version, ...
        if name == "inner":  # not set yet (e.g. during copy): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def engine_context(self, ids: Sequence[int], turn: int) -> list[int]:
        """``ids`` with F inserted at the insertion points of the targeted turns <= ``turn``."""
        active = [p for j, p in enumerate(self.points[:turn + 1])
                  if j >= self.start_turn and (self.persist or j == turn)]
        out: list[int] = []
        prev = 0
        for p in active:
            out += list(ids[prev:p]) + self.feedback_ids
            prev = p
        return out + list(ids[prev:])

    async def generate(self, input_ids: Sequence[int], max_new_tokens: int | None = None,
                       **kw: Any) -> TurnOutput:
        ids = [int(t) for t in input_ids]
        if len(ids) < len(self.gen) or ids[len(ids) - len(self.gen):] != self.gen:
            raise FramingError("the agent loop's context does not end with the generation prompt")
        if self._prev is not None and ids[:len(self._prev)] != self._prev:
            raise FramingError("the agent loop's context does not extend the previous turn")
        turn = len(self.points)
        self.points.append(len(ids) - len(self.gen))
        if turn < len(self.replay):
            expected, out = self.replay[turn]
            if ids != expected:  # e.g. a tool whose output is not deterministic
                self.replay_mismatches += 1
            self._prev = ids + list(out.ids)
            return out
        ctx = self.engine_context(ids, turn)
        self.requests.append(ctx)
        out = await self.inner.generate(ctx, max_new_tokens=max_new_tokens, **kw)
        self._prev = ids + list(out.ids)
        return out


def replay_turns(rollout: Rollout, n: int) -> list[tuple[list[int], TurnOutput]]:
    """The first ``n`` assistant turns of ``rollout`` as recorded engine answers, each with the
    context it was generated from."""
    out = []
    for seg in rollout.assistant_turns()[:n]:
        v = int(seg.policy_version or 0)
        out.append((rollout.token_ids[:seg.start],
                    TurnOutput(rollout.token_ids[seg.start:seg.end], list(seg.logprobs or []), v,
                               [v], str(seg.meta.get("finish", "stop")))))
    return out
