"""Qwen3-Coder's own templates against SGLang's own qwen3_coder detector (the deployment parser).

On every released template version (tests/fixtures/qwen3_coder/versions.json): the template
writes non-string argument values with Python's ``str()`` (2025-07) or mappings and lists as
JSON (2025-09); the detector, given the tool's JSON schema, converts them back by the
declared type. Rendered turns (multi-call, content before calls, every JSON type) must read
back to the arguments that were rendered. Python 3.12 lane only (sglang 0.5.23 pins torch
2.14.1), like tests/sglang."""

from __future__ import annotations

import json

import pytest

detector_mod = pytest.importorskip("sglang.srt.function_call.qwen3_coder_detector",
                                   reason="sglang is installed in the Python 3.12 lane only (scripts/test_py312.sh runs tests/sglang)")

from megatron_tg.chat.parsing import parse_assistant  # noqa: E402
from megatron_tg.chat.template import assistant_generation_text  # noqa: E402

from tests.chat.convos import call  # noqa: E402
from tests.chat.qwen3_coder import VERSIONS, build_qwen3_coder_tokenizer  # noqa: E402

EDIT = {"type": "function", "function": {"name": "edit", "description": "Edit a file.", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"},
        "dry_run": {"type": "boolean"}, "opts": {"type": "object"}, "ranges": {"type": "array"}},
    "required": ["path"]}}}
RUN = {"type": "function", "function": {"name": "run", "description": "Run a command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}}}}}


@pytest.fixture(scope="module", params=sorted(VERSIONS))
def version(request):
    return request.param


@pytest.fixture(scope="module")
def qtok(tmp_path_factory, version):
    return build_qwen3_coder_tokenizer(tmp_path_factory.mktemp(f"qwen3_coder_{version}"),
                                       version=version)


def test_sglang_reads_the_templates_values_back_by_schema(qtok, version):
    from sglang.srt.entrypoints.openai.protocol import Tool

    args = [{"path": "src/a.py", "line": 12, "scale": 2.5, "dry_run": True,
             "opts": {"k": [1, 2], "flag": False}, "ranges": [[1, 2], [5, 9]]},
            {"command": "pytest -q", "timeout": 30}]
    m = {"role": "assistant", "content": "Editing, then testing.",
         "tool_calls": [call("edit", **args[0]), call("run", **args[1])]}
    text = assistant_generation_text(qtok, m).removesuffix("<|im_end|>")
    res = detector_mod.Qwen3CoderDetector().detect_and_parse(
        text, [Tool(**EDIT), Tool(**RUN)])
    assert [(c.name, json.loads(c.parameters)) for c in res.calls] == [("edit", args[0]), ("run", args[1])]
    assert res.normal_text.strip() == "Editing, then testing."
    # the strict reading returns the same calls as the text the template wrote
    strict = parse_assistant(text, stop_tokens=())
    assert [c.name for c in strict.tool_calls] == ["edit", "run"] and not strict.errors
    assert strict.tool_calls[0].arguments["dry_run"] == "True"
    assert strict.tool_calls[0].arguments["opts"] == (
        "{'k': [1, 2], 'flag': False}" if version == "2025-07" else '{"k": [1, 2], "flag": false}')


# (schema type, value): every JSON type the detector converts by schema. A null is read back
# where the schema lets literal_eval run (object/array); "None" stays a string for a string.
TYPED = {"s": ("string", "line one\n  line two"), "u": ("string", "naïve – ok"),
         "i": ("integer", -3), "n": ("number", 2.5), "t": ("boolean", True),
         "f": ("boolean", False), "o": ("object", {"k": [1, 2], "flag": False, "x": None}),
         "a": ("array", [[1, 2], "b", None]), "e": ("array", []), "z": ("object", None)}


@pytest.mark.parametrize("name", sorted(TYPED))
def test_every_argument_type_round_trips_through_sglang(qtok, name):
    from sglang.srt.entrypoints.openai.protocol import Tool

    kind, value = TYPED[name]
    tool = Tool(type="function", function={"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {name: {"type": kind}}}})
    m = {"role": "assistant", "content": "", "tool_calls": [call("f", **{name: value})]}
    text = assistant_generation_text(qtok, m).removesuffix("<|im_end|>")
    res = detector_mod.Qwen3CoderDetector().detect_and_parse(text, [tool])
    assert [(c.name, json.loads(c.parameters)) for c in res.calls] == [("f", {name: value})]
