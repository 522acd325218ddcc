"""Rule-based criterion checkers.

A checker is built once from the rubric's ``checker: {type, args}`` (bad args fail at rubric
load time, naming the criterion) and called as ``checker(text, ctx) -> (passed, detail)`` on
the text its criterion's scope selects (see :func:`megatron_tg.judge.judge.evaluate_rule`).

A checker that *cannot* decide (e.g. ``tests_pass`` with no test result in the metadata)
raises :class:`CheckerError`; the judge then records a judge error for the rollout instead of
guessing a pass or a fail.

Every text checker takes ``text``: which text of the scoped unit to look at —
``content`` (default: the visible message, without thinking and tool calls), ``raw`` (the
whole turn, tags included), ``thinking``, or ``transcript`` (the whole rollout).
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_tg.chat.parsing import ToolCall, ToolCallError

TEXT_SOURCES = ("content", "raw", "thinking", "transcript")


class CheckerError(Exception):
    """The checker cannot evaluate this rollout (missing data, crashing user callable...)."""


@dataclass
class CheckContext:
    scope: str
    transcript: Any  # megatron_tg.judge.transcript.Transcript
    turn: Any = None  # TurnView of the scoped turn (None for rollout scope with no turns)
    tool_call: ToolCall | ToolCallError | None = None  # set for scope any_tool_call
    task: Any = None  # privileged task info passed to the judge
    metadata: dict[str, Any] = field(default_factory=dict)


class Checker:
    """Base class; ``llm`` criteria have no local checker (``is_llm``)."""

    is_llm = False
    text = "content"

    def __call__(self, text: str, ctx: CheckContext) -> tuple[bool, str]:
        raise NotImplementedError

    def _set_text(self, text: str) -> None:
        if text not in TEXT_SOURCES:
            raise ValueError(f"text must be one of {TEXT_SOURCES}, got {text!r}")
        self.text = text


_CODE_FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")


def strip_code(text: str, inline: bool = True) -> str:
    """Remove fenced code blocks (and inline code): markdown inside code is not markdown."""
    text = _CODE_FENCE.sub("", text)
    return _INLINE_CODE.sub("", text) if inline else text


class RegexChecker(Checker):
    _FLAGS = {"IGNORECASE": re.I, "MULTILINE": re.M, "DOTALL": re.S}

    def __init__(self, pattern: str, must_match: bool = True, flags: list[str] | None = None,
                 text: str = "content"):
        self._set_text(text)
        bad = [f for f in flags or [] if f not in self._FLAGS]
        if bad:
            raise ValueError(f"unknown regex flags {bad}; use {sorted(self._FLAGS)}")
        f = 0
        for name in flags or []:
            f |= self._FLAGS[name]
        self.regex = re.compile(pattern, f)  # re.error surfaces at rubric load
        self.must_match = bool(must_match)

    def __call__(self, text, ctx):
        m = self.regex.search(text)
        if self.must_match:
            return (True, "") if m else (False, f"no match for /{self.regex.pattern}/")
        return (False, f"forbidden match {m.group(0)[:60]!r}") if m else (True, "")


_DELIM_CELL = re.compile(r"^\s*:?-+:?\s*$")


def _cells(line: str) -> list[str]:
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|") and not s.endswith("\\|"):
        s = s[:-1]
    return [c.strip() for c in re.split(r"(?<!\\)\|", s)]


class MarkdownTableChecker(Checker):
    """Passes if the text holds a GitHub-flavoured markdown table outside code: a header row,
    a delimiter row (``|---|:--:|``) with the same number of cells (>= ``min_columns``), then
    at least ``min_rows`` body rows."""

    def __init__(self, min_columns: int = 2, min_rows: int = 1, text: str = "content"):
        self._set_text(text)
        if min_columns < 1 or min_rows < 0:
            raise ValueError("min_columns must be >= 1 and min_rows >= 0")
        self.min_columns, self.min_rows = int(min_columns), int(min_rows)

    def __call__(self, text, ctx):
        lines = strip_code(text, inline=False).splitlines()
        for i in range(len(lines) - 1):
            if "|" not in lines[i] or "-" not in lines[i + 1]:
                continue
            header, delim = _cells(lines[i]), _cells(lines[i + 1])
            if (len(header) < self.min_columns or len(delim) != len(header)
                    or not all(_DELIM_CELL.match(c) for c in delim)):
                continue
            rows = 0
            for line in lines[i + 2:]:
                if "|" not in line or not line.strip():
                    break
                rows += 1
            if rows >= self.min_rows:
                return True, ""
        return False, (f"no markdown table with >= {self.min_columns} columns and "
                       f">= {self.min_rows} rows")


_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*|__(?=\S)(.+?)(?<=\S)__")


class BoldChecker(Checker):
    """Passes if the text (outside code) has at least ``min_count`` bold spans
    (``**x**`` or ``__x__``)."""

    def __init__(self, min_count: int = 1, text: str = "content"):
        self._set_text(text)
        if min_count < 1:
            raise ValueError("min_count must be >= 1")
        self.min_count = int(min_count)

    def __call__(self, text, ctx):
        n = len(_BOLD.findall(strip_code(text)))
        return (n >= self.min_count), ("" if n >= self.min_count else
                                       f"{n} bold spans, need >= {self.min_count}")


class ToolFormatChecker(Checker):
    """Every call to ``tool`` must pass ``parameter`` (and, if ``value_pattern`` is set, its
    value must fully match it). Calls to other tools pass. A malformed call whose function name
    is ``tool`` fails — an unterminated one too (e.g. cut by the token limit), whose name the
parser reads from its ``<function=NAME>`` tag; other malformed calls fail only with
``fail_on_malformed``.

    Scope ``any_tool_call`` checks one call at a time (``ctx.tool_call``); a turn scope checks
    all calls of the turn, the rollout scope all calls of all turns.
    """

    def __init__(self, tool: str, parameter: str, value_pattern: str | None = None,
                 fail_on_malformed: bool = False):
        if not tool or not parameter:
            raise ValueError("tool and parameter are required")
        self.tool, self.parameter = tool, parameter
        self.value_re = re.compile(value_pattern) if value_pattern else None
        self.fail_on_malformed = bool(fail_on_malformed)

    def check_call(self, call: ToolCall | ToolCallError) -> tuple[bool, str]:
        if isinstance(call, ToolCallError):
            if call.name == self.tool or self.fail_on_malformed:
                return False, f"malformed tool call ({call.message})"
            return True, ""
        if call.name != self.tool:
            return True, ""
        if self.parameter not in call.arguments:
            return False, f"{self.tool} call without {self.parameter!r}"
        if self.value_re and not self.value_re.fullmatch(call.arguments[self.parameter].strip()):
            return False, (f"{self.tool} {self.parameter}={call.arguments[self.parameter]!r} does "
                           f"not match /{self.value_re.pattern}/")
        return True, ""

    def __call__(self, text, ctx):
        if ctx.tool_call is not None:
            return self.check_call(ctx.tool_call)
        turns = [ctx.turn] if ctx.scope in ("final_turn", "every_turn") else ctx.transcript.turns
        for t in turns:
            if t is None:
                continue
            for call in list(t.tool_calls) + list(t.tool_call_errors):
                ok, why = self.check_call(call)
                if not ok:
                    return False, why
        return True, ""


class PoemChecker(Checker):
    """Passes if the text contains a *status poem*: a stanza (a run of consecutive non-blank
    lines, delimited by blank lines or the text's start/end, outside code fences) of
    ``min_lines``..``max_lines`` lines (``lines`` sets both; default 3, haiku-like) where every
    line is short verse: ``min_words``..``max_words`` words, at most ``max_chars`` characters,
    at least one letter, and nothing that reads as markdown structure or code (no leading
    ``#``/``-``/``*``/``>``/``1.``, none of ``` ` { } [ ] < > = ; | \\ ```). With
    ``title_pattern`` the stanza's first line must match it (e.g. "Status poem:") and the
    remaining lines are the poem. Syllables are not counted (unreliable without a dictionary).
    """

    _BAD_CHARS = set("`{}[]<>=;|\\")
    _BAD_START = re.compile(r"^\s*([#>*+-]|\d+[.)])\s")

    def __init__(self, lines: int | None = None, min_lines: int = 3, max_lines: int = 3,
                 min_words: int = 1, max_words: int = 10, max_chars: int = 60,
                 title_pattern: str | None = None, text: str = "content"):
        self._set_text(text)
        if lines is not None:
            min_lines = max_lines = lines
        if not 1 <= min_lines <= max_lines or not 1 <= min_words <= max_words or max_chars < 1:
            raise ValueError("need 1 <= min_lines <= max_lines, 1 <= min_words <= max_words, "
                             "max_chars >= 1")
        self.min_lines, self.max_lines = int(min_lines), int(max_lines)
        self.min_words, self.max_words, self.max_chars = int(min_words), int(max_words), int(max_chars)
        self.title_re = re.compile(title_pattern) if title_pattern else None

    def _verse(self, line: str) -> bool:
        s = line.strip()
        n = len(s.split())
        return (self.min_words <= n <= self.max_words and len(s) <= self.max_chars
                and any(ch.isalpha() for ch in s) and not self._BAD_START.match(line)
                and not (set(s) & self._BAD_CHARS))

    def __call__(self, text, ctx):
        stanzas, cur = [], []
        for line in strip_code(text, inline=False).splitlines() + [""]:
            if line.strip():
                cur.append(line)
            elif cur:
                stanzas.append(cur)
                cur = []
        for st in stanzas:
            if self.title_re is not None:
                if not self.title_re.search(st[0]):
                    continue
                st = st[1:]
            if self.min_lines <= len(st) <= self.max_lines and all(self._verse(x) for x in st):
                return True, ""
        return False, (f"no stanza of {self.min_lines}-{self.max_lines} short verse lines "
                       f"(<= {self.max_words} words, <= {self.max_chars} chars each)")


def _load_callable(path: str) -> Callable:
    mod, sep, attr = path.partition(":")
    if not sep:
        mod, _, attr = path.rpartition(".")
    if not mod or not attr:
        raise ValueError(f"callable must be 'package.module:function' or a dotted path, got {path!r}")
    fn = getattr(importlib.import_module(mod), attr)
    if not callable(fn):
        raise ValueError(f"{path} is not callable")
    return fn


def _as_verdict(out: Any, who: str) -> tuple[bool, str]:
    """Accept bool or (bool, str) only: a truthy string or None must not count as a pass."""
    detail = ""
    if isinstance(out, tuple) and len(out) == 2:
        out, detail = out
    if not (isinstance(out, bool) or type(out).__name__ == "bool_"):
        raise CheckerError(f"{who} returned {type(out).__name__}, expected bool or (bool, str)")
    return bool(out), "" if detail is None else str(detail)


class PythonChecker(Checker):
    """Calls ``callable(text, ctx) -> bool | (bool, str)`` (imported at rubric load time)."""

    def __init__(self, callable: str, text: str = "content", **kwargs: Any):  # noqa: A002
        self._set_text(text)
        self.path = callable
        self.fn = _load_callable(callable)
        self.kwargs = kwargs  # extra args are passed through to the callable

    def __call__(self, text, ctx):
        try:
            out = self.fn(text, ctx, **self.kwargs)
        except CheckerError:
            raise
        except Exception as e:  # a crashing user checker is an error, never a pass or a fail
            raise CheckerError(f"{self.path} raised {type(e).__name__}: {e}") from e
        return _as_verdict(out, self.path)


class TestsPassChecker(Checker):
    """Reads the hidden-test result the environment stored in the rollout metadata under
    ``key``: a bool, a pass fraction in [0, 1], or ``{"passed": int, "total": int}``; passes
    when the fraction is >= ``threshold``. A missing or malformed result is a CheckerError."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, key: str = "tests_passed", threshold: float = 1.0):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.key, self.threshold = key, float(threshold)

    def __call__(self, text, ctx):
        if self.key not in ctx.metadata:
            raise CheckerError(f"rollout metadata has no {self.key!r} (hidden-test result)")
        v = ctx.metadata[self.key]
        if isinstance(v, bool):
            frac = 1.0 if v else 0.0
        elif isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0:
            frac = float(v)
        elif (isinstance(v, dict) and isinstance(v.get("passed"), int)
              and isinstance(v.get("total"), int) and 0 <= v["passed"] <= v["total"]):
            frac = v["passed"] / v["total"] if v["total"] else 0.0  # no tests ran: not a pass
        else:
            raise CheckerError(f"metadata[{self.key!r}] = {v!r} is not a test result")
        ok = frac >= self.threshold
        return ok, "" if ok else f"tests passed {frac:.2f} < {self.threshold:.2f}"


class LLMCheck(Checker):
    """Judged by the LLM judge: ``question`` is what it must verify. Not callable locally."""

    is_llm = True

    def __init__(self, question: str):
        if not isinstance(question, str) or not question.strip():
            raise ValueError("llm checker needs a non-empty 'question'")
        self.question = question.strip()

    def __call__(self, text, ctx):
        raise CheckerError("llm criteria are evaluated by the LLM judge, not locally")


CHECKERS: dict[str, type[Checker]] = {
    "regex": RegexChecker,
    "markdown_table": MarkdownTableChecker,
    "bold": BoldChecker,
    "tool_format": ToolFormatChecker,
    "poem": PoemChecker,
    "python": PythonChecker,
    "tests_pass": TestsPassChecker,
    "llm": LLMCheck,
}


def build_checker(type_: str, args: dict[str, Any]) -> Checker:
    if type_ not in CHECKERS:
        raise ValueError(f"unknown checker type {type_!r}; known: {sorted(CHECKERS)}")
    try:
        return CHECKERS[type_](**args)
    except TypeError as e:  # unknown / missing argument
        raise ValueError(f"bad arguments for checker {type_!r}: {e}") from e
    except re.error as e:
        raise ValueError(f"bad regex for checker {type_!r}: {e}") from e
