"""Agent transcripts (JSONL) -> token ids and a loss mask, framed exactly like rollouts.

Each line is ``{"messages": [...], "tools": [...]}`` (``tools`` optional). A transcript is
turned into the rollout an engine would have produced for it
(:func:`megatron_tg.chat.builder.simulate_rollout`): the prompt, each assistant turn as the
model generates it (through its stop token), and the template's own text for tool results
and user messages in between. So SFT trains on the token sequence RL later samples and
trains on, and the loss covers exactly the assistant tokens. Thinking (``reasoning_content``)
is part of the turn; where the template drops it (Qwen3-Coder's own, a non-thinking model),
it is written as ``<think>...</think>`` at the start of the turn
(:func:`megatron_tg.chat.template.fold_reasoning`): the thinking base the paper starts from.

Bad lines are refused with the file, line and reason; nothing is silently skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from megatron_tg.chat.builder import simulate_rollout

_KEYS = {"messages", "tools"}


class TranscriptError(ValueError):
    """A transcript line that cannot be trained on; the message names file, line and reason."""


@dataclass
class SFTExample:
    token_ids: list[int]
    loss_mask: list[int]
    """1 on assistant tokens (the ones the model would have generated), else 0."""
    source: str
    """``file:line`` of the transcript."""


def transcript_example(tokenizer, record, source: str, max_tokens: int) -> SFTExample:
    if not isinstance(record, dict):
        raise TranscriptError(f"{source}: expected an object with 'messages', got {type(record).__name__}")
    unknown = sorted(set(record) - _KEYS)
    if unknown:
        raise TranscriptError(f"{source}: unknown field(s) {unknown} (allowed: {sorted(_KEYS)})")
    messages, tools = record.get("messages"), record.get("tools")
    if not isinstance(messages, list) or not messages:
        raise TranscriptError(f"{source}: 'messages' must be a non-empty list, got {messages!r:.80}")
    if tools is not None and not isinstance(tools, list):
        raise TranscriptError(f"{source}: 'tools' must be a list, got {tools!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise TranscriptError(f"{source}: message {i}: needs a role of system/user/assistant/"
                                  f"tool, got {m!r:.80}")
        if m["role"] != "assistant" and not isinstance(m.get("content"), str):
            raise TranscriptError(f"{source}: message {i} ({m['role']}): 'content' must be a "
                                  f"string, got {m.get('content')!r:.80}")
    if not any(m["role"] == "assistant" for m in messages):
        raise TranscriptError(f"{source}: no assistant message: nothing to train on")
    if messages[0]["role"] == "assistant":
        raise TranscriptError(f"{source}: the first message is an assistant turn: it needs a prompt")
    try:
        ro = simulate_rollout(tokenizer, messages, tools=tools, task_id=source)
    except Exception as exc:  # the template's and the framing's own errors, with their reason
        raise TranscriptError(f"{source}: cannot be framed: {type(exc).__name__}: {exc}") from exc
    if len(ro.token_ids) > max_tokens:
        raise TranscriptError(f"{source}: {len(ro.token_ids)} tokens, more than model.seq_length="
                              f"{max_tokens}")
    return SFTExample(ro.token_ids, ro.assistant_mask(), source)


def load_transcripts(path: str | os.PathLike, tokenizer, max_tokens: int) -> list[SFTExample]:
    out: list[SFTExample] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            source = f"{path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TranscriptError(f"{source}: not JSON: {exc}") from exc
            out.append(transcript_example(tokenizer, record, source, max_tokens))
    if not out:
        raise TranscriptError(f"{path}: no transcripts")
    return out
