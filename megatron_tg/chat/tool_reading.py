"""How a generated turn's Qwen3-Coder XML tool calls are read: the choice training rewards.

The deployment parser is SGLang's ``qwen3_coder`` detector
(``sglang.srt.function_call.qwen3_coder_detector.Qwen3CoderDetector``). It is lenient where
this package's parser (:func:`megatron_tg.chat.parsing.parse_assistant`) is strict, and the
two disagree on three kinds of input (measured against sglang 0.5.23 by
``tests/sglang/test_tool_call_reading.py``):

* a parameter value that contains ``<parameter=NAME>`` text: one value here, a new
  parameter there (its parameter regex stops at the next ``<parameter=``);
* a call without ``</tool_call>``: an error here, a call there;
* a parameter without ``</parameter>``: an error here, a value running to the next tag there.

``rollout.tool_call_reading`` picks one reading for everything that looks at calls (the
harness, which executes them; the judge, whose checkers grade them):

* ``"strict"`` (default): this package's parser, which additionally refuses values containing
  markup that SGLang would read as structure (``<parameter=`` or ``</function>``). Only calls
  that every reader parses the same way are executed and rewarded: a policy never earns
  reward for a call whose meaning depends on the parser, and what it learns transfers to
  SGLang (on which every strict call reads identically) and to stricter parsers alike.
* ``"sglang"``: SGLang's own detector, imported from the installed sglang package (never
  re-implemented here), for labs that want training to see exactly what their deployment
  executes. Text between or after calls is dropped from ``content``, as SGLang drops it;
  ``<tool_call>`` blocks it reads no call from become errors.
"""

from __future__ import annotations

import json
from typing import Any

READINGS = ("strict", "sglang")

# Markup inside a value that SGLang's detector reads as structure (see the module docstring).
AMBIGUOUS_IN_VALUE = ("<parameter=", "</function>")


def require_sglang() -> None:
    """Raise the ImportError below now (at start-up) if SGLang's detector is not installed."""
    _detector()


def _detector():
    try:
        from sglang.srt.function_call.qwen3_coder_detector import Qwen3CoderDetector
    except ImportError as exc:  # the CPU lane has no sglang; clusters do
        raise ImportError("rollout.tool_call_reading='sglang' reads calls with SGLang's own "
                          "qwen3_coder detector, which needs the sglang package installed "
                          f"(pip install -e '.[gpu]'): {exc}") from exc
    return Qwen3CoderDetector()


def sglang_read(body: str) -> tuple[str, list[tuple[str, dict[str, Any], int, int]], list[tuple[int, int]]]:
    """SGLang's reading of a turn's body (after any thinking): ``(content, calls, unread)``.

    ``calls`` are ``(name, arguments, start, end)`` with character offsets of the call's
    ``<tool_call>`` block in ``body`` (to the next block or the end when unterminated);
    ``unread`` are the spans of blocks SGLang read no call from. Arguments are SGLang's own
    values: strings, or None where the model wrote ``null`` (no tool schema is passed, so no
    other conversion happens)."""
    result = _detector().detect_and_parse(body, tools=None)
    spans = _blocks(body)
    calls = []
    for i, item in enumerate(result.calls):
        # SGLang numbers calls in text order, one per <function=...> it reads.
        start, end = spans[min(i, len(spans) - 1)] if spans else (0, len(body))
        calls.append((item.name or "", json.loads(item.parameters), start, end))
    unread = spans[len(result.calls):] if len(spans) > len(result.calls) else []
    return result.normal_text.strip(), calls, unread


def _blocks(body: str) -> list[tuple[int, int]]:
    """Spans of ``<tool_call>`` blocks: to their ``</tool_call>``, else to the next block."""
    out, pos = [], 0
    while (o := body.find("<tool_call>", pos)) >= 0:
        nxt = body.find("<tool_call>", o + 1)
        c = body.find("</tool_call>", o)
        end = c + len("</tool_call>") if c >= 0 and (nxt < 0 or c < nxt) else (nxt if nxt >= 0 else len(body))
        out.append((o, end))
        pos = end
    return out
