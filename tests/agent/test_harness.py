"""The agent harness end to end with a scripted engine (pre-written assistant turns returned
as token ids), through the real tools, sandbox and hidden tests."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from megatron_tg.agent import AgentHarness, Task, builtin_tasks, run_standalone
from megatron_tg.agent.harness import DEFAULT_SYSTEM_PROMPT
from megatron_tg.agent.tools import tool_specs
from megatron_tg.chat import assistant_generation_text, prompt_ids
from megatron_tg.config.rollout import RolloutConfig
from megatron_tg.judge.checkers import CHECKERS, CheckContext

from .conftest import ScriptedClient

BAD_CALL = ("<tool_call>\n<function=read_file>\n<parameter=path>\nshop/pricing.py\n</function>\n"
            "</tool_call><|im_end|>")  # </parameter> missing


def turn(tok, content="", thinking=None, *calls):
    msg = {"role": "assistant", "content": content,
           "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    if thinking:
        msg["reasoning_content"] = thinking
    return assistant_generation_text(tok, msg)


@pytest.fixture(scope="module")
def tasks():
    return {t.id: t for t in builtin_tasks()}


@pytest.fixture
def harness(tok, sandbox):
    cfg = RolloutConfig(max_turns=10, max_new_tokens=512, max_context_tokens=4096)
    return AgentHarness(tok, cfg, sandbox=sandbox)


def rollout(harness, client, task, **kw):
    return asyncio.run(run_standalone(harness, client, task, **kw))


def decode(tok, r, seg):
    return tok.decode(r.token_ids[seg.start:seg.end], skip_special_tokens=False)


def test_scripted_episode_is_token_exact_and_passes_hidden_tests(tok, harness, tasks):
    script = [
        turn(tok, "", "Find the discount code.", ("search", {"query": "apply discount"})),
        turn(tok, "", None, ("search", {"query": "apply discount", "lines": 2})),
        BAD_CALL,
        turn(tok, "Reading.", None, ("read_file", {"path": "shop/pricing.py"}),
             ("run_shell", {"command": "ls; cat _hidden_test.py; mkfifo /tmp/pipe"})),
        turn(tok, "", None, ("edit_file", {"path": "shop/pricing.py", "old_string": "amount - percent",
                                            "new_string": "amount * (1 - percent / 100)"})),
        turn(tok, "", None, ("run_tests", {})),
        turn(tok, "Fixed the discount: it is now a percentage of the amount."),
    ]
    client = ScriptedClient(tok, script, weight_version="3")
    r = rollout(harness, client, tasks["shop_discount"], version=3)
    r.validate(vocab_size=len(tok))
    assert (r.finish_reason, r.num_turns, r.metadata["tests_passed"]) == ("stop", 7, True), r.metadata
    assert {k: r.metadata[k] for k in ("tool_calls", "malformed_tool_calls", "search_calls",
                                       "search_calls_with_lines")} == {"tool_calls": 6, "malformed_tool_calls": 1,
                                                                       "search_calls": 2, "search_calls_with_lines": 1}
    # Token exactness: the prompt is the template's rendering; every request is a prefix of
    # the rollout; every assistant turn is exactly the engine's ids and log-probs.
    task = tasks["shop_discount"]
    expect_prompt = prompt_ids(tok, [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                     {"role": "user", "content": task.instruction}], tool_specs(5))
    assert r.token_ids[: r.segments[0].end] == expect_prompt
    for req, out, seg in zip(client.requests, client.outputs, r.assistant_turns()):
        assert req["input_ids"] == r.token_ids[: seg.start]
        assert r.token_ids[seg.start: seg.end] == out.output_ids and seg.logprobs == out.output_logprobs
        assert seg.policy_version == 3 and seg.meta["versions"] == [3]
    assert r.turn(0).thinking is not None and len(r.turn(0).tool_calls) == 1 and len(r.turn(3).tool_calls) == 2
    tool_segs = [s for s in r.segments if s.kind == "tool"]
    assert len(tool_segs) == 6  # after every turn but the final one
    obs = [decode(tok, r, s) for s in tool_segs]
    assert len([ln for ln in obs[0].split("<tool_response>\n")[1].split("\n</tool_response>")[0].splitlines()]) == 5
    assert obs[1].count("shop/") == 2 and "shop/pricing.py:5:" in obs[1]  # lines=2; the def line
    assert "malformed tool call to read_file" in obs[2] and tool_segs[2].meta["calls"][0]["malformed"]
    assert "def apply_discount" in obs[3] and "No such file" in obs[3]  # hidden test invisible
    assert obs[3].count("<tool_response>") == 2
    assert "exit code: 0" in obs[5] and "ok" in obs[5]
    # The judge's tests_pass checker reads the result.
    ctx = CheckContext(scope="rollout", transcript=None, metadata=r.metadata)
    assert CHECKERS["tests_pass"]()(None, ctx)[0] is True


def test_giving_up_fails_hidden_tests_and_a_fake_hidden_test_does_not_help(tok, harness, tasks):
    client = ScriptedClient(tok, [turn(tok, "I cannot do this.")])
    r = rollout(harness, client, tasks["fizzbuzz"])
    assert (r.finish_reason, r.num_turns, r.metadata["tests_passed"]) == ("stop", 1, False)
    assert "NotImplementedError" in r.metadata["tests"]["output"]
    cheat = turn(tok, "", None, ("write_file", {"path": "_hidden_test.py", "content": "print('pass')\n"}))
    r = rollout(harness, ScriptedClient(tok, [cheat, turn(tok, "Done.")]), tasks["fizzbuzz"])
    assert r.metadata["tests_passed"] is False  # the real hidden test overwrote the agent's file


def test_turn_limit_and_truncated_turn(tok, harness, tasks):
    h = AgentHarness(tok, replace(harness.cfg, max_turns=2), sandbox=harness.sandbox)
    calls = [turn(tok, "", None, ("list_dir", {}))] * 3
    r = rollout(h, ScriptedClient(tok, calls), tasks["fizzbuzz"])
    assert (r.finish_reason, r.num_turns) == ("max_turns", 2)
    assert r.segments[-1].kind == "assistant"  # no tool output after the last turn
    cut = turn(tok, "", None, ("list_dir", {}))[:-len("<|im_end|>")]  # no stop token: cut by length
    r = rollout(harness, ScriptedClient(tok, [cut]), tasks["fizzbuzz"])
    assert (r.finish_reason, r.num_turns) == ("length", 1)


def test_context_limit(tok, harness, tasks):
    task = tasks["fizzbuzz"]
    n_prompt = len(prompt_ids(tok, [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                    {"role": "user", "content": task.instruction}], tool_specs(5)))
    cfg = replace(harness.cfg, max_context_tokens=n_prompt + 120, max_new_tokens=100)
    h = AgentHarness(tok, cfg, sandbox=harness.sandbox)
    big = turn(tok, "", None, ("run_shell", {"command": "python -c \"print('y' * 3000)\""}))
    client = ScriptedClient(tok, [big, turn(tok, "done")])
    r = rollout(h, client, task)
    assert r.finish_reason == "length" and len(r.token_ids) <= cfg.max_context_tokens
    assert client.requests[0]["params"]["max_new_tokens"] == 100
    # a turn longer than the remaining room is cut by max_new_tokens
    cfg = replace(harness.cfg, max_context_tokens=n_prompt + 20, max_new_tokens=100)
    client = ScriptedClient(tok, [big])
    r = rollout(AgentHarness(tok, cfg, sandbox=harness.sandbox), client, task)
    assert r.finish_reason == "length" and len(r.token_ids) == n_prompt + 20
    assert client.requests[0]["params"]["max_new_tokens"] == 20


def test_tasks_as_dicts_and_malformed_only_turn_continues(tok, harness):
    task = {"id": "inline", "instruction": "Say hi.", "fail_to_pass": ["test_hi.py::test_hi"],
            "hidden_files": {"test_hi.py": "def test_hi():\n    assert open('hi.txt').read() == 'hi'\n"}}
    script = ["<tool_call>\n<function=>\n</function>\n</tool_call><|im_end|>",
              turn(tok, "", None, ("write_file", {"path": "hi.txt", "content": "hi"})),
              turn(tok, "Done.")]
    r = rollout(harness, ScriptedClient(tok, script), Task.from_dict(task))
    assert r.num_turns == 3 and r.metadata["malformed_tool_calls"] == 1 and r.metadata["tests_passed"] is True
    assert r.metadata["tests"]["results"] == {"test_hi.py::test_hi": "passed"}


def test_a_call_sglang_would_read_differently_is_not_executed(tok, harness):
    """rollout.tool_call_reading=strict (default): a value with "<parameter=" text means one
    thing here and another to SGLang's parser, so the harness executes neither reading."""
    task = {"id": "ambiguous", "instruction": "Write t.py.", "fail_to_pass": ["test_t.py::test_t"],
            "hidden_files": {"test_t.py": "def test_t():\n    import t\n"}}
    ambiguous = ("<tool_call>\n<function=write_file>\n<parameter=path>\nt.py\n</parameter>\n"
                 "<parameter=content>\nprint('<parameter=x>')\n</parameter>\n</function>\n"
                 "</tool_call><|im_end|>")
    r = rollout(harness, ScriptedClient(tok, [ambiguous, turn(tok, "Done.")]), Task.from_dict(task))
    assert harness.cfg.tool_call_reading == "strict"
    assert r.metadata["malformed_tool_calls"] == 1 and r.metadata["tests_passed"] is False
