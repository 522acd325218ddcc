"""Framing: token-exact segments, turn parsing, and feedback insertion (shared / exact)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tg.chat.builder import RolloutBuilder, simulate_rollout
from megatron_tg.chat.feedback import build_expert_sequences, insert_feedback
from megatron_tg.chat.parsing import parse_assistant
from megatron_tg.chat.template import continuation_ids, encode, generation_prompt_ids, render
from megatron_tg.rollout.types import FramingError, Rollout

from .convos import SEARCH_TOOL, conversation


def _upto_last_stop(text: str, stop: str = "<|im_end|>") -> str:
    return text[: text.rfind(stop) + len(stop)]


# ---------------------------------------------------------------------- segments
def test_rollout_concatenation_equals_whole_render(tok, convo):
    r = simulate_rollout(tok, convo, tools=[SEARCH_TOOL], policy_version=[1, 1, 2, 2])
    whole = render(tok, convo, tools=[SEARCH_TOOL])
    assert r.token_ids == encode(tok, _upto_last_stop(whole))
    assert [s.kind for s in r.segments] == ["prompt", "assistant", "tool", "assistant", "user",
                                           "assistant", "tool", "assistant"]
    assert [s.policy_version for s in r.assistant_turns()] == [1, 1, 2, 2]
    for s in r.segments:  # a prompt/tool/user segment ends with the generation prompt
        if s.kind != "assistant":
            assert r.token_ids[s.end - len(generation_prompt_ids(tok)):s.end] == generation_prompt_ids(tok)
        else:
            assert r.token_ids[s.end - 1] == tok.eos_token_id
    # round-trips through JSON
    assert Rollout.from_json(r.to_json()) == r


def test_spans_decode_to_thinking_and_calls(tok, convo):
    r = simulate_rollout(tok, convo)
    dec = lambda sp: tok.decode(r.token_ids[sp.start:sp.end])  # noqa: E731
    t0, t1, t2, t3 = r.assistant_turns()
    assert dec(t0.thinking) == "<think>\nI should find count first.\n</think>"
    assert [dec(c) for c in t0.tool_calls] == [
        "<tool_call>\n<function=search>\n<parameter=query>\ndef count\n</parameter>\n</function>\n</tool_call>"]
    assert t1.thinking is None and len(t1.tool_calls) == 2
    assert dec(t1.tool_calls[1]).startswith("<tool_call>\n<function=run>")
    assert t2.thinking is None and len(t2.tool_calls) == 1 and t2.tool_calls[0].start == t2.start
    assert t3.tool_calls == [] and dec(t3.thinking).startswith("<think>")
    assert sum(r.thinking_mask()) == len(t0.thinking) + len(t3.thinking)


def test_generation_prompt_and_continuation(tok):
    assert tok.decode(generation_prompt_ids(tok)) == "<|im_start|>assistant\n"
    ids = continuation_ids(tok, [{"role": "tool", "content": "out1"}, {"role": "tool", "content": "out2"}])
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\nout1\n</tool_response>\n"
                               "<tool_response>\nout2\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n")
    # the neutral default context gives the same ids as the real history
    hist = conversation()[:3]
    assert continuation_ids(tok, [{"role": "tool", "content": "out1"}], history=hist) == \
        continuation_ids(tok, [{"role": "tool", "content": "out1"}])
    assert tok.decode(continuation_ids(tok, [{"role": "user", "content": "q"}],
                                       add_generation_prompt=False)) == "\n<|im_start|>user\nq<|im_end|>\n"
    with pytest.raises(FramingError):
        continuation_ids(tok, [{"role": "tool", "content": "x"}], history=[{"role": "user", "content": "u"}])
    with pytest.raises(FramingError):
        continuation_ids(tok, [])


def test_builder_turn_by_turn(tok):
    b = RolloutBuilder(tok, [{"role": "user", "content": "Find foo."}], task_id="t", group_id="g")
    gen = encode(tok, "<think>\nok\n</think>\n\n<tool_call>\n<function=search>\n<parameter=query>\n"
                      "foo\n</parameter>\n</function>\n</tool_call><|im_end|>")
    parsed = b.add_assistant(gen, [-0.5] * len(gen), policy_version=7)
    assert parsed.thinking == "ok" and parsed.tool_calls[0].arguments == {"query": "foo"}
    with pytest.raises(FramingError, match="two assistant turns"):
        b.add_assistant(gen, [-0.5] * len(gen), policy_version=7)
    b.add_messages([{"role": "tool", "content": "a.py"}])
    cut = encode(tok, "I will")  # a turn cut by the length limit: no stop token
    b.add_assistant(cut, [-1.0] * len(cut), policy_version=8)
    with pytest.raises(FramingError, match="close_turn"):
        b.add_messages([{"role": "user", "content": "continue"}])
    ids = b.add_messages([{"role": "user", "content": "continue"}], close_turn=True)
    assert ids[0] == tok.eos_token_id
    r = b.build("length", metadata={"tests_passed": False})
    assert [s.kind for s in r.segments] == ["prompt", "assistant", "tool", "assistant", "user"]
    assert r.segments[-1].end == len(r.token_ids) and r.group_id == "g"
    assert r.metadata == {"tests_passed": False}
    with pytest.raises(FramingError):
        RolloutBuilder(tok, [], task_id="t")


# ---------------------------------------------------------------------- parsing
def test_parse_good_turn():
    p = parse_assistant("<think>\nplan\n</think>\n\nText here.\n\n<tool_call>\n<function=search>\n"
                        "<parameter=query>\nfoo bar\n</parameter>\n<parameter=lines>\n5\n</parameter>\n"
                        "</function>\n</tool_call>\n<tool_call>\n<function=run>\n<parameter=command>\n"
                        "a\nb\n</parameter>\n</function>\n</tool_call><|im_end|>")
    assert p.thinking == "plan" and p.content == "Text here." and p.terminated and not p.errors
    assert [(c.name, c.arguments) for c in p.tool_calls] == [
        ("search", {"query": "foo bar", "lines": "5"}), ("run", {"command": "a\nb"})]
    assert p.to_message()["tool_calls"][0]["function"]["name"] == "search"


@pytest.mark.parametrize("text,msg", [
    ("<tool_call>\nsearch(foo)\n</tool_call>", "expected <function=NAME>"),
    ("<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n", "unterminated"),
    ("done </tool_call>", "without <tool_call>"),
    ("<tool_call>\n<function=s>\n<parameter=q>\n1\n</parameter>\n<parameter=q>\n2\n</parameter>\n"
     "</function>\n</tool_call>", "duplicate parameter"),
    ("<tool_call>\n<function=s>\nstray\n<parameter=q>\n1\n</parameter>\n</function>\n</tool_call>",
     "unexpected text"),
    ("<tool_call>\n<function=bad name!>\n</function>\n</tool_call>", "invalid function name"),
    ("<tool_call>\n<function=s>\n<parameter=q>\n1\n</function>\n</tool_call>", "unexpected text"),
])
def test_parse_malformed_calls_are_errors_not_exceptions(text, msg):
    p = parse_assistant("Before. " + text)
    assert p.tool_calls == [] and len(p.errors) == 1 and msg in p.errors[0].message
    assert p.content.startswith("Before.")


def test_parse_unterminated_thinking_and_recovery_after_bad_call():
    p = parse_assistant("<think>\nlong thought that never ends")
    assert p.thinking == "long thought that never ends" and p.content == "" and not p.terminated
    p = parse_assistant("<tool_call>\n<function=a>\n<tool_call>\n<function=b>\n</function>\n</tool_call>")
    assert [c.name for c in p.tool_calls] == ["b"] and "unterminated" in p.errors[0].message
    # the unterminated call's name is read when its <function=...> tag was written (a call cut
    # by the token limit is still a call to that tool), and only then
    assert p.errors[0].name == "a"
    cut = parse_assistant("<tool_call>\n<function=search>\n<parameter=query>\nk12\n</parameter>\n<para")
    assert [(e.name, e.message) for e in cut.errors] == [("search", "unterminated <tool_call>")]
    for early in ("<tool_call>\n<function=sea", "<tool_call>\n", "<tool_call>\n<function=bad name!>\n"):
        assert [e.name for e in parse_assistant(early).errors] == [None]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "\n",
                                 "<function=f>", "</function>", "<parameter=p>", "</parameter>",
                                 "x", " ", "<|im_end|>"]), max_size=25))
def test_parse_never_raises_and_token_spans_agree(tok, parts):
    text = "".join(parts)
    p = parse_assistant(text)
    assert isinstance(p.content, str)
    from megatron_tg.chat.parsing import assistant_token_spans
    ids = encode(tok, text)
    thinking, calls = assistant_token_spans(tok, ids)
    assert (thinking is None) == (p.thinking is None)
    assert len(calls) == len(p.tool_calls) + sum(1 for e in p.errors if e.raw.startswith("<tool_call>"))


# ---------------------------------------------------------------------- feedback insertion
FB = {0: "Use the lines= argument of the search tool.", 2: "Start with a status poem."}


def _check_map(r, e):
    n_keep = max(i for i, p in enumerate(e.position_map) if p >= 0) + 1
    for i, p in enumerate(e.position_map):
        if i < n_keep:
            assert p >= 0 and e.token_ids[p] == r.token_ids[i]
        else:
            assert p == -1
    mask = r.assistant_mask()
    for i in range(1, n_keep):
        if mask[i]:  # the token before every assistant token is unchanged (same logit slot)
            assert e.position_map[i] - 1 == e.position_map[i - 1]
    return n_keep


def test_insert_feedback_shared_matches_template(tok, convo):
    r = simulate_rollout(tok, convo, tools=[SEARCH_TOOL])
    e = insert_feedback(r, FB, tok)
    n_keep = _check_map(r, e)
    turns = r.assistant_turns()
    assert n_keep == turns[2].end  # truncated after the last failing turn
    assert e.turns == [0, 2]
    assert e.kl_mask == [1 if (turns[0].start <= i < turns[0].end or turns[2].start <= i < turns[2].end)
                         else 0 for i in range(len(r.token_ids))]
    assert [tok.decode(e.token_ids[s.start:s.end]) for s in e.feedback_spans] == [
        f"<|im_start|>user\n{FB[0]}<|im_end|>\n", f"<|im_start|>user\n{FB[2]}<|im_end|>\n"]
    # the expert sequence is exactly the template's rendering of the conversation with the
    # feedback as a user message right before each failing assistant message
    asst = [i for i, m in enumerate(convo) if m["role"] == "assistant"]
    with_fb = list(convo)
    for k in sorted(FB, reverse=True):
        with_fb.insert(asst[k], {"role": "user", "content": FB[k]})
    upto = with_fb[: asst[2] + 3]  # through failing turn 2 (shifted by the two insertions)
    assert e.token_ids == encode(tok, _upto_last_stop(render(tok, upto, tools=[SEARCH_TOOL])))


def test_insert_feedback_system_framing_and_no_truncation(tok, convo):
    r = simulate_rollout(tok, convo)
    e = insert_feedback(r, {1: "Run the tests."}, tok, framing="system", truncate=False)
    _check_map(r, e)
    assert tok.decode(e.token_ids[e.feedback_spans[0].start:e.feedback_spans[0].end]) == \
        "<|im_start|>system\nRun the tests.<|im_end|>\n"
    assert len(e.token_ids) == len(r.token_ids) + len(e.feedback_spans[0])
    t1 = r.assistant_turns()[1]
    g = len(generation_prompt_ids(tok))
    assert tok.decode(e.token_ids[e.position_map[t1.start] - g:e.position_map[t1.start]]) == \
        "<|im_start|>assistant\n"


def test_build_expert_sequences_exact_mode(tok, convo):
    r = simulate_rollout(tok, convo)
    shared = build_expert_sequences(r, FB, tok, mode="shared")
    exact = build_expert_sequences(r, FB, tok, mode="exact")
    assert len(shared) == 1 and len(exact) == 2
    turns = r.assistant_turns()
    for e, k in zip(exact, sorted(FB)):
        n_keep = _check_map(r, e)
        assert e.turns == [k] and n_keep == turns[k].end and len(e.feedback_spans) == 1
        text = tok.decode(e.token_ids)
        assert FB[k] in text and all(FB[j] not in text for j in FB if j != k)
        assert sum(e.kl_mask) == turns[k].end - turns[k].start
    # turn 0's exact sequence is the shared sequence's prefix
    assert shared[0].token_ids[: len(exact[0].token_ids)] == exact[0].token_ids
    assert build_expert_sequences(r, {}, tok) == []


def test_insert_feedback_errors(tok, convo):
    r = simulate_rollout(tok, convo)
    with pytest.raises(ValueError, match="out of range"):
        insert_feedback(r, {4: "x"}, tok)
    with pytest.raises(ValueError, match="non-empty"):
        insert_feedback(r, {0: "  "}, tok)
    with pytest.raises(ValueError, match="framing"):
        insert_feedback(r, {0: "x"}, tok, framing="assistant")
    with pytest.raises(ValueError, match="mode"):
        build_expert_sequences(r, {0: "x"}, tok, mode="both")
    with pytest.raises(ValueError, match="empty"):
        insert_feedback(r, {}, tok)
    # a turn whose preceding segment does not end with the generation prompt
    r.token_ids[r.assistant_turns()[1].start - 1] = 5
    with pytest.raises(FramingError, match="turn 1"):
        insert_feedback(r, {1: "x"}, tok)


@pytest.mark.parametrize("value, markup", [('print("<parameter=y>")', "<parameter="),
                                           ("echo </function> done", "</function>")])
def test_strict_reading_refuses_values_sglang_reads_as_structure(value, markup):
    from megatron_tg.chat.parsing import parse_assistant

    text = f"<tool_call>\n<function=run>\n<parameter=command>\n{value}\n</parameter>\n</function>\n</tool_call>"
    turn = parse_assistant(text, stop_tokens=())
    assert turn.tool_calls == [] and len(turn.errors) == 1
    assert repr(markup) in turn.errors[0].message and turn.errors[0].name == "run"


def test_unknown_reading_and_sglang_reading_without_sglang():
    import importlib.util

    from megatron_tg.chat.parsing import parse_assistant

    with pytest.raises(ValueError, match="reading must be one of"):
        parse_assistant("hi", reading="vllm")
    if importlib.util.find_spec("sglang") is None:  # the main lane: a clear error, not a guess
        with pytest.raises(ImportError, match="needs the sglang package"):
            parse_assistant("<tool_call>\n<function=f>\n</function>\n</tool_call>", reading="sglang")
