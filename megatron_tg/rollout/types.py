"""Token-exact rollout data model.

A :class:`Rollout` stores exactly the token ids the inference engine saw and produced — never
re-tokenised text — because the trainer must score the same tokens the engine sampled (a
re-tokenisation can merge or split tokens differently, silently shifting log-probs and masks).

Layout: ``token_ids`` is the whole conversation; ``segments`` partition it, in order, with no
gaps or overlaps (``segments[0].start == 0``, each ``start`` equals the previous ``end``, the
last ``end == len(token_ids)``). Segment kinds:

* ``prompt``    — system / tools / first user message + the first generation prompt
  (``<|im_start|>assistant\\n``). Always first, exactly once.
* ``assistant`` — exactly the tokens the engine generated for one agent turn, usually ending
  with the stop token ``<|im_end|>``. Carries one engine log-prob per token, the policy
  (weight) version that generated it, the thinking span and tool-call spans (absolute,
  half-open token ranges inside the segment). Assistant turns are numbered 0, 1, ... in order;
  judges and feedback refer to turns by this index.
* ``tool`` / ``user`` — tokens appended between turns (tool results, user messages) including
  the next generation prompt. Never trained on.

Log-probs are stored per assistant segment (``len(logprobs) == end - start``) so a turn's data
stays together; :meth:`Rollout.logprobs_per_token` gives the flat, position-aligned view.

Files of rollouts (JSON Lines) are :mod:`megatron_tg.rollout.jsonl`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from megatron_tg.rollout.errors import FramingError, RolloutFormatError  # noqa: F401 (re-exported)
from megatron_tg.rollout.routed_experts import RoutedExperts

FORMAT_VERSION = 1
SEGMENT_KINDS = ("prompt", "assistant", "tool", "user")
FINISH_REASONS = ("stop", "length", "max_turns", "timeout", "error", "abort")
"""stop: the agent ended on its own; length: token budget hit (the last turn may lack the stop
token); max_turns: turn budget hit; timeout: wall-clock budget; error: harness/environment
failure; abort: cancelled (e.g. weights updated mid-rollout and the caller chose to drop it)."""

# Engines report log-probs in float32 and sometimes round a certain token to a hair above 0.
LOGPROB_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Span:
    """Half-open token range ``[start, end)`` in absolute positions of ``Rollout.token_ids``."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    def to_json(self) -> list[int]:
        return [self.start, self.end]

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "Span":
        if (not isinstance(obj, (list, tuple)) or len(obj) != 2
                or not all(_is_int(x) for x in obj)):
            raise RolloutFormatError(where, f"expected [start, end] integers, got {obj!r}")
        return cls(int(obj[0]), int(obj[1]))


@dataclass
class Segment:
    kind: str
    start: int
    end: int
    logprobs: list[float] | None = None
    """assistant only: the engine's log-prob of each generated token."""
    policy_version: int | None = None
    """assistant only: version of the weights that generated this turn (async staleness). A
    turn resumed after a mid-generation weight update spans several versions: record the
    OLDEST (staleness filters must see the worst case); per-token log-probs stay exact anyway."""
    thinking: Span | None = None
    """assistant only: the ``<think>...</think>`` tokens, tags included."""
    tool_calls: list[Span] = field(default_factory=list)
    """assistant only: each ``<tool_call>...</tool_call>``, tags included, in order."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form per-segment data (e.g. tool name, exit code, engine request id)."""

    @property
    def span(self) -> Span:
        return Span(self.start, self.end)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "start": self.start, "end": self.end}
        if self.logprobs is not None:
            d["logprobs"] = list(self.logprobs)
        if self.policy_version is not None:
            d["policy_version"] = self.policy_version
        if self.thinking is not None:
            d["thinking"] = self.thinking.to_json()
        if self.tool_calls:
            d["tool_calls"] = [s.to_json() for s in self.tool_calls]
        if self.meta:
            d["meta"] = self.meta
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "Segment":
        if not isinstance(d, dict):
            raise RolloutFormatError(where, f"expected an object, got {type(d).__name__}")
        _check_keys(d, required=("kind", "start", "end"),
                    optional=("logprobs", "policy_version", "thinking", "tool_calls", "meta"),
                    where=where)
        lp = d.get("logprobs")
        if lp is not None and not isinstance(lp, list):
            raise RolloutFormatError(f"{where}.logprobs", "expected a list")
        tc = d.get("tool_calls", [])
        if not isinstance(tc, list):
            raise RolloutFormatError(f"{where}.tool_calls", "expected a list")
        return cls(
            kind=d["kind"], start=d["start"], end=d["end"],
            logprobs=None if lp is None else list(lp),
            policy_version=d.get("policy_version"),
            thinking=(Span.from_json(d["thinking"], f"{where}.thinking")
                      if d.get("thinking") is not None else None),
            tool_calls=[Span.from_json(s, f"{where}.tool_calls[{i}]") for i, s in enumerate(tc)],
            meta=d.get("meta", {}),
        )


@dataclass
class Rollout:
    task_id: str
    group_id: str
    """GRPO group: rollouts of the same prompt whose rewards are compared with each other."""
    token_ids: list[int]
    segments: list[Segment]
    finish_reason: str
    rollout_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form, JSON-able; e.g. hidden-test results read by the ``tests_pass`` checker."""
    routed_experts: "RoutedExperts | None" = None
    """The engine's expert choice per token (routing replay; see
    :mod:`megatron_tg.rollout.routed_experts`), or None."""

    # ------------------------------------------------------------------ structure helpers
    def assistant_turns(self) -> list[Segment]:
        return [s for s in self.segments if s.kind == "assistant"]

    @property
    def num_turns(self) -> int:
        return sum(1 for s in self.segments if s.kind == "assistant")

    def turn(self, k: int) -> Segment:
        turns = self.assistant_turns()
        if not -len(turns) <= k < len(turns):
            raise IndexError(f"assistant turn {k} out of range ({len(turns)} turns)")
        return turns[k]

    def assistant_mask(self) -> list[int]:
        """1 on tokens the engine generated (all assistant turns), else 0."""
        return self._mask(lambda s: [s.span])

    def thinking_mask(self) -> list[int]:
        return self._mask(lambda s: [s.thinking] if s.thinking is not None else [])

    def tool_call_mask(self) -> list[int]:
        return self._mask(lambda s: s.tool_calls)

    def turn_index_per_token(self) -> list[int]:
        """Assistant turn index of each token, -1 on prompt / tool / user tokens."""
        out = [-1] * len(self.token_ids)
        for k, seg in enumerate(self.assistant_turns()):
            out[seg.start:seg.end] = [k] * (seg.end - seg.start)
        return out

    def logprobs_per_token(self, fill: float = 0.0) -> list[float]:
        """Engine log-probs aligned with ``token_ids``; ``fill`` where nothing was generated."""
        out = [fill] * len(self.token_ids)
        for seg in self.assistant_turns():
            out[seg.start:seg.end] = list(seg.logprobs or [])
        return out

    def policy_version_per_token(self, fill: int = -1) -> list[int]:
        out = [fill] * len(self.token_ids)
        for seg in self.assistant_turns():
            out[seg.start:seg.end] = [seg.policy_version] * (seg.end - seg.start)
        return out

    def _mask(self, spans_of) -> list[int]:
        out = [0] * len(self.token_ids)
        for seg in self.assistant_turns():
            for sp in spans_of(seg):
                out[sp.start:sp.end] = [1] * (sp.end - sp.start)
        return out

    # ------------------------------------------------------------------ validation
    def validate(self, vocab_size: int | None = None) -> "Rollout":
        """Raise :class:`RolloutFormatError` naming the first malformed field; return self."""
        for name in ("task_id", "group_id"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise RolloutFormatError(name, f"must be a non-empty string, got {v!r}")
        if not isinstance(self.rollout_id, str):
            raise RolloutFormatError("rollout_id", f"must be a string, got {self.rollout_id!r}")
        if self.finish_reason not in FINISH_REASONS:
            raise RolloutFormatError("finish_reason",
                                     f"{self.finish_reason!r} not one of {FINISH_REASONS}")
        if not isinstance(self.metadata, dict) or not all(isinstance(k, str) for k in self.metadata):
            raise RolloutFormatError("metadata", "must be an object with string keys")
        if not isinstance(self.token_ids, list):
            raise RolloutFormatError("token_ids", "must be a list of ints")
        for i, t in enumerate(self.token_ids):
            if not _is_int(t) or t < 0:
                raise RolloutFormatError(f"token_ids[{i}]", f"must be a non-negative int, got {t!r}")
            if vocab_size is not None and t >= vocab_size:
                raise RolloutFormatError(f"token_ids[{i}]", f"id {t} >= vocab_size {vocab_size}")
        n = len(self.token_ids)
        if not isinstance(self.segments, list) or not self.segments:
            raise RolloutFormatError("segments", "must be a non-empty list")
        prev_end = 0
        for i, seg in enumerate(self.segments):
            self._validate_segment(i, seg, prev_end, n)
            prev_end = seg.end
        if prev_end != n:
            raise RolloutFormatError(f"segments[{len(self.segments) - 1}].end",
                                     f"{prev_end} != len(token_ids) {n}: segments must cover "
                                     "every token")
        if self.routed_experts is not None:
            self.routed_experts.validate(n)
        return self

    def _validate_segment(self, i: int, seg: Segment, prev_end: int, n: int) -> None:
        w = f"segments[{i}]"
        if not isinstance(seg, Segment):
            raise RolloutFormatError(w, f"expected a Segment, got {type(seg).__name__}")
        if seg.kind not in SEGMENT_KINDS:
            raise RolloutFormatError(f"{w}.kind", f"{seg.kind!r} not one of {SEGMENT_KINDS}")
        if (i == 0) != (seg.kind == "prompt"):
            raise RolloutFormatError(f"{w}.kind", "the first segment, and only it, must be 'prompt'")
        for name in ("start", "end"):
            if not _is_int(getattr(seg, name)):
                raise RolloutFormatError(f"{w}.{name}", f"must be an int, got {getattr(seg, name)!r}")
        if seg.start != prev_end:
            what = "overlaps the previous segment" if seg.start < prev_end else "leaves a gap"
            raise RolloutFormatError(f"{w}.start", f"{seg.start} != previous end {prev_end} ({what})")
        if seg.end <= seg.start:
            raise RolloutFormatError(f"{w}.end", f"{seg.end} <= start {seg.start} (empty segment)")
        if seg.end > n:
            raise RolloutFormatError(f"{w}.end", f"{seg.end} > len(token_ids) {n} (out of range)")
        if not isinstance(seg.meta, dict):
            raise RolloutFormatError(f"{w}.meta", "must be an object")
        if seg.kind != "assistant":
            for name in ("logprobs", "policy_version", "thinking"):
                if getattr(seg, name) is not None:
                    raise RolloutFormatError(f"{w}.{name}", f"only assistant segments have {name}")
            if seg.tool_calls:
                raise RolloutFormatError(f"{w}.tool_calls", "only assistant segments have tool calls")
            return
        if seg.logprobs is None:
            raise RolloutFormatError(f"{w}.logprobs", "missing (one per generated token)")
        if len(seg.logprobs) != seg.end - seg.start:
            raise RolloutFormatError(f"{w}.logprobs", f"{len(seg.logprobs)} log-probs for "
                                     f"{seg.end - seg.start} generated tokens")
        for j, lp in enumerate(seg.logprobs):
            if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
                raise RolloutFormatError(f"{w}.logprobs[{j}]", f"must be a finite number, got {lp!r}")
            if lp > LOGPROB_TOLERANCE:
                raise RolloutFormatError(f"{w}.logprobs[{j}]", f"log-prob {lp} > 0")
        if not _is_int(seg.policy_version) or seg.policy_version < 0:
            raise RolloutFormatError(f"{w}.policy_version",
                                     f"must be a non-negative int, got {seg.policy_version!r}")
        inner: list[tuple[str, Span]] = []
        if seg.thinking is not None:
            inner.append((f"{w}.thinking", seg.thinking))
        inner += [(f"{w}.tool_calls[{j}]", s) for j, s in enumerate(seg.tool_calls)]
        last_end, last_name = seg.start, None
        for name, sp in inner:
            if not isinstance(sp, Span):
                raise RolloutFormatError(name, f"expected a Span, got {type(sp).__name__}")
            if not seg.start <= sp.start < sp.end <= seg.end:
                raise RolloutFormatError(name, f"[{sp.start}, {sp.end}) is empty or outside the "
                                         f"turn [{seg.start}, {seg.end})")
            if sp.start < last_end:
                raise RolloutFormatError(name, f"[{sp.start}, {sp.end}) overlaps or precedes "
                                         f"{last_name or 'the turn start'} (must be ordered: "
                                         "thinking, then tool calls)")
            last_end, last_name = sp.end, name

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "rollout_id": self.rollout_id,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "finish_reason": self.finish_reason,
            "token_ids": list(self.token_ids),
            "segments": [s.to_dict() for s in self.segments],
            "metadata": self.metadata,
            **({"routed_experts": self.routed_experts.to_dict()}
               if self.routed_experts is not None else {}),
        }

    def to_json(self) -> str:
        """One line of JSON (no NaN/Infinity: strict JSON that any reader accepts)."""
        try:
            return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False,
                              ensure_ascii=False)
        except (TypeError, ValueError) as e:  # non-JSON metadata, NaN log-probs
            raise RolloutFormatError("<rollout>", f"not JSON-serialisable: {e}") from e

    @classmethod
    def from_dict(cls, d: Any, validate: bool = True) -> "Rollout":
        if not isinstance(d, dict):
            raise RolloutFormatError("<rollout>", f"expected an object, got {type(d).__name__}")
        _check_keys(d, required=("task_id", "group_id", "token_ids", "segments", "finish_reason"),
                    optional=("format_version", "rollout_id", "metadata", "routed_experts"),
                    where="<rollout>")
        ver = d.get("format_version", FORMAT_VERSION)
        if ver != FORMAT_VERSION:
            raise RolloutFormatError("format_version", f"unsupported {ver!r} (reader: {FORMAT_VERSION})")
        if not isinstance(d["segments"], list):
            raise RolloutFormatError("segments", "must be a list")
        r = cls(
            task_id=d["task_id"], group_id=d["group_id"], token_ids=d["token_ids"],
            segments=[Segment.from_dict(s, f"segments[{i}]") for i, s in enumerate(d["segments"])],
            finish_reason=d["finish_reason"], rollout_id=d.get("rollout_id", ""),
            metadata=d.get("metadata", {}),
            routed_experts=(RoutedExperts.from_dict(d["routed_experts"])
                            if d.get("routed_experts") is not None else None),
        )
        return r.validate() if validate else r

    @classmethod
    def from_json(cls, line: str, validate: bool = True) -> "Rollout":
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise RolloutFormatError("<json>", f"invalid JSON: {e}") from e
        return cls.from_dict(d, validate=validate)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_keys(d: dict, required: Iterable[str], optional: Iterable[str], where: str) -> None:
    required = tuple(required)
    for k in required:
        if k not in d:
            raise RolloutFormatError(k if where == "<rollout>" else f"{where}.{k}", "missing")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:  # catches typos such as "logprob" instead of silently ignoring them
        raise RolloutFormatError(where, f"unknown field(s) {unknown}")
