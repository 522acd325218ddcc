"""Rubric loading, rule checkers on positive / negative transcripts, scopes and results."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from megatron_tg.chat.builder import simulate_rollout
from megatron_tg.chat.feedback import insert_feedback
from megatron_tg.judge import (
    Judge,
    JudgeResult,
    RubricError,
    Transcript,
    load_rubric,
    parse_rubric,
    split_trainable,
)
from tests.chat.convos import call, conversation

RUBRICS = Path(__file__).resolve().parents[2] / "recipes" / "rubrics"

TABLE = "| File | Change |\n|---|:---:|\n| a.py | fix |"
SEARCH_OK = ("<tool_call>\n<function=search>\n<parameter=query>\nfoo\n</parameter>\n"
             "<parameter=lines>\n5\n</parameter>\n</function>\n</tool_call>")
SEARCH_NO_LINES = "<tool_call>\n<function=search>\n<parameter=query>\nfoo\n</parameter>\n</function>\n</tool_call>"
RUN = "<tool_call>\n<function=run>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
POEM = "Tests were failing red,\nI traced the bug to its bed,\nnow green lies ahead."


def rubric(checker_type, args=None, scope="final_turn", name="c", feedback="Do better.", **kw):
    crit = {"name": name, "scope": scope, "weight": 0.5, "feedback": feedback,
            "checker": {"type": checker_type, "args": args or {}}, **kw}
    return parse_rubric({"name": "t", "criteria": [crit]})


def run(rb, texts, metadata=None):
    tr = Transcript.from_assistant_texts(texts, metadata=metadata)
    return Judge(rb).judge_sync(tr)


CASES = [
    # (checker, args, scope, passing turns, failing turns)
    ("regex", {"pattern": r"(?i)summary"}, "final_turn", ["Summary: done"], ["Done."]),
    ("regex", {"pattern": r"TODO", "must_match": False}, "final_turn", ["Done."], ["TODO: tests"]),
    ("regex", {"pattern": "^ok$", "flags": ["MULTILINE"]}, "final_turn", ["x\nok\ny"], ["x ok y"]),
    ("markdown_table", {}, "final_turn", [f"Changes:\n\n{TABLE}\n\nBye."], ["| a | b |\nno delimiter"]),
    ("markdown_table", {}, "final_turn", ["|a|b|\n|-|-|\n|1|2|"], [f"```\n{TABLE}\n```"]),
    ("markdown_table", {"min_columns": 3}, "final_turn", ["|a|b|c|\n|--|--|--|\n|1|2|3|"], [TABLE]),
    ("markdown_table", {"min_rows": 1}, "final_turn", [TABLE], ["| a | b |\n|---|---|\n\ntext"]),
    ("bold", {"min_count": 2}, "final_turn", ["**Fixed** and __tested__."], ["**Fixed** only."]),
    ("bold", {}, "final_turn", ["**yes**"], ["`**code**` and ** spaced **"]),
    ("tool_format", {"tool": "search", "parameter": "lines"}, "any_tool_call",
     [f"Looking.\n\n{SEARCH_OK}\n{RUN}"], [f"Looking.\n\n{RUN}\n{SEARCH_NO_LINES}"]),
    ("tool_format", {"tool": "search", "parameter": "lines", "value_pattern": "[0-9]+"},
     "any_tool_call", [SEARCH_OK], [SEARCH_OK.replace("\n5\n", "\nfive\n")]),
    ("tool_format", {"tool": "search", "parameter": "lines"}, "any_tool_call",
     ["No tools this turn."], ["<tool_call>\n<function=search>\n<parameter=lines>\n1\n</function>\n</tool_call>"]),
    ("tool_format", {"tool": "search", "parameter": "lines"}, "every_turn",
     [SEARCH_OK], [SEARCH_NO_LINES]),
    ("poem", {}, "every_turn", [f"{POEM}\n\nNow running the tests."],
     ["Now running the tests."]),
    ("poem", {}, "every_turn", [f"Intro.\n\n{POEM}"], [f"{POEM}\nand a fourth line here"]),
    ("poem", {}, "every_turn", [POEM], ["- a list item\n- another item\n- a third item"]),
    ("poem", {}, "every_turn", [POEM],
     ["This line is far too long to be a line of any short status poem at all, really.\nb c\nd e"]),
    ("poem", {"title_pattern": "(?i)^status"}, "every_turn", [f"Status poem:\n{POEM}"], [POEM]),
    ("poem", {"lines": 2}, "every_turn", ["Red turned green,\nall tests clean."], [POEM]),
    ("poem", {}, "every_turn", [POEM], [f"```\n{POEM}\n```"]),
]


@pytest.mark.parametrize("checker,args,scope,good,bad", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_checkers_positive_and_negative(checker, args, scope, good, bad):
    rb = rubric(checker, args, scope)
    ok = run(rb, good)
    assert ok.trainable and ok.passed == {"c": True}, ok.criteria["c"].detail
    assert ok.total_reward == 0.5 and ok.failing_turns() == {}
    ko = run(rb, bad)
    assert ko.trainable and ko.passed == {"c": False}
    assert ko.total_reward == 0.0 and ko.criteria["c"].detail
    assert ko.failing_turns() == {0: [("c", "Do better.")]}


def test_scopes_attribute_failures_to_turns():
    texts = [f"{POEM}\n\nSearching.\n\n{SEARCH_NO_LINES}", "No poem here.\n\n" + SEARCH_OK,
             f"{POEM}\n\n{SEARCH_NO_LINES}\n{SEARCH_OK}", "Final answer, **bold**."]
    every = run(rubric("poem", scope="every_turn"), texts)
    assert every.criteria["c"].failing_turns == [1, 3]
    calls = run(rubric("tool_format", {"tool": "search", "parameter": "lines"}, "any_tool_call"), texts)
    assert calls.criteria["c"].failing_turns == [0, 2]
    final = run(rubric("bold", {"min_count": 2}), texts)
    assert final.criteria["c"].failing_turns == [3]
    whole = run(rubric("regex", {"pattern": "nope"}, scope="rollout"), texts)
    assert whole.criteria["c"].failing_turns == [3]  # rollout scope: the last assistant turn
    whole = run(rubric("regex", {"pattern": "tool_response", "text": "transcript"}, scope="rollout"),
                texts)
    assert not whole.criteria["c"].passed
    # no assistant turn at all: a turn-scoped criterion fails, with no turn to guide
    none = run(rubric("bold"), [])
    assert none.passed == {"c": False} and none.failing_turns() == {}


def test_thinking_text_source():
    rb = rubric("regex", {"pattern": "markdown", "text": "thinking"})
    assert run(rb, ["<think>\nformat with markdown\n</think>\n\nHi."]).passed == {"c": True}
    assert run(rb, ["Hi, markdown."]).passed == {"c": False}


def test_tests_pass_checker():
    rb = rubric("tests_pass", {"key": "tests_passed", "threshold": 0.5}, scope="rollout", feedback=None,
                primary=True)
    for md, expected in [({"tests_passed": True}, True), ({"tests_passed": False}, False),
                         ({"tests_passed": 0.5}, True), ({"tests_passed": {"passed": 1, "total": 3}}, False),
                         ({"tests_passed": {"passed": 0, "total": 0}}, False)]:
        res = run(rb, ["done"], md)
        assert res.trainable and res.passed == {"c": expected}, md
        assert res.failing_turns() == {}  # no feedback string: reward only, no guidance
    for md in [{}, {"tests_passed": "yes"}, {"tests_passed": 2.0}]:
        res = run(rb, ["done"], md)
        assert not res.trainable and res.total_reward is None and "tests_passed" in res.judge_error
        assert res.feedback_by_turn() == {}


def test_python_checker(tmp_path, monkeypatch):
    (tmp_path / "my_checks.py").write_text(textwrap.dedent("""
        def short(text, ctx, limit=10):
            return len(text) <= limit
        def with_reason(text, ctx):
            return ("please" in text, "be polite")
        def sloppy(text, ctx):
            return "yes"
        def broken(text, ctx):
            raise RuntimeError("boom")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run(rubric("python", {"callable": "my_checks:short"}), ["short"]).passed == {"c": True}
    assert run(rubric("python", {"callable": "my_checks.short", "limit": 2}), ["short"]).passed == {"c": False}
    res = run(rubric("python", {"callable": "my_checks:with_reason"}), ["no"])
    assert res.passed == {"c": False} and res.criteria["c"].detail == "be polite"
    for fn, msg in [("sloppy", "expected bool"), ("broken", "boom")]:
        res = run(rubric("python", {"callable": f"my_checks:{fn}"}), ["x"])
        assert not res.trainable and msg in res.judge_error and res.total_reward is None
    with pytest.raises(RubricError, match="checker"):
        rubric("python", {"callable": "my_checks:missing"})
    with pytest.raises(RubricError, match="checker"):
        rubric("python", {"callable": "no_such_module_xyz:f"})


@pytest.mark.parametrize("mutate,msg", [
    (lambda c: c.update(scope="sometimes"), "scope"),
    (lambda c: c.update(weight=-1), "weight"),
    (lambda c: c.update(weight=True), "weight"),
    (lambda c: c.update(primary="yes"), "primary"),
    (lambda c: c.update(feedback=""), "feedback"),
    (lambda c: c.update(name="has space"), "name"),
    (lambda c: c.update(extra=1), "unknown key"),
    (lambda c: c.update(checker={"type": "regex", "pattern": "x"}), "under 'args'"),
    (lambda c: c.update(checker={"type": "nope"}), "unknown checker type"),
    (lambda c: c.update(checker={"type": "regex", "args": {"patern": "x"}}), "bad arguments"),
    (lambda c: c.update(checker={"type": "regex", "args": {"pattern": "("}}), "regex"),
    (lambda c: c.update(checker={"type": "regex", "args": {"pattern": "x", "flags": ["X"]}}), "flags"),
    (lambda c: c.update(checker={"type": "bold", "args": {"text": "everything"}}), "text"),
    (lambda c: c.update(checker={"type": "poem", "args": {"min_lines": 4, "max_lines": 2}}), "min_lines"),
    (lambda c: c.update(checker={"type": "llm", "args": {}}), "question"),
])
def test_rubric_errors_name_the_criterion(mutate, msg):
    crit = {"name": "crit_a", "scope": "final_turn", "feedback": "f",
            "checker": {"type": "regex", "args": {"pattern": "x"}}}
    mutate(crit)
    with pytest.raises(RubricError, match=msg) as ei:
        parse_rubric({"criteria": [crit]}, source="r.yaml")
    assert "r.yaml" in str(ei.value)


def test_rubric_top_level_errors(tmp_path):
    with pytest.raises(RubricError, match="duplicate"):
        parse_rubric({"criteria": [{"name": "a", "scope": "rollout", "checker": {"type": "tests_pass"}}] * 2})
    with pytest.raises(RubricError, match="non-empty"):
        parse_rubric({"criteria": []})
    with pytest.raises(RubricError, match="unknown top-level"):
        parse_rubric({"criteria": [], "crtieria": []})
    p = tmp_path / "bad.yaml"
    p.write_text("criteria: [\n")
    with pytest.raises(RubricError, match="invalid YAML"):
        load_rubric(p)


def test_shipped_rubrics_load():
    style = load_rubric(RUBRICS / "style_suite.yaml")
    assert style.primary_names() == ["tests_pass"]
    assert set(style.names) == {"tests_pass", "markdown_table", "solution_description",
                                "requirements_order", "approval_question", "bolded_key_points",
                                "commands_ran", "suggest_further_work"}
    assert {c.name for c in style.rule_criteria()} == {"tests_pass", "markdown_table", "bolded_key_points"}
    assert all(c.feedback for c in style.criteria if not c.primary)
    with pytest.raises(ValueError, match="no LLM client"):
        Judge(style)
    poem = load_rubric(RUBRICS / "poem.yaml")
    assert poem["status_poem"].scope == "every_turn"
    tf = load_rubric(RUBRICS / "tool_format.yaml")
    assert tf["search_lines"].feedback == "Use the lines= argument of the search tool."


def test_end_to_end_tool_format_rollout_to_expert(tok):
    """Rollout -> judge -> feedback per failing turn -> expert sequence."""
    convo = conversation()  # turn 0 searches without lines, turn 2 with lines
    r = simulate_rollout(tok, convo, metadata={"tests_passed": True}, rollout_id="r7")
    judge = Judge(load_rubric(RUBRICS / "tool_format.yaml"), tokenizer=tok)
    res = judge.judge_sync(r)
    assert res.trainable and res.rollout_id == "r7" and res.group_id == r.group_id
    assert res.passed == {"tests_pass": True, "search_lines": False}
    assert res.total_reward == 1.0
    assert res.reward_sum(["tests_pass"]) == 1.0 and res.reward_sum(["nope"]) is None
    fb = res.feedback_by_turn()
    assert fb == {0: "Use the lines= argument of the search tool."}
    e = insert_feedback(r, fb, tok)
    assert "Use the lines= argument" in tok.decode(e.token_ids)
    # results serialise for logging
    back = JudgeResult.from_dict(res.to_dict())
    assert back.feedback_by_turn() == fb and back.total_reward == 1.0
    ok, bad = split_trainable([res, JudgeResult("x", "t", "g", judge_error="llm down")])
    assert [x.rollout_id for x in ok] == ["r7"] and bad[0].total_reward is None


def test_feedback_joins_multiple_criteria_per_turn():
    rb = parse_rubric({"criteria": [
        {"name": "table", "scope": "final_turn", "feedback": "Add a table.",
         "checker": {"type": "markdown_table"}},
        {"name": "bold", "scope": "final_turn", "feedback": "Use bold.", "checker": {"type": "bold"}},
    ]})
    res = run(rb, ["first", "plain final"])
    assert res.failing_turns() == {1: [("table", "Add a table."), ("bold", "Use bold.")]}
    assert res.feedback_by_turn() == {1: "Add a table.\nUse bold."}


def test_parsed_json_args_in_transcript(tok):
    convo = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": "", "tool_calls": [call("search", query="q", lines=3)]}]
    tr = Transcript.from_rollout(simulate_rollout(tok, convo), tok)
    assert tr.turns[0].tool_calls[0].arguments == {"query": "q", "lines": "3"}
    assert "=== ASSISTANT TURN 0 ===" in tr.render_for_judge()


def test_judge_reads_tool_calls_as_configured(tok):
    """An ambiguous call (a value with <parameter= text) is a malformed call under the strict
    reading, so a tool_format criterion fails it; the judge passes its reading to the parser."""
    from megatron_tg.chat.builder import simulate_rollout
    from tests.chat.convos import SEARCH_TOOL

    value = 'x<parameter=lines>5'
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "find"},
            {"role": "assistant", "content": "", "tool_calls": [call("search", query=value, lines=3)]},
            {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "done"}]
    ro = simulate_rollout(tok, msgs, tools=[SEARCH_TOOL])
    rb = rubric("tool_format", {"tool": "search", "parameter": "lines"}, scope="any_tool_call")
    strict = Judge(rb, tok).transcript(ro)
    assert strict.turns[0].tool_calls == [] and len(strict.turns[0].tool_call_errors) == 1
    assert Judge(rb, tok).judge_sync(ro).passed["c"] is False
