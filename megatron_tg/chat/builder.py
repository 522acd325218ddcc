"""Building token-exact rollouts turn by turn (the agent harness's side of the framing).

Typical harness loop::

    b = RolloutBuilder(tok, [system, user], tools=tools, task_id=..., group_id=...)
    while True:
        out = engine.generate(b.token_ids)                  # ids + log-probs + weight version
        parsed = b.add_assistant(out.ids, out.logprobs, out.version)
        if not parsed.tool_calls: break
        b.add_messages([{"role": "tool", "content": run(c)} for c in parsed.tool_calls])
    rollout = b.build("stop", metadata={"tests_passed": ...})

:func:`simulate_rollout` drives the same builder from a plain message list, rendering each
assistant message as the model would have generated it; tests use it to get realistic
multi-turn rollouts without a model.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from megatron_tg.chat.parsing import ParsedTurn, assistant_token_spans, parse_assistant
from megatron_tg.chat.template import (
    assistant_generation_text,
    continuation_ids,
    encode,
    normalize_messages,
    prompt_ids,
    stop_token_id,
)
from megatron_tg.rollout.types import FramingError, Rollout, Segment


class RolloutBuilder:
    def __init__(self, tokenizer, messages: Sequence[Mapping[str, Any]], *, tools: list | None = None,
                 task_id: str, group_id: str | None = None, rollout_id: str = "",
                 metadata: dict[str, Any] | None = None, tool_call_reading: str = "strict"):
        if not messages or any(m["role"] == "assistant" for m in messages):
            raise FramingError("the prompt must be non-empty and contain no assistant message")
        self.tokenizer = tokenizer
        self.tools = tools
        self.tool_call_reading = tool_call_reading  # chat/tool_reading.py; the judge reads alike
        self.history = normalize_messages(messages)
        self.task_id, self.group_id, self.rollout_id = task_id, group_id or task_id, rollout_id
        self.metadata = dict(metadata or {})
        ids = prompt_ids(tokenizer, self.history, tools)
        self._ids: list[int] = list(ids)
        self.segments: list[Segment] = [Segment("prompt", 0, len(ids))]
        self.parsed: list[ParsedTurn] = []
        self._eos = stop_token_id(tokenizer)

    @property
    def token_ids(self) -> list[int]:
        """The context to send to the engine next (a copy)."""
        return list(self._ids)

    def add_assistant(self, ids: Sequence[int], logprobs: Sequence[float], policy_version: int,
                      meta: dict[str, Any] | None = None) -> ParsedTurn:
        """Append one generated turn exactly as the engine produced it; returns its parse."""
        if self.segments[-1].kind == "assistant":
            raise FramingError("two assistant turns in a row: append tool/user messages first")
        ids = list(ids)
        if not ids:
            raise FramingError("empty assistant turn")
        start = len(self._ids)
        thinking, calls = assistant_token_spans(self.tokenizer, ids, offset=start)
        self._ids.extend(ids)
        self.segments.append(Segment("assistant", start, len(self._ids), logprobs=list(logprobs),
                                     policy_version=policy_version, thinking=thinking,
                                     tool_calls=calls, meta=dict(meta or {})))
        parsed = parse_assistant(self.tokenizer.decode(ids, skip_special_tokens=False),
                                 stop_tokens=(self.tokenizer.eos_token,),
                                 reading=self.tool_call_reading)
        self.parsed.append(parsed)
        self.history.append(parsed.to_message())
        return parsed

    def add_messages(self, messages: Sequence[Mapping[str, Any]], *, close_turn: bool = False,
                     meta: dict[str, Any] | None = None) -> list[int]:
        """Append tool results / user messages and the next generation prompt.

        If the last turn did not end with the stop token (cut by a length limit) the template
        context is broken; pass ``close_turn=True`` to prepend the stop token to this (untrained)
        segment, otherwise FramingError.
        """
        last = self.segments[-1]
        if last.kind != "assistant":
            raise FramingError("messages can only follow an assistant turn")
        ids = continuation_ids(self.tokenizer, messages, history=self.history, tools=self.tools)
        if self._ids[-1] != self._eos:
            if not close_turn:
                raise FramingError("the last assistant turn did not end with the stop token; "
                                   "pass close_turn=True to close it")
            ids = [self._eos] + ids
        new = normalize_messages(messages)
        kind = "tool" if all(m["role"] == "tool" for m in new) else "user"
        start = len(self._ids)
        self._ids.extend(ids)
        self.segments.append(Segment(kind, start, len(self._ids), meta=dict(meta or {})))
        self.history.extend(new)
        return ids

    def build(self, finish_reason: str = "stop", metadata: dict[str, Any] | None = None) -> Rollout:
        md = {**self.metadata, **(metadata or {})}
        return Rollout(task_id=self.task_id, group_id=self.group_id, token_ids=list(self._ids),
                       segments=[Segment(**vars(s)) for s in self.segments],
                       finish_reason=finish_reason, rollout_id=self.rollout_id,
                       metadata=md).validate()


def fake_logprobs(ids: Sequence[int]) -> list[float]:
    """Deterministic, plausible log-probs for simulated turns."""
    return [-0.05 - 0.1 * (t % 7) for t in ids]


def simulate_rollout(tokenizer, messages: Sequence[Mapping[str, Any]], *, tools: list | None = None,
                     task_id: str = "task-0", group_id: str | None = None, rollout_id: str = "",
                     policy_version: int | Sequence[int] = 0, finish_reason: str = "stop",
                     metadata: dict[str, Any] | None = None,
                     logprob_fn: Callable[[Sequence[int]], list[float]] = fake_logprobs) -> Rollout:
    """Turn a chat transcript into the rollout an engine would have produced for it.

    Messages before the first assistant message form the prompt; each assistant message
    becomes a generated turn (its template rendering after the generation prompt, through the
    stop token); runs of other messages become tool/user segments.
    """
    msgs = normalize_messages(messages)
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    b = RolloutBuilder(tokenizer, msgs[:first], tools=tools, task_id=task_id, group_id=group_id,
                       rollout_id=rollout_id, metadata=metadata)
    k, i = 0, first
    while i < len(msgs):
        if msgs[i]["role"] == "assistant":
            ids = encode(tokenizer, assistant_generation_text(tokenizer, msgs[i]))
            v = policy_version if isinstance(policy_version, int) else policy_version[k]
            b.add_assistant(ids, logprob_fn(ids), v)
            k, i = k + 1, i + 1
        else:
            j = i
            while j < len(msgs) and msgs[j]["role"] != "assistant":
                j += 1
            b.add_messages(msgs[i:j])
            i = j
    return b.build(finish_reason)
