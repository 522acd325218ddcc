"""Rollout data model: masks, JSON(L) round trips and every validation error."""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tg.rollout.jsonl import read_jsonl, write_jsonl
from megatron_tg.rollout.types import (
    Rollout,
    RolloutFormatError,
    Segment,
    Span,
)


def make_rollout(**kw) -> Rollout:
    """prompt [0,5) | assistant [5,10) think [5,7) call [8,10) | tool [10,13) | assistant [13,16)"""
    r = Rollout(
        task_id="t1", group_id="g1", rollout_id="r1", finish_reason="stop",
        token_ids=list(range(100, 116)),
        segments=[
            Segment("prompt", 0, 5),
            Segment("assistant", 5, 10, logprobs=[-0.1, -0.2, -0.3, -0.4, 0.0], policy_version=3,
                    thinking=Span(5, 7), tool_calls=[Span(8, 10)]),
            Segment("tool", 10, 13, meta={"tool": "search"}),
            Segment("assistant", 13, 16, logprobs=[-1.0, -2.0, -0.5], policy_version=4),
        ],
        metadata={"tests_passed": True},
    )
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_valid_and_masks():
    r = make_rollout().validate(vocab_size=200)
    assert r.num_turns == 2
    assert r.assistant_mask() == [0] * 5 + [1] * 5 + [0] * 3 + [1] * 3
    assert r.thinking_mask() == [0] * 5 + [1, 1] + [0] * 9
    assert r.tool_call_mask() == [0] * 8 + [1, 1] + [0] * 6
    assert r.turn_index_per_token() == [-1] * 5 + [0] * 5 + [-1] * 3 + [1] * 3
    lp = r.logprobs_per_token()
    assert lp[5:10] == [-0.1, -0.2, -0.3, -0.4, 0.0] and lp[13:] == [-1.0, -2.0, -0.5]
    assert lp[:5] == [0.0] * 5
    assert r.policy_version_per_token()[5:10] == [3] * 5
    assert r.policy_version_per_token()[13] == 4 and r.policy_version_per_token()[0] == -1
    assert r.turn(-1).start == 13
    with pytest.raises(IndexError):
        r.turn(2)


def test_json_round_trip_single_line():
    r = make_rollout()
    line = r.to_json()
    assert "\n" not in line
    assert json.loads(line)["format_version"] == 1
    assert Rollout.from_json(line) == r


def test_jsonl_round_trip(tmp_path):
    rs = [make_rollout(rollout_id=f"r{i}") for i in range(3)]
    p = tmp_path / "r.jsonl"
    assert write_jsonl(p, rs) == 3
    assert write_jsonl(p, [make_rollout(rollout_id="r3")], append=True) == 1
    res = read_jsonl(p)
    assert res.errors == [] and [r.rollout_id for r in res.rollouts] == ["r0", "r1", "r2", "r3"]
    assert res.rollouts[0] == rs[0]


def _seg(r, i):
    return r.segments[i]


MUTATIONS = [
    ("logprob count", lambda r: _seg(r, 1).logprobs.pop(), "segments[1].logprobs"),
    ("NaN logprob", lambda r: _seg(r, 1).logprobs.__setitem__(0, math.nan), "segments[1].logprobs[0]"),
    ("inf logprob", lambda r: _seg(r, 3).logprobs.__setitem__(2, -math.inf), "segments[3].logprobs[2]"),
    ("positive logprob", lambda r: _seg(r, 1).logprobs.__setitem__(1, 0.5), "segments[1].logprobs[1]"),
    ("missing logprobs", lambda r: setattr(_seg(r, 3), "logprobs", None), "segments[3].logprobs"),
    ("overlap", lambda r: setattr(_seg(r, 2), "start", 9), "segments[2].start"),
    ("gap", lambda r: setattr(_seg(r, 2), "start", 11), "segments[2].start"),
    ("not covering", lambda r: r.token_ids.append(5), "segments[3].end"),
    ("out of range", lambda r: r.token_ids.pop(), "segments[3].end"),
    ("empty segment", lambda r: (setattr(_seg(r, 2), "end", 10), setattr(_seg(r, 3), "start", 10)),
     "segments[2].end"),
    ("thinking outside turn", lambda r: setattr(_seg(r, 1), "thinking", Span(4, 7)), "segments[1].thinking"),
    ("tool call overlaps thinking", lambda r: setattr(_seg(r, 1), "tool_calls", [Span(6, 9)]),
     "segments[1].tool_calls[0]"),
    ("tool calls unordered", lambda r: setattr(_seg(r, 1), "tool_calls", [Span(8, 10), Span(7, 8)]),
     "segments[1].tool_calls[1]"),
    ("tool logprobs", lambda r: setattr(_seg(r, 2), "logprobs", [-1.0] * 3), "segments[2].logprobs"),
    ("tool tool_calls", lambda r: setattr(_seg(r, 2), "tool_calls", [Span(10, 11)]), "segments[2].tool_calls"),
    ("first not prompt", lambda r: setattr(_seg(r, 0), "kind", "user"), "segments[0].kind"),
    ("second prompt", lambda r: setattr(_seg(r, 2), "kind", "prompt"), "segments[2].kind"),
    ("bad kind", lambda r: setattr(_seg(r, 2), "kind", "observation"), "segments[2].kind"),
    ("negative id", lambda r: r.token_ids.__setitem__(2, -1), "token_ids[2]"),
    ("bool id", lambda r: r.token_ids.__setitem__(3, True), "token_ids[3]"),
    ("float id", lambda r: r.token_ids.__setitem__(3, 1.0), "token_ids[3]"),
    ("finish reason", lambda r: setattr(r, "finish_reason", "done"), "finish_reason"),
    ("empty task id", lambda r: setattr(r, "task_id", ""), "task_id"),
    ("group id type", lambda r: setattr(r, "group_id", 7), "group_id"),
    ("policy version", lambda r: setattr(_seg(r, 1), "policy_version", None), "segments[1].policy_version"),
    ("negative version", lambda r: setattr(_seg(r, 3), "policy_version", -2), "segments[3].policy_version"),
    ("no segments", lambda r: setattr(r, "segments", []), "segments"),
    ("metadata keys", lambda r: setattr(r, "metadata", {1: 2}), "metadata"),
]


@pytest.mark.parametrize("name,mutate,field", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_validation_errors_name_the_field(name, mutate, field):
    r = make_rollout()
    mutate(r)
    with pytest.raises(RolloutFormatError) as ei:
        r.validate()
    assert ei.value.field == field, str(ei.value)
    assert str(ei.value).startswith(field + ":")


def test_vocab_size_check():
    with pytest.raises(RolloutFormatError, match=r"token_ids\[0\].*vocab_size"):
        make_rollout().validate(vocab_size=100)


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.pop("task_id"), "task_id"),
    (lambda d: d.update(extra=1), "<rollout>"),
    (lambda d: d["segments"][1].update(logprob=[]), "segments[1]"),
    (lambda d: d["segments"][1].pop("end"), "segments[1].end"),
    (lambda d: d["segments"][1].update(thinking=[5]), "segments[1].thinking"),
    (lambda d: d.update(format_version=99), "format_version"),
    (lambda d: d["segments"][1].update(logprobs=[None] * 5), "segments[1].logprobs[0]"),
])
def test_from_dict_errors(mutate, field):
    d = make_rollout().to_dict()
    mutate(d)
    with pytest.raises(RolloutFormatError) as ei:
        Rollout.from_json(json.dumps(d))
    assert ei.value.field == field, str(ei.value)


def test_invalid_json_and_nan_serialisation():
    with pytest.raises(RolloutFormatError, match="invalid JSON"):
        Rollout.from_json("{not json")
    # Python's json accepts NaN; validation must still reject it
    d = make_rollout().to_dict()
    line = json.dumps(d).replace("-0.1", "NaN", 1)
    with pytest.raises(RolloutFormatError, match=r"segments\[1\].logprobs\[0\]"):
        Rollout.from_json(line)
    r = make_rollout()
    r.segments[1].logprobs[0] = math.nan
    with pytest.raises(RolloutFormatError, match="not JSON-serialisable"):
        r.to_json()


def test_read_jsonl_never_drops_bad_lines(tmp_path):
    good = make_rollout().to_json()
    bad = make_rollout()
    bad.segments[1].logprobs.pop()
    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join([good, "{oops", "", bad.to_json(), good]) + "\n")
    with pytest.raises(RolloutFormatError, match=r"mixed.jsonl:2: "):
        read_jsonl(p)
    res = read_jsonl(p, on_error="collect")
    assert len(res.rollouts) == 2
    assert [e.line_no for e in res.errors] == [2, 4]
    assert res.errors[1].field == "segments[1].logprobs"
    with pytest.raises(ValueError):
        read_jsonl(p, on_error="skip")


def test_write_jsonl_validates_before_writing(tmp_path):
    p = tmp_path / "out.jsonl"
    bad = make_rollout(rollout_id="broken")
    bad.segments[3].policy_version = None
    with pytest.raises(RolloutFormatError, match="broken"):
        write_jsonl(p, [make_rollout(), bad])
    assert not p.exists()
    assert list(tmp_path.iterdir()) == []  # no temp file left behind


@st.composite
def rollouts(draw):
    """Random valid layouts: alternating prompt / assistant / tool segments."""
    n_turns = draw(st.integers(0, 4))
    ids, segs = [], []
    n = draw(st.integers(1, 4))
    segs.append(Segment("prompt", 0, n))
    ids += draw(st.lists(st.integers(0, 2000), min_size=n, max_size=n))
    for k in range(n_turns):
        if k:
            m = draw(st.integers(1, 3))
            segs.append(Segment(draw(st.sampled_from(["tool", "user"])), len(ids), len(ids) + m))
            ids += [7] * m
        m = draw(st.integers(1, 6))
        lps = draw(st.lists(st.floats(-50, 0, allow_nan=False), min_size=m, max_size=m))
        start = len(ids)
        think = Span(start, start + 1) if draw(st.booleans()) else None
        calls = [Span(start + m - 1, start + m)] if m > 1 and draw(st.booleans()) else []
        segs.append(Segment("assistant", start, start + m, logprobs=lps,
                            policy_version=draw(st.integers(0, 9)), thinking=think, tool_calls=calls))
        ids += draw(st.lists(st.integers(0, 2000), min_size=m, max_size=m))
    return Rollout("task", "group", ids, segs, draw(st.sampled_from(["stop", "length"])),
                   metadata={"x": draw(st.text(max_size=5))})


@settings(max_examples=60, deadline=None)
@given(rollouts())
def test_round_trip_property(r):
    r.validate()
    back = Rollout.from_json(r.to_json())
    assert back == r
    assert sum(back.assistant_mask()) == sum(len(s.logprobs) for s in back.assistant_turns())
    assert copy.deepcopy(back).validate() == back
