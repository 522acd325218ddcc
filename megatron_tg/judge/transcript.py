"""A text view of a rollout for judging: decoded blocks in order, assistant turns parsed.

Judges work on text, but turn numbering must match the token-level rollout exactly (feedback
is inserted by assistant-turn index), so the view is built segment by segment from the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from megatron_tg.chat.framing import ParsedTurn, ToolCall, ToolCallError, parse_assistant
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

    def render_for_judge(self, max_context_chars: int = 4000) -> str:
        """Human/LLM-readable transcript with numbered assistant turns. Non-assistant blocks
        (system prompt, tool output) are cut in the middle beyond ``max_context_chars``;
        assistant turns are never cut, since they are what is being graded."""
        parts = []
        for b in self.blocks:
            if b.kind == "assistant":
                parts.append(f"=== ASSISTANT TURN {b.turn} ===\n{b.text}")
            else:
                parts.append(f"=== {b.kind.upper()} (context) ===\n{_middle_cut(b.text, max_context_chars)}")
        return "\n\n".join(parts)


def _middle_cut(text: str, limit: int) -> str:
    if limit <= 0 or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"
