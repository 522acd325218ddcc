"""LLM judge: one request per rollout to an OpenAI-compatible ``/v1/chat/completions``.

The request carries the rubric's LLM criteria, the numbered transcript and the privileged task
information, and asks for::

    {"criteria": {"<name>": {"pass": bool, "failing_turns": [int], "feedback": str | null}}}

Failure policy (a judge must never turn an outage into rewards): timeouts, connection errors
and HTTP 408/425/429/5xx are retried with exponential backoff (+ jitter, honouring
``Retry-After``); a reply that is not JSON, omits a criterion or is ill-typed counts as a
failed attempt too (sampling may fix it). When attempts run out :class:`LLMJudgeError` is
raised, which the :class:`~megatron_tg.judge.judge.Judge` records as the rollout's
``judge_error`` (the rollout is then excluded from training). Other HTTP errors (400, 401,
404...) are configuration errors and are not retried.

Context overflow is neither: a transcript longer than the judge's context is answered with
HTTP 400 and a "context length" message (SGLang 0.5.23's tokenizer manager: "The input (N
tokens) is longer than the model's context length (M tokens)."; vLLM and OpenAI say
"maximum context length" / ``context_length_exceeded``). Retrying the same request cannot
help, and dropping it would drop exactly the longest rollouts, so the request is sent again
with the transcript cut to fit (its budget scaled by M/N when the message gives the counts,
else halved), up to ``overflow_retries`` times. Every cut is marked in the transcript the
judge sees and counted in :class:`JudgeCall`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import aiohttp

from megatron_tg.judge.rubric import Criterion

RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})

_SCOPE_TEXT = {
    "final_turn": "judge the final assistant turn only",
    "every_turn": "every assistant turn must satisfy it; list each turn that does not",
    "any_tool_call": "every tool call must satisfy it; list each turn with a violating call",
    "rollout": "judge the whole transcript",
}

SYSTEM_PROMPT = (
    "You are a strict, impartial grader of coding-agent transcripts. You get privileged "
    "information about the task that the agent did not see, a list of criteria and the "
    "transcript. Decide each criterion independently from the transcript's evidence. Reply "
    "with ONLY one JSON object, no prose, no code fences."
)


@dataclass
class LLMJudgeConfig:
    base_url: str = "http://127.0.0.1:8000"
    """Server root; ``/v1/chat/completions`` is appended (a trailing ``/v1`` is accepted)."""
    model: str = "judge"
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (keys never go in config files)."""
    api_key_file: str | None = None
    """Or a file (mode 0600) holding it, e.g. the job's key (megatron_tg.auth)."""
    timeout_s: float = 120.0
    max_attempts: int = 4
    backoff_s: float = 1.0
    """Delay before retry n (0-based) is ``min(backoff_s * 2**n, backoff_max_s)`` ± jitter."""
    backoff_max_s: float = 30.0
    jitter: float = 0.1
    temperature: float = 0.0
    max_tokens: int = 2048
    max_concurrency: int = 16
    json_mode: bool = True
    """Send ``response_format={"type": "json_object"}`` (vLLM/SGLang/OpenAI support it)."""
    max_context_chars: int = 4000
    """Per non-assistant transcript block (tool output etc.), cut in the middle beyond this."""
    max_transcript_chars: int = 200_000
    """The whole transcript's budget per request (a criterion's ``judge_budget_chars`` can
    lower it); beyond it the middle of the transcript is omitted with a marker."""
    overflow_retries: int = 2
    """Re-sends with a shorter transcript after a context-overflow answer (module docstring)."""

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        base = base[:-3] if base.endswith("/v1") else base
        return f"{base}/v1/chat/completions"


@dataclass
class LLMVerdict:
    passed: bool
    failing_turns: list[int]
    feedback: str | None


class LLMJudgeError(Exception):
    """The judge gave no usable verdict (after retries): the rollout gets a judge_error.
    ``kind`` says why: "overflow" (the transcript did not fit even when cut), "config" (a
    non-retried HTTP error) or "exhausted" (retryable failures until attempts ran out)."""

    def __init__(self, message: str, kind: str = "exhausted"):
        super().__init__(message)
        self.kind = kind


@dataclass
class JudgeCall:
    """What one :meth:`LLMJudgeClient.evaluate` took: for metrics and per-sample records."""

    requests: int = 0
    overflow_retries: int = 0
    transcript_chars: int = 0
    omitted_turns: int = 0
    """Assistant turns left out of the transcript the judge finally saw."""


Render = Callable[[Union[int, None]], "tuple[str, list[int]]"]
"""``budget_chars -> (transcript text, omitted assistant turns)``."""

_OVERFLOW = re.compile(r"context length|maximum context|context_length_exceeded|too many tokens"
                       r"|prompt is too long", re.I)
_COUNTS = re.compile(r"input \((\d+) tokens\).*context length \((\d+) tokens\)", re.I | re.S)


class _InvalidReply(Exception):
    pass


class _Retryable(Exception):
    def __init__(self, msg: str, retry_after: float | None = None):
        super().__init__(msg)
        self.retry_after = retry_after


class _Overflow(Exception):
    def __init__(self, msg: str, scale: float):
        super().__init__(msg)
        self.scale = scale  # budget multiplier that should make the next request fit


def overflow_scale(body: str) -> float | None:
    """None unless ``body`` (an HTTP 400 body) says the prompt exceeds the context; then the
    factor to shrink the transcript by (M/N x 0.9 from the token counts, else 0.5)."""
    if not _OVERFLOW.search(body):
        return None
    m = _COUNTS.search(body)
    if m and int(m.group(1)) > 0:
        return max(0.1, min(0.9, 0.9 * int(m.group(2)) / int(m.group(1))))
    return 0.5


def build_messages(criteria: Sequence[Criterion], transcript: str, task_info: Any,
                   n_turns: int) -> list[dict[str, str]]:
    if isinstance(task_info, (dict, list)):
        task_text = json.dumps(task_info, indent=2, ensure_ascii=False)
    else:
        task_text = "(none)" if task_info is None else str(task_info)
    crit_lines = []
    for c in criteria:
        desc = f" ({c.description})" if c.description else ""
        crit_lines.append(f'- "{c.name}" [{_SCOPE_TEXT[c.scope]}]: {c.checker.question}{desc}')
    example = {"criteria": {c.name: {"pass": True, "failing_turns": [], "feedback": None}
                            for c in criteria[:2]}}
    user = (
        "# Task (privileged information; the agent did not see this)\n"
        f"{task_text}\n\n"
        "# Criteria\n" + "\n".join(crit_lines) + "\n\n"
        f"# Transcript ({n_turns} assistant turns, numbered 0 to {n_turns - 1})\n"
        f"{transcript}\n\n"
        "# Answer format\n"
        'Return {"criteria": {"<criterion name>": {"pass": true or false, "failing_turns": '
        '[assistant turn numbers that violate it], "feedback": "one sentence telling the agent '
        'what to change, or null"}}} with every criterion above exactly once, e.g.\n'
        f"{json.dumps(example)}"
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def parse_reply(text: str, criteria: Sequence[Criterion], n_turns: int) -> dict[str, LLMVerdict]:
    """Strictly validate the judge's JSON; raises _InvalidReply naming what is wrong."""
    m = _FENCE.match(text)
    body = m.group(1) if m else text.strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise _InvalidReply(f"reply is not valid JSON ({e}): {text[:120]!r}") from e
    if not isinstance(obj, dict) or not isinstance(obj.get("criteria"), dict):
        raise _InvalidReply("reply has no 'criteria' object")
    got = obj["criteria"]
    out: dict[str, LLMVerdict] = {}
    for c in criteria:
        if c.name not in got:
            raise _InvalidReply(f"reply omits criterion {c.name!r}")
        v = got[c.name]
        if not isinstance(v, dict) or not isinstance(v.get("pass"), bool):
            raise _InvalidReply(f"criterion {c.name!r}: 'pass' must be true or false, got {v!r}")
        turns = v.get("failing_turns") or []
        if not isinstance(turns, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in turns):
            raise _InvalidReply(f"criterion {c.name!r}: failing_turns must be a list of ints")
        bad = [t for t in turns if not 0 <= t < n_turns]
        if bad:
            raise _InvalidReply(f"criterion {c.name!r}: failing turns {bad} out of range "
                                f"(0..{n_turns - 1})")
        fb = v.get("feedback")
        if fb is not None and not isinstance(fb, str):
            raise _InvalidReply(f"criterion {c.name!r}: feedback must be a string or null")
        if not v["pass"] and not turns and c.scope in ("every_turn", "any_tool_call"):
            raise _InvalidReply(f"criterion {c.name!r} failed but names no failing turn")
        out[c.name] = LLMVerdict(v["pass"], [] if v["pass"] else sorted(set(turns)),
                                 fb.strip() if isinstance(fb, str) and fb.strip() else None)
    return out


class LLMJudgeClient:
    """Async client; use ``async with LLMJudgeClient(cfg) as c`` or call :meth:`close`."""

    def __init__(self, config: LLMJudgeConfig, session: aiohttp.ClientSession | None = None,
                 rng: random.Random | None = None):
        self.config = config
        self._headers()  # a missing API key is a configuration error: fail here, not per rollout
        self._session = session
        self._own_session = session is None
        self._sem: asyncio.Semaphore | None = None
        self._rng = rng or random.Random()
        self.requests_sent = 0  # for logging / tests

    async def __aenter__(self) -> "LLMJudgeClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.config.api_key_file:
            from megatron_tg.auth import SecretError, read_key

            if getattr(self, "_file_key", None) is None:  # read once, at construction
                try:
                    self._file_key = read_key(self.config.api_key_file)
                except SecretError as exc:
                    raise LLMJudgeError(f"judge API key: {exc}", kind="config") from None
            h["Authorization"] = f"Bearer {self._file_key}"
            return h
        env = self.config.api_key_env
        if env:
            key = os.environ.get(env)
            if not key:
                raise LLMJudgeError(f"environment variable {env} (judge API key) is not set",
                                    kind="config")
            h["Authorization"] = f"Bearer {key}"
        return h

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        cfg = self.config
        d = min(cfg.backoff_s * (2 ** attempt), cfg.backoff_max_s)
        d *= 1.0 + cfg.jitter * (2 * self._rng.random() - 1)
        if retry_after is not None:
            d = max(d, min(retry_after, cfg.backoff_max_s))
        return max(d, 0.0)

    async def evaluate(self, criteria: Sequence[Criterion], transcript: str | Render,
                       task_info: Any, n_turns: int, budget_chars: int | None = None
                       ) -> tuple[dict[str, LLMVerdict], str, JudgeCall]:
        """Returns (verdict per criterion, raw reply text, what the call took) or raises
        LLMJudgeError. ``transcript``: the text, or a function rendering it within a budget
        (only then can an overflow be answered with a shorter transcript)."""
        cfg = self.config
        budget = budget_chars if budget_chars is not None else cfg.max_transcript_chars
        render: Render = transcript if callable(transcript) else (lambda _b, t=transcript: (t, []))
        text_in, omitted = render(budget)
        call = JudgeCall(transcript_chars=len(text_in), omitted_turns=len(omitted))
        headers = self._headers()
        if self._session is None:
            self._session = aiohttp.ClientSession()
        if self._sem is None:
            self._sem = asyncio.Semaphore(cfg.max_concurrency)
        errors: list[str] = []
        attempt = 0
        while attempt < cfg.max_attempts:
            payload = self._payload(criteria, text_in, task_info, n_turns)
            retry_after = None
            try:
                call.requests += 1
                async with self._sem:
                    text = await self._post(payload, headers)
                return parse_reply(text, criteria, n_turns), text, call
            except _Overflow as e:
                errors.append(f"context overflow at {len(text_in)} characters: {e}")
                if not callable(transcript) or call.overflow_retries >= cfg.overflow_retries:
                    raise LLMJudgeError("transcript does not fit the judge's context: "
                                        + " | ".join(errors), kind="overflow") from None
                call.overflow_retries += 1
                budget = max(1000, int(len(text_in) * e.scale))
                text_in, omitted = render(budget)
                call.transcript_chars, call.omitted_turns = len(text_in), len(omitted)
                continue  # not a failed attempt: a different request
            except _Retryable as e:
                errors.append(str(e))
                retry_after = e.retry_after
            except _InvalidReply as e:
                errors.append(f"invalid reply: {e}")
            except asyncio.TimeoutError:
                errors.append(f"timeout after {cfg.timeout_s}s")
            except aiohttp.ClientError as e:
                errors.append(f"{type(e).__name__}: {e}")
            attempt += 1
            if attempt < cfg.max_attempts:
                await asyncio.sleep(self._delay(attempt - 1, retry_after))
        raise LLMJudgeError(f"no valid verdict after {cfg.max_attempts} attempts: "
                            + " | ".join(errors))

    def _payload(self, criteria, transcript: str, task_info: Any, n_turns: int) -> dict[str, Any]:
        cfg = self.config
        payload: dict[str, Any] = {
            "model": cfg.model,
            "messages": build_messages(criteria, transcript, task_info, n_turns),
            "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens,
        }
        if cfg.json_mode:
            payload["response_format"] = {"type": "json_object"}
        return payload

    async def _post(self, payload: dict[str, Any], headers: dict[str, str]) -> str:
        assert self._session is not None
        self.requests_sent += 1
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with self._session.post(self.config.url, json=payload, headers=headers,
                                      timeout=timeout) as resp:
            body = await resp.text()
            if resp.status in RETRY_STATUSES:
                ra = resp.headers.get("Retry-After")
                try:
                    retry_after = float(ra) if ra is not None else None
                except ValueError:
                    retry_after = None
                raise _Retryable(f"HTTP {resp.status}: {body[:120]!r}", retry_after)
            if resp.status == 400 and (scale := overflow_scale(body)) is not None:
                raise _Overflow(f"HTTP 400: {body[:200]!r}", scale)
            if resp.status != 200:
                raise LLMJudgeError(f"HTTP {resp.status} (not retried): {body[:200]!r}",
                                    kind="config")
        try:
            data = json.loads(body)
            content = data["choices"][0]["message"]["content"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise _InvalidReply(f"not an OpenAI chat completion: {body[:120]!r}") from e
        if not isinstance(content, str):
            raise _InvalidReply("completion has no text content")
        return content
