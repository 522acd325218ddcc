"""The paper suite's environment: the key lookup with a thinking span and four criteria at once.

The main demo's task (:mod:`.task`) has one behaviour to teach. Table 1 and Figures 5-7 of the
paper need more: several binary criteria at once, one checked on every turn, and a thinking
span the model writes before it acts. Same tasks, tool and answer check; each assistant turn
now opens with ``<think>…</think>`` (Qwen3 style, the tiny template renders it) that states
the turn's plan::

    user:       Find the value of k54.
    assistant:  <think>The user wants the value of k54. I will search the facts file for k54.</think>
                <tool_call>…<parameter=query>k54</parameter>…</tool_call>
    tool:       facts.txt:2: k54 = 55 …
    assistant:  <think>The search result shows the line of k54. I will state its value in a
                sentence.</think>The value of k54 is 55.

Criteria (:data:`RUBRIC`; the reward weights are the RL rewards, the feedback the TG hint):

* ``answer`` (final turn, primary, no feedback): the value, and no other number — the task;
* ``search_lines`` (any tool call): every ``search`` call passes ``lines=`` — the tool format;
* ``answer_style`` (final turn): the answer is written ``Answer: VALUE`` — a final-answer style;
* ``brief_thinking`` (every turn): the turn opens with a thinking span of 1 to
  :data:`BRIEF_MAX_WORDS` words — a length criterion, and the every-turn criterion. A turn
  without thinking fails it: dropping the thinking is not a way to be brief.

The base model (:mod:`.paper_base`) does the new behaviour of a criterion only when that
criterion's feedback stands before the turn, and its thinking announces it ("… with lines 2",
"… after Answer"), so the plan in the thinking and the action agree. The student's turns
fail the three style criteria and are gated; with the KL off on thinking tokens
(``objective.mode=no_thinking``) only the actions are distilled and the plan is left to
RL: what Figure 7 measures.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from megatron_tg.chat.parsing import ParsedTurn
from megatron_tg.demo import task as T

STYLE_FEEDBACK = "Write the final answer as Answer: followed by the value."
BRIEF_MAX_WORDS = 8
BRIEF_FEEDBACK = f"Keep your thinking to at most {BRIEF_MAX_WORDS} words."
LINES_FEEDBACK = T.FEEDBACK
STYLE_CRITERIA = ("search_lines", "answer_style", "brief_thinking")
"""The criteria with feedback, in rubric order (the order the judge joins their feedback in)."""
FEEDBACK = {"search_lines": LINES_FEEDBACK, "answer_style": STYLE_FEEDBACK,
            "brief_thinking": BRIEF_FEEDBACK}
TURN_CRITERIA = (("search_lines", "brief_thinking"), ("answer_style", "brief_thinking"))
"""Per reference turn (0: the search call, 1: the answer), the criteria that can fail there."""
_ANSWER_STYLE = re.compile(r"Answer: ([0-9]+)\.?")


def hint_for(criteria: Sequence[str], framing: str | None = None) -> str:
    """The message text the trainer inserts before a turn failing ``criteria``: their feedback
    joined by newlines in rubric order (:meth:`JudgeResult.feedback_by_turn`), framed."""
    unknown = [c for c in criteria if c not in FEEDBACK]
    if unknown or not criteria:
        raise ValueError(f"criteria must be a non-empty subset of {STYLE_CRITERIA}, got {list(criteria)}")
    return T.hint_text("\n".join(FEEDBACK[c] for c in STYLE_CRITERIA if c in criteria), framing)


def all_fail_hints(framing: str | None = None) -> dict[int, str]:
    """Turn -> hint when every criterion of the turn fails (the base student's usual state)."""
    return {k: hint_for(cs, framing) for k, cs in enumerate(TURN_CRITERIA)}


# ------------------------------------------------------------------------------ transcripts
def thinking_text(task: T.FactTask, turn: int, *, new: bool, brief: bool, lines: int) -> str:
    """The thinking of reference turn ``turn``: its plan, long (> :data:`BRIEF_MAX_WORDS`
    words) or brief, announcing the old or the ``new`` behaviour of the turn's criterion."""
    k = task.key
    if turn == 0:
        how = f" with lines {lines}" if new else ""
        return f"Search for {k}{how}." if brief else \
            f"The user wants the value of {k}. I will search the facts file for {k}{how}."
    how = "after Answer" if new else "in a sentence"
    return f"State the value {how}." if brief else \
        f"The search result shows the line of {k}. I will state its value {how}."


def answer_text(task: T.FactTask, *, new: bool, value: int | None = None) -> str:
    v = task.value if value is None else value
    return f"Answer: {v}" if new else f"The value of {task.key} is {v}."


def wrong_value(task: T.FactTask) -> int:
    """A wrong answer a reader of the search result could give: the value on the second line
    of the key's old-format result (a different key's); the value plus one where that result
    has one line or the two values are equal."""
    found = T.search(task, task.key).splitlines()
    v = int(found[1].rsplit("=", 1)[1]) if len(found) > 1 else task.value
    return v if v != task.value else v + 1


def reference_messages(task: T.FactTask, behaviour: Mapping[tuple[int, str], bool], *, lines: int,
                       hints: Mapping[int, str] | None = None,
                       answer_value: int | None = None, skip_search: bool = False) -> list[dict[str, Any]]:
    """A demonstration: search, then answer, with ``behaviour[(turn, criterion)]`` = True for
    each criterion whose new behaviour the turn shows (missing: old). ``hints[turn]`` is put
    as a user message right before that turn, where the trainer puts its feedback.
    ``answer_value``: the value the answer states (default: the right one). ``skip_search``:
    one turn that answers at once, its plan saying so, with no value (the stability base's
    failures)."""
    def b(turn: int, crit: str) -> bool:
        return bool(behaviour.get((turn, crit), False))

    hints = hints or {}
    msgs: list[dict[str, Any]] = list(task.prompt_messages())
    if skip_search:  # the stability base's failing demonstration: no search, no value
        brief = b(0, "brief_thinking")
        plan = "Answer without searching." if brief else \
            f"The user wants the value of {task.key}. I will answer without searching."
        # No number and none of an answer's words: an answer that stated a value here (the
        # first rebuild's) shared "The value of k is" with the copying answers, and the
        # model blurred the two (it stated a number not in the result after searching too).
        msgs.append({"role": "assistant", "content": f"I do not know {task.key}.", "reasoning_content": plan})
        return msgs
    args: dict[str, Any] = {"query": task.key}
    if b(0, "search_lines"):
        args[T.LINES_PARAM] = str(lines)
    if 0 in hints:
        msgs.append(T.hint_message(hints[0]))
    msgs.append({"role": "assistant", "content": "",
                 "reasoning_content": thinking_text(task, 0, new=b(0, "search_lines"),
                                                    brief=b(0, "brief_thinking"), lines=lines),
                 "tool_calls": [T._call(args)]})
    msgs.append({"role": "tool", "content": T.search(task, task.key, lines if b(0, "search_lines") else None)})
    if 1 in hints:
        msgs.append(T.hint_message(hints[1]))
    msgs.append({"role": "assistant", "content": answer_text(task, new=b(1, "answer_style"), value=answer_value),
                 "reasoning_content": thinking_text(task, 1, new=b(1, "answer_style"),
                                                    brief=b(1, "brief_thinking"), lines=lines)})
    return msgs


# ------------------------------------------------------------------------------ verifier
def _words(text: str) -> int:
    return len(text.split())


def check_brief_thinking(text: str, ctx: Any, max_words: int = BRIEF_MAX_WORDS) -> tuple[bool, str]:
    """``python`` checker on a turn's thinking (``text: thinking``): 1 to ``max_words`` words."""
    n = _words(text)
    if n == 0:
        return False, "the turn has no thinking"
    if n > max_words:
        return False, f"thinking has {n} words (> {max_words})"
    return True, ""


def check_answer_style(text: str, ctx: Any) -> tuple[bool, str]:
    """``python`` checker on the final turn's content: exactly ``Answer: VALUE`` (an optional
    final period), on an answer turn (no tool call). The value's correctness is ``answer``'s."""
    turn = getattr(ctx, "turn", None)
    if turn is not None and (turn.tool_calls or turn.tool_call_errors):
        return False, "the final turn is a tool call, not an answer"
    if _ANSWER_STYLE.fullmatch(text.strip()):
        return True, ""
    return False, "the answer is not written as 'Answer: VALUE'"


RUBRIC: dict[str, Any] = {
    "name": "demo_paper",
    "description": "Paper suite: key lookup with thinking; tool format, answer style and brief "
                   "thinking on every turn, besides the task.",
    "criteria": [
        {**T.RUBRIC["criteria"][0]},
        {**T.RUBRIC["criteria"][1], "feedback": LINES_FEEDBACK},
        {"name": "answer_style", "scope": "final_turn", "weight": 0.5, "feedback": STYLE_FEEDBACK,
         "description": "The final answer is written 'Answer: VALUE'.",
         "checker": {"type": "python", "args": {"callable": "megatron_tg.demo.paper_env:check_answer_style"}}},
        {"name": "brief_thinking", "scope": "every_turn", "weight": 0.5, "feedback": BRIEF_FEEDBACK,
         "description": f"Every turn opens with a thinking span of 1 to {BRIEF_MAX_WORDS} words.",
         "checker": {"type": "python", "args": {"callable": "megatron_tg.demo.paper_env:check_brief_thinking",
                                                "text": "thinking"}}},
    ],
}


def rubric():
    from megatron_tg.judge.rubric import parse_rubric

    return parse_rubric(RUBRIC, source="megatron_tg.demo.paper_env:RUBRIC")


def episode_metrics(task: T.FactTask, turns: Sequence[ParsedTurn], finish_reason: str = "stop") -> dict[str, Any]:
    """:func:`.task.episode_metrics` plus this environment's verdicts: ``answer_style`` (the
    final turn is written ``Answer: VALUE``), ``brief_thinking`` (every turn thinks briefly),
    ``thinking_words`` (mean words of thinking per turn) and ``all_criteria`` (task and all
    three style criteria)."""
    m = T.episode_metrics(task, turns, finish_reason)
    last = turns[-1] if turns else None
    style = (last is not None and not last.tool_calls and not last.errors
             and bool(_ANSWER_STYLE.fullmatch(last.content.strip())))
    brief = bool(turns) and all(1 <= _words(t.thinking or "") <= BRIEF_MAX_WORDS for t in turns)
    words = sum(_words(t.thinking or "") for t in turns) / len(turns) if turns else 0.0
    return {**m, "answer_style": bool(style), "brief_thinking": brief, "thinking_words": words,
            "all_criteria": bool(m["success"] and m["new_format"] and style and brief)}
