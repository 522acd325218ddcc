"""Framing against Qwen3-Coder-30B-A3B-Instruct's own chat template and special-token ids.

The tokenizer (``tests/chat/qwen3_coder.py``) carries the model's published
``tokenizer_config.json`` unchanged; every expectation below is the template's own rendering,
never a string written here, except where a test pins a documented behaviour of the template
(what it does to thinking, to non-string argument values, to content around calls).
"""

from __future__ import annotations

import pytest

from megatron_tg.chat.builder import RolloutBuilder, simulate_rollout
from megatron_tg.chat.framing import (
    assistant_generation_text, continuation_ids, encode, fold_reasoning, generation_prompt_ids,
    insert_feedback, parse_assistant, render, stop_token_id)

from .convos import SEARCH_TOOL, call
from .qwen3_coder import build_qwen3_coder_tokenizer, published_config


@pytest.fixture(scope="module")
def qtok(tmp_path_factory):
    return build_qwen3_coder_tokenizer(tmp_path_factory.mktemp("qwen3_coder_tok"))


def _upto_last_stop(text: str, stop: str = "<|im_end|>") -> str:
    return text[: text.rfind(stop) + len(stop)]


def agent_conversation() -> list[dict]:
    """Multi-call turns, consecutive tool responses, empty content, non-string argument values,
    content around calls with stray whitespace, and a final answer."""
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the off-by-one bug in count()."},
        {"role": "assistant", "content": "  Let me look.\n",
         "tool_calls": [call("search", query="def count", lines=5)]},
        {"role": "tool", "content": "src/util.py:12: def count(items):"},
        {"role": "assistant", "content": "",
         "tool_calls": [call("edit_file", path="src/util.py", old="n - 1", new="n",
                             flags={"dry_run": False, "count": 1}, ranges=[[1, 2], [5, 9]]),
                        call("run", command="pytest -q", timeout=2.5, verbose=True, env=None)]},
        {"role": "tool", "content": "ok"},
        {"role": "tool", "content": "3 passed in 0.01s"},
        {"role": "user", "content": "Great. Anything else?"},
        {"role": "assistant", "content": "",
         "tool_calls": [call("search", query="count(")]},
        {"role": "tool", "content": "src/app.py:3: count(xs)"},
        {"role": "tool", "content": ""},
        {"role": "assistant", "content": "| File | Change |\n|---|---|\n| `src/util.py` | bound |\n"},
    ]


def test_special_token_ids_are_the_published_ones(qtok):
    cfg = published_config()
    real = {t["content"]: int(i) for i, t in cfg["added_tokens_decoder"].items()}
    assert {t: qtok.convert_tokens_to_ids(t) for t in real} == real
    assert real["<|im_end|>"] == 151645 and real["<tool_call>"] == 151657 and real["<think>"] == 151667
    assert qtok.eos_token == cfg["eos_token"] == "<|im_end|>"
    assert stop_token_id(qtok) == 151645
    assert generation_prompt_ids(qtok)[0] == real["<|im_start|>"]
    assert qtok.decode(generation_prompt_ids(qtok)) == "<|im_start|>assistant\n"
    for tag in ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>"):
        assert encode(qtok, f"a{tag}b")[1] == real[tag]  # one id, even glued to text
    assert qtok.chat_template == cfg["chat_template"]


@pytest.mark.parametrize("tools", [None, [SEARCH_TOOL]])
def test_prompt_turns_and_continuations_equal_the_whole_rendering(qtok, tools):
    convo = agent_conversation()
    r = simulate_rollout(qtok, convo, tools=tools)
    whole = render(qtok, convo, tools=tools)
    assert r.token_ids == encode(qtok, _upto_last_stop(whole))
    assert [s.kind for s in r.segments] == ["prompt", "assistant", "tool", "assistant", "user",
                                           "assistant", "tool", "assistant"]
    g = generation_prompt_ids(qtok)
    for s in r.segments:
        tail = r.token_ids[s.end - len(g):s.end] if s.kind != "assistant" else r.token_ids[s.end - 1:s.end]
        assert tail == (g if s.kind != "assistant" else [151645])


def test_turn_by_turn_with_parsed_history_matches_rendering(qtok):
    """The harness path: each generated turn's parse (string argument values, as read back)
    becomes history, and the continuation after it is still the template's own text."""
    convo = agent_conversation()
    b = RolloutBuilder(qtok, convo[:2], tools=[SEARCH_TOOL], task_id="t")
    i = 2
    while i < len(convo):
        ids = encode(qtok, assistant_generation_text(qtok, convo[i]))
        parsed = b.add_assistant(ids, [0.0] * len(ids), 0)
        assert parsed.terminated and not parsed.errors
        j = i + 1
        while j < len(convo) and convo[j]["role"] != "assistant":
            j += 1
        if j > i + 1:
            b.add_messages(convo[i + 1:j])
        i = j
    assert b.token_ids == encode(qtok, _upto_last_stop(render(qtok, convo, tools=[SEARCH_TOOL])))


def test_parsing_reads_back_the_templates_values(qtok):
    """Non-string values come back as the template wrote them: Python ``str()`` (True, None,
    2.5, dict/list reprs). Content around calls is trimmed by the template."""
    convo = agent_conversation()
    texts = [assistant_generation_text(qtok, m) for m in convo if m["role"] == "assistant"]
    p0, p1, p2, p3 = (parse_assistant(t) for t in texts)
    assert p0.content == "Let me look." and [c.arguments for c in p0.tool_calls] == [
        {"query": "def count", "lines": "5"}]
    assert p1.content == "" and [c.name for c in p1.tool_calls] == ["edit_file", "run"]
    assert p1.tool_calls[0].arguments == {"path": "src/util.py", "old": "n - 1", "new": "n",
                                          "flags": "{'dry_run': False, 'count': 1}",
                                          "ranges": "[[1, 2], [5, 9]]"}
    assert p1.tool_calls[1].arguments == {"command": "pytest -q", "timeout": "2.5",
                                          "verbose": "True", "env": "None"}
    assert texts[1].startswith("<tool_call>\n<function=edit_file>")  # empty content: no text
    assert "</tool_call>\n<tool_call>" in texts[1]                     # calls joined by "\n"
    assert texts[0].startswith("Let me look.\n\n<tool_call>")           # trimmed, then "\n\n"
    assert p2.tool_calls[0].arguments == {"query": "count("}
    assert p3.tool_calls == [] and p3.content.startswith("| File |")
    assert texts[3].endswith("| bound |\n<|im_end|>")                   # no-call content untrimmed


def test_consecutive_tool_responses_are_one_user_turn(qtok):
    convo = agent_conversation()
    r = simulate_rollout(qtok, convo)
    tool_seg = r.segments[4]
    text = qtok.decode(r.token_ids[tool_seg.start:tool_seg.end])
    assert text == ("\n<|im_start|>user\n<tool_response>\nok\n</tool_response>\n"
                    "<tool_response>\n3 passed in 0.01s\n</tool_response>\n<|im_end|>\n"
                    "<|im_start|>user\nGreat. Anything else?<|im_end|>\n<|im_start|>assistant\n")
    ids = continuation_ids(qtok, [{"role": "tool", "content": "a"}, {"role": "tool", "content": ""}])
    assert qtok.decode(ids).count("<|im_start|>user") == 1


def test_feedback_insertion_matches_the_rendering_with_the_feedback_message(qtok):
    convo = agent_conversation()
    r = simulate_rollout(qtok, convo, tools=[SEARCH_TOOL])
    fb = {1: "Use the lines= argument.", 2: "Run the tests first."}
    e = insert_feedback(r, fb, qtok)
    asst = [i for i, m in enumerate(convo) if m["role"] == "assistant"]
    with_fb = list(convo)
    for k in sorted(fb, reverse=True):
        with_fb.insert(asst[k], {"role": "user", "content": fb[k]})
    upto = with_fb[: asst[2] + 3]
    assert e.token_ids == encode(qtok, _upto_last_stop(render(qtok, upto, tools=[SEARCH_TOOL])))
    for k in fb:  # the failing turns' tokens are untouched and keep their logit slots
        t = r.assistant_turns()[k]
        a = e.position_map[t.start]
        assert e.token_ids[a:a + t.end - t.start] == r.token_ids[t.start:t.end]
        assert e.token_ids[a - len(generation_prompt_ids(qtok)):a] == generation_prompt_ids(qtok)


def test_thinking_is_dropped_by_the_template_and_folded_into_content(qtok):
    """Qwen3-Coder's template ignores ``reasoning_content`` (the model does not think), so a
    thinking transcript is rendered with ``<think>`` at the start of the content; the rollout
    then equals the rendering of the folded conversation and the thinking span is found."""
    m = {"role": "assistant", "reasoning_content": "find count first",
         "content": "Searching.", "tool_calls": [call("search", query="def count")]}
    convo = [{"role": "user", "content": "fix it"}, m, {"role": "tool", "content": "hit"},
             {"role": "assistant", "reasoning_content": "done", "content": "Fixed."}]
    assert "find count first" not in render(qtok, convo)
    folded = fold_reasoning(qtok, convo)
    assert folded[1]["content"] == "<think>\nfind count first\n</think>\n\nSearching."
    r = simulate_rollout(qtok, convo)
    assert r.token_ids == encode(qtok, _upto_last_stop(render(qtok, folded)))
    t0, t1 = r.assistant_turns()
    assert qtok.decode(r.token_ids[t0.thinking.start:t0.thinking.end]) == \
        "<think>\nfind count first\n</think>"
    assert r.token_ids[t0.thinking.start] == 151667 and len(t0.tool_calls) == 1
    assert parse_assistant(qtok.decode(r.token_ids[t1.start:t1.end])).thinking == "done"


def test_differences_from_the_tiny_template(qtok, tok):
    """What the tiny tokenizer's template renders differently (its module docstring lists why)."""
    m = {"role": "assistant", "content": "",
         "tool_calls": [call("f", flag=True, opts={"a": 1}, none=None)]}
    real, tiny = assistant_generation_text(qtok, m), assistant_generation_text(tok, m)
    assert "\nTrue\n" in real and "\n{'a': 1}\n" in real and "\nNone\n" in real   # str()
    assert "\ntrue\n" in tiny and '\n{"a": 1}\n' in tiny and "\nnull\n" in tiny   # JSON
    r = {"role": "assistant", "reasoning_content": "hmm", "content": "x"}
    assert "hmm" not in render(qtok, [{"role": "user", "content": "q"}, r])
    assert "<think>\nhmm\n</think>" in render(tok, [{"role": "user", "content": "q"}, r])
    # without tools and system message neither template adds a system prompt; with tools the
    # real one opens with its own default system prompt and the tool list
    assert render(qtok, [{"role": "user", "content": "q"}]).startswith("<|im_start|>user")
    with_tools = render(qtok, [{"role": "user", "content": "q"}], tools=[SEARCH_TOOL])
    assert with_tools.startswith("<|im_start|>system\nYou are Qwen, a helpful AI assistant")
    assert "<function>\n<name>search</name>" in with_tools
