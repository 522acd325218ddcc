"""Turn parsing: a generated assistant turn split into thinking, content and Qwen3-Coder XML tool
calls (:func:`parse_assistant`, on the text), and the token spans of its thinking block and
tool calls (:func:`assistant_token_spans`, on the ids)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from megatron_tg.chat.template import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN, template_info
from megatron_tg.chat.tool_reading import AMBIGUOUS_IN_VALUE, READINGS, sglang_read
from megatron_tg.rollout.types import Span


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, str | None]
    """Parameter values as the raw strings between the tags (one leading/trailing newline
    removed); typing them against the tool schema is the harness's job. Under the "sglang"
    reading a value the model wrote as ``null`` is None, as SGLang reads it."""
    start: int
    end: int  # character offsets of <tool_call>...</tool_call> in the parsed text

    def to_message(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclass
class ToolCallError:
    message: str
    raw: str
    start: int
    end: int
    name: str | None = None  # the function name, when it could be read


@dataclass
class ParsedTurn:
    thinking: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)
    terminated: bool = True
    """False when the text lacks the stop token (generation cut by a length limit)."""

    def to_message(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.thinking is not None:
            m["reasoning_content"] = self.thinking
        if self.tool_calls:
            m["tool_calls"] = [c.to_message() for c in self.tool_calls]
        return m


_FUNC_RE = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*\Z", re.S)
_OPEN_FUNC_RE = re.compile(r"\s*<function=([^>\n]*)>")
"""The opening tag of a call's function (its name read even when the call never closes)."""
_PARAM_RE = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)
_NAME_RE = re.compile(r"[A-Za-z_][\w.\-]*\Z")


def parse_assistant(text: str, stop_tokens: Sequence[str] = ("<|im_end|>", "<|endoftext|>"),
                    *, reading: str = "strict") -> ParsedTurn:
    """Split a generated turn into thinking / content / Qwen3-Coder XML tool calls.

    Never raises: malformed or unterminated calls become :class:`ToolCallError` entries (their
    text is not part of ``content``). ``<think>`` is recognised only at the start of the turn;
    a ``</think>`` without an opening tag is also accepted (templates that pre-fill ``<think>``).
    ``reading``: "strict" or "sglang", see :mod:`megatron_tg.chat.tool_reading`.
    """
    if reading not in READINGS:
        raise ValueError(f"reading must be one of {READINGS}, got {reading!r}")
    terminated = False
    for st in stop_tokens:
        if text.endswith(st):
            text, terminated = text[: -len(st)], True
            break
    thinking, body_start = None, 0
    errors: list[ToolCallError] = []
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        open_at = len(text) - len(stripped)
        close = text.find(THINK_CLOSE, open_at)
        if close < 0:
            thinking, body_start = text[open_at + len(THINK_OPEN):].strip(), len(text)
        else:
            thinking = text[open_at + len(THINK_OPEN):close].strip()
            body_start = close + len(THINK_CLOSE)
    elif THINK_CLOSE in text and CALL_OPEN not in text[: text.find(THINK_CLOSE)]:
        close = text.find(THINK_CLOSE)
        thinking, body_start = text[:close].strip(), close + len(THINK_CLOSE)

    if reading == "sglang":
        return _sglang_turn(text, body_start, thinking, terminated)
    calls: list[ToolCall] = []
    content_parts: list[str] = []
    pos = body_start
    while True:
        o = text.find(CALL_OPEN, pos)
        stray = text.find(CALL_CLOSE, pos)
        if stray >= 0 and (o < 0 or stray < o):  # a closing tag with no opening tag
            content_parts.append(text[pos:stray])
            errors.append(ToolCallError(f"{CALL_CLOSE} without {CALL_OPEN}", CALL_CLOSE, stray,
                                        stray + len(CALL_CLOSE)))
            pos = stray + len(CALL_CLOSE)
            continue
        if o < 0:
            content_parts.append(text[pos:])
            break
        content_parts.append(text[pos:o])
        c = text.find(CALL_CLOSE, o + len(CALL_OPEN))
        nxt = text.find(CALL_OPEN, o + len(CALL_OPEN))
        if c < 0 or (0 <= nxt < c):
            end = nxt if nxt >= 0 else len(text)  # an unterminated call ends at the next one
            # The function name, when the call got that far: a call cut by the token limit is
            # still a (failed) call to that tool, and a judge's format criterion must see it.
            m = _OPEN_FUNC_RE.match(text, o + len(CALL_OPEN), end)
            name = m.group(1).strip() if m and _NAME_RE.match(m.group(1).strip()) else None
            errors.append(ToolCallError(f"unterminated {CALL_OPEN}", text[o:end], o, end, name))
            pos = end
            if end == len(text):
                break
            continue
        end = c + len(CALL_CLOSE)
        call = _parse_call(text[o + len(CALL_OPEN):c], o, end)
        (calls if isinstance(call, ToolCall) else errors).append(call)
        pos = end
    content = "".join(content_parts).strip()
    return ParsedTurn(thinking, content, calls, errors, terminated)


def _sglang_turn(text: str, body_start: int, thinking: str | None, terminated: bool) -> ParsedTurn:
    content, read, unread = sglang_read(text[body_start:])
    calls = [ToolCall(name, args, body_start + s, body_start + e) for name, args, s, e in read]
    errors = [ToolCallError("SGLang's qwen3_coder detector reads no call from this block",
                            text[body_start + s:body_start + e], body_start + s, body_start + e)
              for s, e in unread]
    return ParsedTurn(thinking, content, calls, errors, terminated)


def _parse_call(inner: str, start: int, end: int) -> ToolCall | ToolCallError:
    raw = CALL_OPEN + inner + CALL_CLOSE
    m = _FUNC_RE.match(inner)
    if not m:
        return ToolCallError("expected <function=NAME>...</function> inside <tool_call>", raw, start, end)
    name, body = m.group(1).strip(), m.group(2)
    if not _NAME_RE.match(name):
        return ToolCallError(f"invalid function name {name!r}", raw, start, end)
    args: dict[str, str] = {}
    last = 0
    for pm in _PARAM_RE.finditer(body):
        gap = body[last:pm.start()]
        if gap.strip():
            return ToolCallError(f"unexpected text {gap.strip()[:40]!r} between parameters",
                                 raw, start, end, name)
        pname = pm.group(1).strip()
        if not _NAME_RE.match(pname):
            return ToolCallError(f"invalid parameter name {pname!r}", raw, start, end, name)
        if pname in args:
            return ToolCallError(f"duplicate parameter {pname!r}", raw, start, end, name)
        value = pm.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        markup = next((m for m in AMBIGUOUS_IN_VALUE if m in value), None)
        if markup is not None:  # SGLang would read it as structure: not one meaning
            return ToolCallError(f"value of parameter {pname!r} contains {markup!r}, which "
                                 "SGLang's parser reads as a new tag", raw, start, end, name)
        args[pname] = value
        last = pm.end()
    tail = body[last:]
    if tail.strip():
        return ToolCallError(f"unexpected text {tail.strip()[:40]!r} after parameters",
                             raw, start, end, name)
    return ToolCall(name, args, start, end)


def assistant_token_spans(tokenizer, ids: Sequence[int], offset: int = 0) -> tuple[Span | None, list[Span]]:
    """Token spans of the thinking block and of each tool call in a generated turn.

    Spans include the tags and are shifted by ``offset`` (the turn's start in the rollout).
    Mirrors :func:`parse_assistant`: thinking only at the start of the turn; tool calls only
    after it; an unterminated block runs to the end of the turn (before the stop token).
    """
    info = template_info(tokenizer)
    t = info["tags"]
    ids = list(ids)
    n = len(ids) - 1 if ids and ids[-1] == info["eos_id"] else len(ids)
    thinking = None
    pos = 0
    first_real = 0
    while first_real < n and not tokenizer.decode([ids[first_real]]).strip():
        first_real += 1  # leading whitespace tokens before <think>
    if first_real < n and ids[first_real] == t[THINK_OPEN]:
        close = _index(ids, t[THINK_CLOSE], first_real + 1, n)
        end = n if close < 0 else close + 1
        thinking, pos = Span(offset + first_real, offset + end), end
    else:
        close = _index(ids, t[THINK_CLOSE], 0, n)
        if close >= 0 and _index(ids, t[CALL_OPEN], 0, close) < 0:
            thinking, pos = Span(offset, offset + close + 1), close + 1
    calls: list[Span] = []
    while True:
        o = _index(ids, t[CALL_OPEN], pos, n)
        if o < 0:
            break
        c = _index(ids, t[CALL_CLOSE], o + 1, n)
        nxt = _index(ids, t[CALL_OPEN], o + 1, n)
        end = (n if nxt < 0 else nxt) if c < 0 or (0 <= nxt < c) else c + 1
        calls.append(Span(offset + o, offset + end))
        pos = end
    return thinking, calls


def _index(ids: list[int], tok: int, lo: int, hi: int) -> int:
    for i in range(lo, hi):
        if ids[i] == tok:
            return i
    return -1
