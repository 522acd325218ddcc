"""Framing against Qwen3-Coder-30B-A3B-Instruct's own chat templates and special-token ids.

Every test runs on every released template version in ``tests/fixtures/qwen3_coder``
(``versions.json``: the first release inside ``tokenizer_config.json``, and the separate
``chat_template.jinja`` of September 2025 that transformers 5.x prefers). The tokenizer
(``tests/chat/qwen3_coder.py``) carries the published files unchanged; every expectation
below is the template's own rendering, never a string written here, except where a test
pins a documented behaviour of a version (what it does to thinking, to non-string argument
values, to content around calls). The properties the framing relies on are checked on each
version: prompt + generated turns = the whole rendering, token for token; a parsed call
re-renders to the generated text for every argument type; consecutive tool results form
one user turn; the generation prompt is ``<|im_start|>assistant\n``.
"""

from __future__ import annotations

import pytest

from megatron_tg.chat.builder import RolloutBuilder, simulate_rollout
from megatron_tg.chat.feedback import insert_feedback
from megatron_tg.chat.parsing import parse_assistant
from megatron_tg.chat.template import (
    assistant_generation_text,
    continuation_ids,
    encode,
    fold_reasoning,
    generation_prompt_ids,
    render,
    stop_token_id,
)

from .convos import SEARCH_TOOL, call
from .qwen3_coder import VERSIONS, build_qwen3_coder_tokenizer, published_config, template_text

# How each version writes a non-string argument value: 2025-07 with Python's str() for every
# value; 2025-09 mappings and lists as JSON, other values still with str().
WRITTEN = {
    "2025-07": {"flags": "{'dry_run': False, 'count': 1}", "ranges": "[[1, 2], [5, 9]]"},
    "2025-09": {"flags": '{"dry_run": false, "count": 1}', "ranges": "[[1, 2], [5, 9]]"},
}
assert set(WRITTEN) == set(VERSIONS), "a fixture version without expectations"


@pytest.fixture(scope="module", params=sorted(VERSIONS))
def version(request):
    return request.param


@pytest.fixture(scope="module")
def qtok(tmp_path_factory, version):
    return build_qwen3_coder_tokenizer(tmp_path_factory.mktemp(f"qwen3_coder_{version}"),
                                       version=version)


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


def test_special_token_ids_are_the_published_ones(qtok, version):
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
    # The template transformers renders with is the version's published file (its sha256 is
    # checked against versions.json); for the chat_template.jinja layout it is that file,
    # not the older template that tokenizer_config.json still carries beside it.
    assert qtok.chat_template == template_text(version)
    if VERSIONS[version]["layout"] == "chat_template.jinja":
        assert qtok.chat_template != cfg["chat_template"]


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


def test_parsing_reads_back_the_templates_values(qtok, version):
    """Non-string values come back as the template wrote them (``WRITTEN``: Python ``str()``
    for True, None, 2.5; dicts and lists as repr or JSON by version). Content around calls is
    trimmed by the template."""
    convo = agent_conversation()
    texts = [assistant_generation_text(qtok, m) for m in convo if m["role"] == "assistant"]
    p0, p1, p2, p3 = (parse_assistant(t) for t in texts)
    assert p0.content == "Let me look." and [c.arguments for c in p0.tool_calls] == [
        {"query": "def count", "lines": "5"}]
    assert p1.content == "" and [c.name for c in p1.tool_calls] == ["edit_file", "run"]
    assert p1.tool_calls[0].arguments == {"path": "src/util.py", "old": "n - 1", "new": "n",
                                          **WRITTEN[version]}
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


def test_differences_from_the_tiny_template(qtok, tok, version):
    """What the tiny tokenizer's template renders differently (its module docstring lists why):
    it follows the current release (2025-09), so from the first release it differs in how a
    mapping argument is written; from every release in keeping the reasoning."""
    m = {"role": "assistant", "content": "",
         "tool_calls": [call("f", flag=True, opts={"a": 1}, none=None)]}
    real, tiny = assistant_generation_text(qtok, m), assistant_generation_text(tok, m)
    opts = "{'a': 1}" if version == "2025-07" else '{"a": 1}'
    assert "\nTrue\n" in real and f"\n{opts}\n" in real and "\nNone\n" in real   # str()
    assert "\nTrue\n" in tiny and '\n{"a": 1}\n' in tiny and "\nNone\n" in tiny   # as 2025-09
    assert (real == tiny) is (version != "2025-07")
    r = {"role": "assistant", "reasoning_content": "hmm", "content": "x"}
    assert "hmm" not in render(qtok, [{"role": "user", "content": "q"}, r])
    assert "<think>\nhmm\n</think>" in render(tok, [{"role": "user", "content": "q"}, r])
    # without tools and system message neither template adds a system prompt; with tools the
    # real one opens with its own default system prompt and the tool list
    assert render(qtok, [{"role": "user", "content": "q"}]).startswith("<|im_start|>user")
    with_tools = render(qtok, [{"role": "user", "content": "q"}], tools=[SEARCH_TOOL])
    assert with_tools.startswith("<|im_start|>system\nYou are Qwen, a helpful AI assistant")
    assert "<function>\n<name>search</name>" in with_tools


# One value of each JSON type (and the string shapes that stress the framing).
EVERY_TYPE = {"text": "src/a.py", "multiline": "line one\n  line two\n", "unicode": "naïve – ok",
              "empty": "", "integer": 12, "negative": -3, "number": 2.5, "true": True,
              "false": False, "null": None, "object": {"k": [1, 2], "flag": False, "s": "x"},
              "array": [[1, 2], "b", None], "empty_array": []}


def _written(value, version: str) -> str:
    """What ``version`` writes for ``value``: strings as they are, mappings and lists as
    Python str() (2025-07) or JSON (2025-09: transformers' tojson, ensure_ascii off), every
    other value with str()."""
    import json

    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)) and version != "2025-07":
        return json.dumps(value, ensure_ascii=False)
    return str(value)


@pytest.mark.parametrize("name", sorted(EVERY_TYPE))
def test_every_argument_type_round_trips_through_the_parser(qtok, version, name):
    """A generated call, parsed by this package's parser, gives the value as the version wrote
    it; re-rendered from the parse (what the harness puts in the history), it is the same text
    and the same tokens as the generated turn."""
    value = EVERY_TYPE[name]
    m = {"role": "assistant", "content": "Calling.", "tool_calls": [call("f", **{name: value})]}
    text = assistant_generation_text(qtok, m)
    parsed = parse_assistant(text)
    assert parsed.terminated and not parsed.errors, parsed.errors
    assert [c.name for c in parsed.tool_calls] == ["f"]
    assert parsed.tool_calls[0].arguments == {name: _written(value, version)}
    again = {"role": "assistant", "content": parsed.content,
             "tool_calls": [call(c.name, **c.arguments) for c in parsed.tool_calls]}
    assert assistant_generation_text(qtok, again) == text
    assert encode(qtok, assistant_generation_text(qtok, again)) == encode(qtok, text)


def test_generation_prompt_is_the_assistant_header(qtok):
    convo = agent_conversation()[:4]
    for tools in (None, [SEARCH_TOOL]):
        plain = render(qtok, convo, tools=tools)
        prompted = render(qtok, convo, tools=tools, add_generation_prompt=True)
        assert prompted == plain + "<|im_start|>assistant\n"
        assert encode(qtok, prompted)[-len(generation_prompt_ids(qtok)):] == \
            generation_prompt_ids(qtok)


NO_DESCRIPTION = {"type": "function", "function": {"name": "ls", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "enum": ["a", "b"]}},
    "required": ["path"]}}}
NO_PARAMETERS = {"type": "function", "function": {"name": "now", "description": "The time."}}


def test_tool_list_rendering_by_version(qtok, version):
    """Pinned per version (fixtures/qwen3_coder/README.md): the header, how ``required`` and
    ``enum`` are written, and what happens to a tool without a description or parameters."""
    q = [{"role": "user", "content": "q"}]
    listed = render(qtok, q, tools=[SEARCH_TOOL, NO_DESCRIPTION])
    if version == "2025-07":
        assert "# Tools" not in listed and "<required>[`query`]</required>" in listed
        assert "<name>ls</name>\n<description></description>" in listed  # printed empty
        assert "<enum>[`a`, `b`]</enum>" in listed
        with pytest.raises(Exception, match="parameters"):  # the first release fails here
            render(qtok, q, tools=[NO_PARAMETERS])
    else:
        assert "\n\n# Tools\n\nYou have access to the following functions:" in listed
        assert '<required>["query"]</required>' in listed and '<enum>["a", "b"]</enum>' in listed
        assert "<name>ls</name>\n<parameters>" in listed                   # no description
        assert "<name>now</name>\n<description>The time.</description>\n<parameters>\n" \
            "</parameters>" in render(qtok, q, tools=[NO_PARAMETERS])
