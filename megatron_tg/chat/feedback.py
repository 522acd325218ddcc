"""Feedback insertion for the targeted-guidance expert: the feedback as a chat message and the
expert (feedback-conditioned) token sequences built from a student rollout.

Feedback insertion (the expert context, paper §4): the feedback must come *before* the
failing turn's assistant header, so that the failing turn's tokens still follow ``G``::

    student: ... <|im_end|>\\n  [G = <|im_start|>assistant\\n]  turn_k ... <|im_end|>
    expert:  ... <|im_end|>\\n  [F = <|im_start|>user\\n{feedback}<|im_end|>\\n]  [G]  turn_k ...

i.e. ``F`` (the feedback message as the template renders it, role "user" or "system") is
inserted between the preceding segment's body and its trailing ``G``. Equivalently, the
student's ``G`` is replaced by ``F + G``. Consequently, for every assistant token ``i`` the
token before it is the same in both sequences (``pos[i] - 1 == pos[i - 1]``), so
"logits that predict token i" are at ``i - 1`` (student) and ``pos[i] - 1`` (expert).
``F`` is tokenised on its own; it starts with an added token and ends right after the stop
token plus the separator, so the expert ids equal the tokenisation of the rendered
conversation with the feedback message inserted (checked in tests/chat).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from megatron_tg.chat.template import generation_prompt_ids, message_ids
from megatron_tg.rollout.types import FramingError, Rollout, Span

FRAMINGS = ("user", "system")
EXPERT_MODES = ("shared", "exact")


@dataclass
class ExpertSequence:
    """One expert (feedback-conditioned) context for a student rollout."""

    token_ids: list[int]
    position_map: list[int]
    """For every student position i: its position in ``token_ids``, or -1 if truncated away."""
    turns: list[int]
    """Failing assistant turns whose feedback this sequence holds; the KL targets."""
    kl_mask: list[int]
    """Per student token: 1 on the tokens of ``turns`` (where this sequence is the teacher)."""
    feedback_spans: list[Span]
    """Where each inserted feedback message (F) sits in ``token_ids``, in turn order."""


def feedback_message_ids(tokenizer, feedback: str, framing: str = "user") -> list[int]:
    """F: the feedback as a complete message of role ``framing``, rendered by the template."""
    if framing not in FRAMINGS:
        raise ValueError(f"framing must be one of {FRAMINGS}, got {framing!r}")
    if not isinstance(feedback, str) or not feedback.strip():
        raise ValueError(f"feedback must be a non-empty string, got {feedback!r}")
    return message_ids(tokenizer, {"role": framing, "content": feedback})


def insert_feedback(rollout: Rollout, feedback_by_turn: Mapping[int, str], tokenizer,
                    framing: str = "user", *, truncate: bool = True) -> ExpertSequence:
    """Build the ``shared`` expert sequence: every failing turn's feedback inserted right
    before that turn's assistant header (see module docstring), truncated after the last
    failing turn (later tokens get no KL, so the expert forward pass need not see them)."""
    if not feedback_by_turn:
        raise ValueError("feedback_by_turn is empty: a rollout with no failing turn has no expert")
    turns = rollout.assistant_turns()
    for k in feedback_by_turn:
        if not isinstance(k, int) or not 0 <= k < len(turns):
            raise ValueError(f"feedback turn {k!r} out of range: rollout has {len(turns)} turns")
    gen = generation_prompt_ids(tokenizer)
    seg_index = {id(s): i for i, s in enumerate(rollout.segments)}
    inserts: dict[int, list[int]] = {}  # student position -> F ids inserted before it
    for k in sorted(feedback_by_turn):
        seg = turns[k]
        i = seg_index[id(seg)]
        prev = rollout.segments[i - 1]
        g_at = seg.start - len(gen)
        if prev.kind == "assistant" or g_at < prev.start or rollout.token_ids[g_at:seg.start] != gen:
            raise FramingError(f"assistant turn {k} is not preceded by the generation prompt "
                               f"{gen} in segment {i - 1} ({prev.kind})")
        inserts[g_at] = feedback_message_ids(tokenizer, feedback_by_turn[k], framing)
    last = turns[max(feedback_by_turn)]
    n_keep = last.end if truncate else len(rollout.token_ids)

    ids: list[int] = []
    pmap = [-1] * len(rollout.token_ids)
    spans: list[Span] = []
    prev_pos = 0
    for pos in sorted(inserts) + [n_keep]:
        for j in range(prev_pos, pos):
            pmap[j] = len(ids) + (j - prev_pos)
        ids.extend(rollout.token_ids[prev_pos:pos])
        if pos in inserts:
            spans.append(Span(len(ids), len(ids) + len(inserts[pos])))
            ids.extend(inserts[pos])
        prev_pos = pos
    kl_mask = [0] * len(rollout.token_ids)
    for k in feedback_by_turn:
        kl_mask[turns[k].start:turns[k].end] = [1] * (turns[k].end - turns[k].start)
    return ExpertSequence(ids, pmap, sorted(feedback_by_turn), kl_mask, spans)


def build_expert_sequences(rollout: Rollout, feedback_by_turn: Mapping[int, str], tokenizer,
                           mode: str = "shared", framing: str = "user") -> list[ExpertSequence]:
    """``shared``: one sequence with all failing turns' feedback (one extra forward pass; later
    failing turns also see earlier feedback). ``exact``: one sequence per failing turn holding
    only its own feedback, truncated after that turn (the paper's mu(.|s_t, f_t) exactly)."""
    if mode not in EXPERT_MODES:
        raise ValueError(f"mode must be one of {EXPERT_MODES}, got {mode!r}")
    if not feedback_by_turn:
        return []
    if mode == "shared":
        return [insert_feedback(rollout, feedback_by_turn, tokenizer, framing)]
    return [insert_feedback(rollout, {k: feedback_by_turn[k]}, tokenizer, framing)
            for k in sorted(feedback_by_turn)]
