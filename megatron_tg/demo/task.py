"""The didactic task (paper §5.1) in the project's real formats: key lookup through ``search``.

A task is a tiny "repository" — one file, ``facts.txt``, of lines ``k<N> = <V>`` — and an
instruction such as "Find the value of k<N>." (:data:`INSTRUCTIONS`). The value is random, so
the agent must call the
``search`` tool (Qwen3-Coder XML tool call, rendered by the chat template) and copy the value
from the tool response into its final answer::

    user:       Find the value of k54.
    assistant:  <tool_call>\\n<function=search>\\n<parameter=query>\\nk54\\n</parameter>\\n
                </function>\\n</tool_call><|im_end|>
    tool:       facts.txt:2: k54 = 55\\nfacts.txt:1: k98 = 71\\nfacts.txt:3: k63 = 84
    assistant:  The value of k54 is 55.<|im_end|>

The NEW tool format adds ``<parameter=lines>\\nN\\n</parameter>`` (return N lines instead of
:data:`DEFAULT_LINES`). The base model (:mod:`megatron_tg.demo.base_model`) never uses it unless
the feedback :data:`FEEDBACK` — framed by the trainer's ``judge.feedback_framing`` and inserted
as a ``user`` message right before the tool-call turn, exactly where
:func:`megatron_tg.chat.feedback.insert_feedback` puts it — is in its context.

What this module provides (used by the base-model build, its tests and the RL runner):

* tasks: :class:`FactTask`, :func:`make_task`, :func:`make_tasks` (seeded, index-stable,
  separate streams per :data:`SPLITS`);
* the tool: :func:`search` (the project's ``search`` output format, a self-contained ranking),
  :func:`run_tool_call` (a parsed call -> the tool response text);
* the verifier: :func:`answer_correct`, :func:`turn_uses_new_format`, :func:`episode_metrics`,
  and the rubric (:data:`RUBRIC`, :func:`rubric`): ``answer`` (a ``python`` checker,
  :func:`check_answer`) and ``search_lines`` (the project's ``tool_format`` checker, same
  arguments and feedback as ``recipes/rubrics/tool_format.yaml``);
* transcripts: :func:`reference_messages` (what SFT imitates), :func:`hint_message`;
* the multi-turn driver lives in :mod:`.episodes` (:func:`~.episodes.run_episodes` /
  :func:`~.episodes.run_episode`, over any ``generate(input_ids) -> output_ids``, returning
  token-exact :class:`~megatron_tg.rollout.types.Rollout` objects).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from megatron_tg.agent.tools import MAX_SEARCH_LINES
from megatron_tg.chat.feedback import FRAMINGS
from megatron_tg.chat.parsing import ParsedTurn, ToolCall, ToolCallError
from megatron_tg.judge.checkers import CheckerError, ToolFormatChecker

# ------------------------------------------------------------------------------ constants
SEARCH_TOOL = "search"
LINES_PARAM = "lines"
DEFAULT_LINES = 3
"""Lines ``search`` returns without ``lines`` (the old format)."""
FACTS_PATH = "facts.txt"
KEY_RANGE = (10, 99)         # keys k10 .. k99 (two digits, like the values)
VALUE_RANGE = (10, 99)       # two-digit values: never guessable (1/90)
N_FACTS = (1, 8)             # lines per repository (few lines: short old-format results too)
NEW_FORMAT_LINES = (1, DEFAULT_LINES)  # N the demonstrations use: results never longer than the old format's

FEEDBACK = "Use the lines= argument of the search tool."
"""The ``search_lines`` criterion's feedback; identical to ``recipes/rubrics/tool_format.yaml``."""
FEEDBACK_ROLE = "user"
"""Chat role of the inserted feedback message (the trainer's default ``judge.feedback_role``)."""


def default_feedback_framing() -> str:
    """The trainer's default ``judge.feedback_framing`` (read from the config dataclass)."""
    from megatron_tg.config.rollout import JudgeConfig

    return JudgeConfig.feedback_framing


def hint_text(feedback: str = FEEDBACK, framing: str | None = None) -> str:
    """The text of the message the trainer inserts before a failing turn: ``framing`` (default:
    the config's ``judge.feedback_framing``) with ``{feedback}`` replaced."""
    framing = default_feedback_framing() if framing is None else framing
    if "{feedback}" not in framing:
        raise ValueError(f"framing must contain {{feedback}}, got {framing!r}")
    return framing.replace("{feedback}", feedback)


HINT = hint_text()
"""The full hint the base model is trained with (default framing around :data:`FEEDBACK`)."""


def hint_message(text: str = HINT, role: str = FEEDBACK_ROLE) -> dict[str, str]:
    if role not in FRAMINGS:
        raise ValueError(f"role must be one of {FRAMINGS}, got {role!r}")
    return {"role": role, "content": text}


# ------------------------------------------------------------------------------ tasks
INSTRUCTIONS = (
    "Find the value of {key}.",
    "What is the value of {key}?",
    "Look up {key} in the repository and tell me its value.",
    "Which value does {key} have?",
    "Search the repository for {key} and report the value.",
    "I need the value of {key}, please find it.",
    "Tell me the value of {key}.",
    "Please check the facts file: what is {key} set to?",
)
"""Instruction phrasings (of different lengths: with a single phrasing the model's copy skill
was tied to absolute offsets and broke, 0.39–0.47 success, once a ``lines`` argument shifted
the context without the hint — the state TG's student is in)."""

@dataclass(frozen=True)
class FactTask:
    id: str
    key: str
    """The key to look up, e.g. ``k54``."""
    value: int
    facts: tuple[tuple[str, int], ...]
    """The repository: ``facts.txt`` line i+1 is ``f"{facts[i][0]} = {facts[i][1]}"``."""
    phrasing: int = 0
    """Index into :data:`INSTRUCTIONS`."""

    @property
    def instruction(self) -> str:
        return INSTRUCTIONS[self.phrasing].format(key=self.key)

    @property
    def answer(self) -> str:
        return str(self.value)

    def file_lines(self) -> list[str]:
        return [f"{k} = {v}" for k, v in self.facts]

    def prompt_messages(self) -> list[dict[str, str]]:
        """The rollout prompt (no system message, no tool list: the tool is learned in SFT)."""
        return [{"role": "user", "content": self.instruction}]

    def info(self) -> dict[str, Any]:
        """JSON-able privileged info (the judge's ``task_info`` / rollout metadata)."""
        return {"task_id": self.id, "key": self.key, "answer": self.answer,
                "facts": [list(f) for f in self.facts], "instruction": self.instruction}


SPLITS = ("rl", "eval", "sft", "tokenizer")
"""Independent task streams: ``sft`` (base-model demonstrations), ``tokenizer`` (BPE corpus),
``eval`` (held-out evaluation) and ``rl`` (the RL runner's prompts)."""


def make_task(seed: int, index: int, split: str = "rl") -> FactTask:
    """Task ``index`` of the stream (``split``, ``seed``): independent of how many tasks are drawn."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"demo-task:{split}:{seed}:{index}")
    n = rng.randint(*N_FACTS)
    keys = rng.sample(range(KEY_RANGE[0], KEY_RANGE[1] + 1), n)
    facts = tuple((f"k{k}", rng.randint(*VALUE_RANGE)) for k in keys)
    key, value = facts[rng.randrange(n)]
    return FactTask(id=f"{split}-{seed}-{index}", key=key, value=value, facts=facts,
                    phrasing=rng.randrange(len(INSTRUCTIONS)))


def make_tasks(n: int, seed: int, start: int = 0, split: str = "rl") -> list[FactTask]:
    return [make_task(seed, i, split) for i in range(start, start + n)]


# ------------------------------------------------------------------------------ the tool
_WORDS = re.compile(r"[a-z0-9_]+")


def search(task: FactTask, query: str, lines: int | None = None) -> str:
    """``search`` over the task's repository, in the project's output format (``path:line:
    text``, best match first, like :class:`megatron_tg.agent.tools.Tools`' ``search``): every
    line is ranked — 2 points per query word that is a word of the line, 1 per query word that
    is part of one (``k4`` in ``k48``), ties in file order — and the top ``lines`` (default
    :data:`DEFAULT_LINES`) are returned, so the looked-up key's line comes first. A
    self-contained ranking on purpose: the SFT data and the cached base model must not change
    when the project's code search is tuned. Raises ValueError for a bad ``lines``."""
    n = DEFAULT_LINES if lines is None else lines
    if not 1 <= n <= MAX_SEARCH_LINES:
        raise ValueError(f"search: lines must be between 1 and {MAX_SEARCH_LINES}, got {n}")
    q = _WORDS.findall(query.lower())
    if not q:
        return f"No matches for {query!r}."
    scored = []
    for no, line in enumerate(task.file_lines(), start=1):
        words = set(_WORDS.findall(line.lower()))
        s = sum(2 if w in words else (1 if any(w in x for x in words) else 0) for w in q)
        scored.append((-s, no, line))
    scored.sort()
    return "\n".join(f"{FACTS_PATH}:{no}: {line}" for _, no, line in scored[:n])


def run_tool_call(task: FactTask, call: ToolCall | ToolCallError) -> str:
    """The tool response the agent sees for one parsed call. Never raises: errors become
    ``Error: ...`` text, as in :class:`megatron_tg.agent.tools.Tools`."""
    if isinstance(call, ToolCallError):
        return f"Error: malformed tool call ({call.message})"
    if call.name != SEARCH_TOOL:
        return f"Error: unknown tool {call.name!r}; available tools: {SEARCH_TOOL}"
    unknown = [k for k in call.arguments if k not in ("query", LINES_PARAM)]
    if unknown:
        return f"Error: search: unknown parameter(s) {unknown}; parameters: ['query', 'lines']"
    if "query" not in call.arguments:
        return "Error: search: missing required parameter(s) ['query']"
    lines = None
    if LINES_PARAM in call.arguments:
        raw = call.arguments[LINES_PARAM].strip()
        if not re.fullmatch(r"[0-9]+", raw):
            return f"Error: search: lines must be an integer, got {raw!r}"
        lines = int(raw)
    try:
        return search(task, call.arguments["query"].strip(), lines)
    except ValueError as e:
        return f"Error: {e}"


# ------------------------------------------------------------------------------ verifier
_NUMBER = re.compile(r"(?<![A-Za-z0-9_])[0-9]+(?![A-Za-z0-9_])")


def answer_correct(text: str, answer: str | int) -> bool:
    """The answer text states the value and no other number (key names like ``k54`` are not
    numbers), so listing every value of the repository does not count."""
    return set(_NUMBER.findall(text)) == {str(int(answer))}


def _answer_of(ctx: Any) -> str:
    task = getattr(ctx, "task", None)
    if isinstance(task, FactTask):
        return task.answer
    if isinstance(task, Mapping) and "answer" in task:
        return str(task["answer"])
    md = getattr(ctx, "metadata", None) or {}
    if "answer" in md:
        return str(md["answer"])
    raise CheckerError("no answer: pass the FactTask (or its info()) as task_info, or put "
                       "'answer' in the rollout metadata")


def check_answer(text: str, ctx: Any) -> tuple[bool, str]:
    """``python`` checker (``megatron_tg.demo.task:check_answer``) for the task criterion, on
    the final turn's content: passes iff the turn makes no tool call and states the value."""
    answer = _answer_of(ctx)
    turn = getattr(ctx, "turn", None)
    if turn is not None and (turn.tool_calls or turn.tool_call_errors):
        return False, "the final turn is a tool call, not an answer"
    if turn is not None and not turn.parsed.terminated:
        return False, "the final turn was cut off"
    if answer_correct(text, answer):
        return True, ""
    return False, f"expected the value {answer} and no other number"


NEW_FORMAT_CHECKER = ToolFormatChecker(tool=SEARCH_TOOL, parameter=LINES_PARAM, value_pattern="[0-9]+")
"""The project's ``tool_format`` checker with the arguments of ``recipes/rubrics/tool_format.yaml``."""


def search_calls(turn: ParsedTurn) -> list[ToolCall | ToolCallError]:
    return [c for c in list(turn.tool_calls) + list(turn.errors) if c.name == SEARCH_TOOL]


def turn_uses_new_format(turn: ParsedTurn) -> bool:
    """Every search call of the turn passes ``lines`` (vacuously true without calls)."""
    return all(NEW_FORMAT_CHECKER.check_call(c)[0] for c in list(turn.tool_calls) + list(turn.errors))


RUBRIC: dict[str, Any] = {
    "name": "demo_find",
    "description": "Didactic TG task: look a key up with search; new format = search with lines=.",
    "criteria": [
        {"name": "answer", "scope": "final_turn", "weight": 1.0, "primary": True, "feedback": None,
         "description": "The final answer states the looked-up value.",
         "checker": {"type": "python", "args": {"callable": "megatron_tg.demo.task:check_answer"}}},
        {"name": "search_lines", "scope": "any_tool_call", "weight": 0.5, "feedback": FEEDBACK,
         "description": "Every search call passes the new lines= argument.",
         "checker": {"type": "tool_format",
                     "args": {"tool": SEARCH_TOOL, "parameter": LINES_PARAM, "value_pattern": "[0-9]+"}}},
    ],
}


def rubric():
    """:data:`RUBRIC` parsed into a :class:`megatron_tg.judge.rubric.Rubric` (judge with the
    task's :class:`FactTask` or ``info()`` as ``task_info``)."""
    from megatron_tg.judge.rubric import parse_rubric

    return parse_rubric(RUBRIC, source="megatron_tg.demo.task:RUBRIC")


# ------------------------------------------------------------------------------ transcripts
def _call(args: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": SEARCH_TOOL, "arguments": args}}


def reference_messages(task: FactTask, *, new_format: bool, lines: int | None = None,
                       hint: str | None = None, hint_role: str = FEEDBACK_ROLE) -> list[dict[str, Any]]:
    """The demonstration SFT imitates: search for the key (old format, or new with ``lines``),
    then answer. With ``hint`` the hint message sits right before the tool-call turn (the
    place :func:`insert_feedback` uses for a feedback on turn 0)."""
    args: dict[str, Any] = {"query": task.key}
    if new_format:
        args[LINES_PARAM] = str(lines if lines is not None else DEFAULT_LINES)
    msgs: list[dict[str, Any]] = list(task.prompt_messages())
    if hint is not None:
        msgs.append(hint_message(hint, hint_role))
    n = int(args[LINES_PARAM]) if new_format else None
    msgs += [
        {"role": "assistant", "content": "", "tool_calls": [_call(args)]},
        {"role": "tool", "content": search(task, task.key, n)},
        {"role": "assistant", "content": f"The value of {task.key} is {task.value}."},
    ]
    return msgs


def episode_metrics(task: FactTask, turns: Sequence[ParsedTurn], finish_reason: str = "stop") -> dict[str, Any]:
    """Per-episode verdicts.

    * ``success``: the episode ended on its own with a final turn (no tool call) stating the value;
    * ``new_format``: at least one search call and every search call passes ``lines``;
    * ``format_ok``: the rubric's ``search_lines`` verdict (no search call = vacuous pass);
    * ``first_call_new_format``: the first search call passes ``lines`` (None: no search call).
    """
    calls = [c for t in turns for c in search_calls(t)]
    fmt = [NEW_FORMAT_CHECKER.check_call(c)[0] for c in calls]
    last = turns[-1] if turns else None
    success = (finish_reason == "stop" and last is not None and last.terminated
               and not last.tool_calls and not last.errors and answer_correct(last.content, task.answer))
    return {
        "success": bool(success),
        "new_format": bool(calls) and all(fmt),
        "format_ok": all(turn_uses_new_format(t) for t in turns),
        "first_call_new_format": fmt[0] if fmt else None,
        "n_search_calls": len(calls),
        "n_turns": len(turns),
    }
