"""Tiny tokenizer: exact round trips, Qwen special tokens as single ids, offline reload,
determinism, and the chat template's rendering."""

from __future__ import annotations

import hashlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from megatron_tg.chat.template import encode, render
from megatron_tg.chat.tokenizer import (
    ALL_ADDED_TOKENS,
    DEFAULT_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
)

from .convos import SEARCH_TOOL, call, conversation


def test_special_tokens_are_single_top_ids(tok):
    ids = [encode(tok, t) for t in ALL_ADDED_TOKENS]
    assert all(len(i) == 1 for i in ids), ids
    flat = [i[0] for i in ids]
    assert len(set(flat)) == len(flat)
    assert sorted(flat) == list(range(len(tok) - len(flat), len(tok)))  # top ids, as in Qwen
    assert len(tok) == DEFAULT_VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    # a special token inside text is still one id
    assert encode(tok, "a<think>b")[1] == encode(tok, "<think>")[0]


def test_skip_special_tokens_keeps_tags(tok):
    ids = encode(tok, "<|im_start|>assistant\n<think>x</think><tool_call>y</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think><tool_call>y</tool_call>"


@pytest.mark.parametrize("text", [
    "", " ", "\n\n\n", "  leading and trailing  ", "tabs\tand\r\nCRLF\r\n",
    "unicode: é ü ß 中文 🚀 \u200b zero-width", "NFD e\u0301 stays NFD",
    "def f(x):\n    return x ** 2  # ok\n", "<|im_start|>user\nhi<|im_end|>\n", "<think></think>",
    "<tool_call>\n<function=search>\n<parameter=query>\nfoo\n</parameter>\n</function>\n</tool_call>",
    "<|im_end|><|im_end|>", "1234567890 3.14159 -42", "'s 're CAPS",
])
def test_round_trip_examples(tok, text):
    assert tok.decode(encode(tok, text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_round_trip_property(tok, text):
    ids = encode(tok, text)
    assert all(0 <= i < len(tok) for i in ids)
    assert tok.decode(ids) == text


def _digest(path) -> str:
    return hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()


def test_deterministic_and_reloads_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpus = ["def foo(bar):\n    return bar + 1\n", "Search the repo for the failing test."] * 50
    a = build_tiny_tokenizer(tmp_path / "a", corpus=corpus, vocab_size=300)
    b = build_tiny_tokenizer(tmp_path / "b", corpus=corpus, vocab_size=300)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert len(a) <= 300 and len(a) == len(b)
    again = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert again.chat_template == a.chat_template
    text = "Search foo(bar) 🚀"
    assert encode(again, text) == encode(a, text) and again.decode(encode(again, text)) == text
    for t in SPECIAL_TOKENS:
        assert len(encode(again, t)) == 1


def test_vocab_size_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(tmp_path, corpus=["x"], vocab_size=200)


def test_template_renders_qwen3_coder_structure(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Find foo."},
        {"role": "assistant", "reasoning_content": " Search it. ", "content": "Searching.",
         "tool_calls": [call("search", query="foo", lines=5)]},
        {"role": "tool", "content": "a.py:1"},
        {"role": "tool", "content": "b.py:2"},
        {"role": "assistant", "tool_calls": [call("search", query="bar"), call("run", command="ls")]},
        {"role": "tool", "content": "c.py:3"},
        {"role": "assistant", "content": "Done."},
    ]
    out = render(tok, msgs, tools=[SEARCH_TOOL], add_generation_prompt=True)
    system, rest = out.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n<function>\n<name>search</name>\n<description>Semantic code search.</description>" in system
    assert "<parameter>\n<name>lines</name>\n<type>integer</type>" in system
    assert '<required>["query"]</required>' in system
    assert rest == (
        "<|im_start|>user\nFind foo.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nSearch it.\n</think>\n\nSearching.\n\n"
        "<tool_call>\n<function=search>\n<parameter=query>\nfoo\n</parameter>\n"
        "<parameter=lines>\n5\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\na.py:1\n</tool_response>\n"
        "<tool_response>\nb.py:2\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n<function=search>\n<parameter=query>\nbar\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=run>\n<parameter=command>\nls\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nc.py:3\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_without_system_or_tools(tok):
    out = render(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # tools but no system message: a default system prompt carries the tool list
    out = render(tok, [{"role": "user", "content": "hi"}], tools=[SEARCH_TOOL])
    assert out.startswith("<|im_start|>system\n") and "<name>search</name>" in out


def test_template_json_string_arguments_and_non_string_values(tok):
    m = {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function",
                         "function": {"name": "f", "arguments": '{"a": [1, 2], "b": true}'}}]}
    out = render(tok, [{"role": "user", "content": "x"}, m])
    # as the release writes them: lists and mappings as JSON, other values as Python's str()
    assert "<parameter=a>\n[1, 2]\n</parameter>\n<parameter=b>\nTrue\n</parameter>" in out


# --------------------------------------------------------------------------- the current release
CURRENT_RELEASE = "2025-09"
"""The Qwen3-Coder template version the tiny template follows (tests/fixtures/qwen3_coder)."""

_THINK = re.compile(r"\n<think>\n.*?\n</think>\n", re.S)

_RICH_TOOLS = [
    SEARCH_TOOL,
    {"type": "function", "function": {
        "name": "edit", "description": "  Replace text in a file.  ", "strict": True,
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"path": {"type": "string", "minLength": 1},
                                      "mode": {"type": "string", "enum": ["replace", "append"],
                                               "description": "How."},
                                      "count": {"type": ["integer", "null"], "default": None}},
                       "required": ["path", "mode"]}}},
    {"type": "function", "function": {"name": "ping"}},                  # no description, no parameters
    {"name": "bare", "parameters": {"type": "object", "properties": {}}},  # not wrapped in "function"
]

_ARGS = {"s": "text", "multi": "a\nb\n", "uni": "naïve ✓", "empty": "", "i": 3, "neg": -7,
         "f": 2.5, "t": True, "fa": False, "none": None, "obj": {"dry_run": False, "n": [1, 2]},
         "arr": ["x", 1, None], "earr": []}


def _cases() -> dict[str, tuple[list[dict], list | None]]:
    think = {"role": "assistant", "reasoning_content": "  Look first. ", "content": "",
             "tool_calls": [call("search", query="foo")]}
    return {
        "conversation": (conversation(), [SEARCH_TOOL]),
        "conversation without tools": (conversation(), None),
        "every argument type": ([{"role": "user", "content": "go"},
                                 {"role": "assistant", "content": " Calling. ",
                                  "tool_calls": [call("edit", **_ARGS), call("ping")]},
                                 {"role": "tool", "content": "ok"}, {"role": "tool", "content": "pong"},
                                 {"role": "assistant", "content": "\n done \n"}], _RICH_TOOLS),
        "tools, no system message": ([{"role": "user", "content": "hi"}, think], _RICH_TOOLS),
        "system, no tools": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                              {"role": "assistant", "reasoning_content": "why", "content": "hello"}], None),
        "no system, no tools": ([{"role": "user", "content": "hi"}, think,
                                 {"role": "tool", "content": "r"}, {"role": "user", "content": "hint"},
                                 {"role": "assistant", "content": "x"}], None),
        "tool result first after the system prompt": ([{"role": "system", "content": "S"},
                                                       {"role": "tool", "content": "r"},
                                                       {"role": "user", "content": "u"}], [SEARCH_TOOL]),
    }


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_the_tiny_template_is_the_current_release_plus_thinking(tok, case, generation_prompt):
    """The one intended difference from Qwen3-Coder's current template: reasoning is kept, as
    "\\n<think>\\n{reasoning}\\n</think>\\n" after the role line. Removing that span from the
    tiny template's rendering gives the release's rendering byte for byte; with no reasoning
    in the conversation the two are identical."""
    from .qwen3_coder import template_text

    release = template_text(CURRENT_RELEASE)
    msgs, tools = _cases()[case]

    def both(messages):
        kw = dict(tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
        return (tok.apply_chat_template(messages, **kw),
                tok.apply_chat_template(messages, chat_template=release, **kw))

    ours, theirs = both(msgs)
    assert _THINK.sub("", ours) == theirs
    kept = [m["reasoning_content"].strip() for m in msgs if m.get("reasoning_content")]
    assert [m.group(0) for m in _THINK.finditer(ours)] == [f"\n<think>\n{r}\n</think>\n" for r in kept]
    unthought = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]
    ours, theirs = both(unthought)
    assert ours == theirs
