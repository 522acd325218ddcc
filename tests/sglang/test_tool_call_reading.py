"""The harness's tool-call readings against SGLang's own qwen3_coder detector (sglang 0.5.23).

Python 3.12 lane only (the sglang wheel pins torch 2.14.1): the detector module imports on
CPU with sglang's light dependencies. Each input is read three ways: by the detector itself,
by this package's "strict" reading and by its "sglang" reading (which must be the detector's
reading, offsets and all)."""

from __future__ import annotations

import json

import pytest

detector_mod = pytest.importorskip("sglang.srt.function_call.qwen3_coder_detector",
                                   reason="sglang is installed in the Python 3.12 lane only")

from megatron_tg.chat.parsing import parse_assistant  # noqa: E402


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


AGREE = {
    "one call": call("search", query="def count"),
    "two calls": call("search", query="a", lines="5") + "\n" + call("run", command="pytest -q"),
    "content first": "Let me look.\n\n" + call("read_file", path="src/a.py"),
    "code value": call("write_file", path="a.py", content="def f(x):\n    return x + 1\n"),
    "json value": call("edit", changes=json.dumps({"a": [1, 2], "b": "c"})),
    "no parameters": "<tool_call>\n<function=list_dir>\n</function>\n</tool_call>",
    "blank lines kept": call("write_file", path="b.txt", content="\nx\n"),
    "angle brackets": call("run", command="echo '<b>' > out.html && cat out.html"),
}

DIVERGE = {  # what SGLang reads differently from a strict reading (module docstring)
    "value with a parameter tag": call("write_file", path="t.py",
                                       content='print("<parameter=y>")'),
    "value with a function close": call("run", command="echo </function> done"),
    "missing </tool_call>": call("search", query="x").removesuffix("</tool_call>"),
    "missing </parameter>": ("<tool_call>\n<function=search>\n<parameter=query>\nx\n"
                             "<parameter=lines>\n3\n</parameter>\n</function>\n</tool_call>"),
}


def sglang(text: str):
    res = detector_mod.Qwen3CoderDetector().detect_and_parse(text, tools=None)
    return res.normal_text, [(c.name, json.loads(c.parameters)) for c in res.calls]


@pytest.mark.parametrize("name", sorted(AGREE))
def test_well_formed_calls_read_the_same_everywhere(name):
    text = AGREE[name]
    _, theirs = sglang(text)
    strict = parse_assistant(text, stop_tokens=())
    assert strict.errors == []
    assert [(c.name, c.arguments) for c in strict.tool_calls] == theirs
    ours = parse_assistant(text, stop_tokens=(), reading="sglang")
    assert [(c.name, c.arguments) for c in ours.tool_calls] == theirs
    for c in ours.tool_calls:  # offsets cover the call's own block
        assert text[c.start:c.end].startswith("<tool_call>") and f"<function={c.name}>" in text[c.start:c.end]


@pytest.mark.parametrize("name", sorted(DIVERGE))
def test_ambiguous_calls_are_errors_when_strict_and_sglangs_reading_otherwise(name):
    text = DIVERGE[name]
    normal, theirs = sglang(text)
    assert theirs, "SGLang reads a call here (else this input proves nothing)"
    strict = parse_assistant(text, stop_tokens=())
    assert strict.tool_calls == [] and len(strict.errors) == 1  # executed by neither harness nor judge
    ours = parse_assistant(text, stop_tokens=(), reading="sglang")
    assert [(c.name, c.arguments) for c in ours.tool_calls] == theirs
    assert ours.content == normal.strip() and ours.errors == []


def test_the_divergences_are_the_documented_ones():
    _, split = sglang(DIVERGE["value with a parameter tag"])
    assert split[0][1]["content"] == 'print("' and "y" in split[0][1]  # a new parameter
    _, cut = sglang(DIVERGE["missing </parameter>"])
    assert cut[0][1] == {"query": "x", "lines": "3"}  # the unclosed value runs to the next tag


def test_sglang_reading_keeps_null_and_drops_text_after_calls():
    text = "Checking.\n" + call("search", query="null") + "\nTrailing words."
    normal, theirs = sglang(text)
    assert theirs == [("search", {"query": None})]
    ours = parse_assistant(text + "<|im_end|>", reading="sglang")
    assert ours.terminated and ours.content == normal.strip() == "Checking."
    assert ours.tool_calls[0].arguments == {"query": None}
    assert parse_assistant(text, stop_tokens=()).content == "Checking.\n\nTrailing words."


def test_thinking_is_split_before_either_reading():
    text = "<think>\nplan: search first\n</think>\n\n" + call("search", query="q")
    for reading in ("strict", "sglang"):
        turn = parse_assistant(text, stop_tokens=(), reading=reading)
        assert turn.thinking == "plan: search first"
        assert [(c.name, c.arguments) for c in turn.tool_calls] == [("search", {"query": "q"})]
        assert text[turn.tool_calls[0].start:].startswith("<tool_call>")


def test_unreadable_block_is_an_error_in_the_sglang_reading():
    text = "<tool_call>\nnot a function\n</tool_call>"
    assert sglang(text)[1] == []
    turn = parse_assistant(text, stop_tokens=(), reading="sglang")
    assert turn.tool_calls == [] and len(turn.errors) == 1
