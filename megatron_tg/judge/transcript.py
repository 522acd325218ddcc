"""A text view of a rollout for judging: decoded blocks in order, assistant turns parsed.

Judges work on text, but turn numbering must match the token-level rollout exactly (feedback
is inserted by assistant-turn index), so the view is built segment by segment from the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from megatron_tg.chat.parsing import ParsedTurn, ToolCall, ToolCallError, parse_assistant
from megatron_tg.rollout.types import Rollout


@dataclass
class TurnView:
    index: int
    raw: str
    """The decoded turn (thinking, content and tool calls), stop token removed."""
    parsed: ParsedTurn

    @property
    def content(self) -> str:
        return self.parsed.content

    @property
    def thinking(self) -> str:
        return self.parsed.thinking or ""

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.parsed.tool_calls

    @property
    def tool_call_errors(self) -> list[ToolCallError]:
        return self.parsed.errors


@dataclass
class Block:
    kind: str  # a rollout segment kind: prompt / assistant / tool / user
    text: str
    turn: int | None = None


@dataclass
class Transcript:
    blocks: list[Block]
    turns: list[TurnView]
    metadata: dict[str, Any] = field(default_factory=dict)
    rollout_id: str = ""
    task_id: str = ""
    group_id: str = ""
    finish_reason: str = "stop"
    """How the rollout ended (:data:`megatron_tg.rollout.types.FINISH_REASONS`). Anything but
    "stop" means the agent did not end on its own, so its last turn is not a final answer."""

    @property
    def ended_by_agent(self) -> bool:
        return self.finish_reason == "stop"

    @property
    def last_turn(self) -> TurnView | None:
        return self.turns[-1] if self.turns else None

    @classmethod
    def from_rollout(cls, rollout: Rollout, tokenizer, reading: str = "strict") -> "Transcript":
        """``reading``: how tool calls are read (:mod:`megatron_tg.chat.tool_reading`); the
        harness that ran the rollout must have read them the same way."""
        blocks: list[Block] = []
        turns: list[TurnView] = []
        eos = tokenizer.eos_token
        for seg in rollout.segments:
            text = tokenizer.decode(rollout.token_ids[seg.start:seg.end], skip_special_tokens=False)
            if seg.kind == "assistant":
                parsed = parse_assistant(text, stop_tokens=(eos,) if eos else (), reading=reading)
                raw = text[: -len(eos)] if eos and text.endswith(eos) else text
                turns.append(TurnView(len(turns), raw, parsed))
                blocks.append(Block("assistant", raw, turns[-1].index))
            else:
                blocks.append(Block(seg.kind, text))
        return cls(blocks, turns, dict(rollout.metadata), rollout.rollout_id, rollout.task_id,
                   rollout.group_id, rollout.finish_reason)

    @classmethod
    def from_assistant_texts(cls, texts: Sequence[str], *, context: Sequence[str] | None = None,
                             metadata: dict[str, Any] | None = None, task_id: str = "task",
                             rollout_id: str = "") -> "Transcript":
        """Build from raw assistant turn texts (Qwen3-Coder format), e.g. in tests or for
        judging transcripts that were not produced by the engine. ``context[i]`` (optional) is
        the text shown before turn i (prompt / tool results)."""
        blocks, turns = [], []
        for i, t in enumerate(texts):
            if context is not None and i < len(context) and context[i]:
                blocks.append(Block("prompt" if i == 0 else "tool", context[i]))
            turns.append(TurnView(i, t, parse_assistant(t)))
            blocks.append(Block("assistant", t, i))
        return cls(blocks, turns, dict(metadata or {}), rollout_id, task_id, task_id)

    def text(self) -> str:
        """The whole transcript as one string (block texts joined by blank lines)."""
        return "\n\n".join(b.text for b in self.blocks)

    def render_for_judge(self, max_context_chars: int = 4000,
                         budget_chars: int | None = None) -> str:
        """Human/LLM-readable transcript with numbered assistant turns (see
        :meth:`render_within`, which also says what was cut)."""
        return self.render_within(max_context_chars, budget_chars)[0]

    def render_within(self, max_context_chars: int = 4000,
                      budget_chars: int | None = None) -> tuple[str, list[int]]:
        """The rendered transcript and the assistant turns left out to fit ``budget_chars``.

        Non-assistant blocks (system prompt, tool output) are cut in the middle beyond
        ``max_context_chars``. When the whole still exceeds ``budget_chars``, the middle of the
        transcript goes: the first block (the task) and as many of the last blocks as fit
        are kept, and one marker says which assistant turns and how many characters were
        omitted; the final turn is always shown (cut in its middle only if it alone exceeds
        the budget). Assistant turns are otherwise never cut: they are what is graded."""
        parts, turns = [], []
        for b in self.blocks:
            if b.kind == "assistant":
                parts.append(f"=== ASSISTANT TURN {b.turn} ===\n{b.text}")
            else:
                parts.append(f"=== {b.kind.upper()} (context) ===\n"
                             f"{_middle_cut(b.text, max_context_chars)}")
            turns.append(b.turn if b.kind == "assistant" else None)
        sep = "\n\n"
        total = sum(len(p) for p in parts) + len(sep) * max(len(parts) - 1, 0)
        if budget_chars is None or total <= budget_chars or len(parts) <= 2:
            if budget_chars is not None and total > budget_chars:
                parts = [_middle_cut(p, max(budget_chars // len(parts) - 100, 200)) for p in parts]
            return sep.join(parts), []
        marker_room = 200
        head = parts[0]
        room = budget_chars - len(head) - marker_room - 2 * len(sep)
        keep_from = len(parts) - 1  # the last block always stays
        used = len(parts[-1])
        while keep_from - 1 > 0 and used + len(sep) + len(parts[keep_from - 1]) <= room:
            keep_from -= 1
            used += len(sep) + len(parts[keep_from])
        omitted = parts[1:keep_from]
        omitted_turns = [t for t in turns[1:keep_from] if t is not None]
        tail = parts[keep_from:]
        if used > room:  # the last block alone is too long: cut its middle
            tail = [_middle_cut(tail[0], max(room, 500))] + tail[1:]
        chars = sum(len(p) for p in omitted)
        which = (f"assistant turns {omitted_turns[0]}-{omitted_turns[-1]}" if len(omitted_turns) > 1
                 else f"assistant turn {omitted_turns[0]}" if omitted_turns else "no assistant turn")
        marker = (f"=== [OMITTED to fit the judge's budget: {len(omitted)} blocks ({which}), "
                  f"{chars} characters] ===")
        return sep.join([head, marker, *tail]), omitted_turns


def _middle_cut(text: str, limit: int) -> str:
    if limit <= 0 or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"
