"""LLM judge against a local OpenAI-compatible test server on 127.0.0.1: good, malformed
(not JSON, missing criterion, ill-typed) and slow (timeout -> retry) replies."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from megatron_tg.judge import (
    Judge,
    LLMJudgeClient,
    LLMJudgeConfig,
    LLMJudgeError,
    Transcript,
    load_rubric,
    parse_rubric,
)

STYLE = load_rubric(Path(__file__).resolve().parents[2] / "recipes" / "rubrics" / "style_suite.yaml")
LLM_NAMES = [c.name for c in STYLE.llm_criteria()]
FINAL = ("I fixed the bound in `count()`.\n\n| File | Change |\n|---|---|\n| util.py | bound |\n\n"
         "**Tests pass.** **No API change.**\n\nShall I proceed?")
TEXTS = ["Searching.\n\n<tool_call>\n<function=search>\n<parameter=query>\ncount\n</parameter>\n"
         "</function>\n</tool_call>", FINAL]
TASK = {"issue": "count() is off by one", "hidden_tests": ["test_count_empty"]}


def completion(content: str) -> dict:
    return {"id": "x", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}]}


def verdicts(**overrides) -> str:
    v = {n: {"pass": True, "failing_turns": [], "feedback": None} for n in LLM_NAMES}
    v.update(overrides)
    return json.dumps({"criteria": v})


class FakeJudge:
    """Serves scripted replies in order (the last one repeats); records every request."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.requests: list[dict] = []
        self.headers: list[dict] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        self.headers.append(dict(request.headers))
        kind, payload = self.replies[min(len(self.requests), len(self.replies)) - 1]
        if kind == "slow":
            await asyncio.sleep(payload)
            return web.json_response(completion(verdicts()))
        if kind == "status":
            status, extra = payload
            return web.Response(status=status, text="busy", headers=extra)
        if kind == "raw":
            return web.Response(text=payload, content_type="application/json")
        return web.json_response(completion(payload))  # kind == "content"

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def judge_with(server: FakeJudge, rubric=STYLE, feedback_source="static", metadata=None,
               texts=TEXTS, **cfg):
    async def go():
        async with server as url:
            conf = LLMJudgeConfig(**{"base_url": url + "/v1", "model": "judge-model",
                                     "timeout_s": 0.5, "max_attempts": 3, "backoff_s": 0.01, **cfg})
            async with LLMJudgeClient(conf) as client:
                judge = Judge(rubric, llm=client, feedback_source=feedback_source)
                tr = Transcript.from_assistant_texts(
                    texts, metadata={"tests_passed": True} if metadata is None else metadata,
                    context=["TOOLS PROMPT " * 1000])
                return await judge.judge(tr, TASK)
    return asyncio.run(go())


def test_good_reply_and_request_contents():
    fb = "End by asking the user to approve."
    srv = FakeJudge(("content", verdicts(approval_question={"pass": False, "failing_turns": [0],
                                                            "feedback": fb})))
    res = judge_with(srv)
    assert res.trainable and len(srv.requests) == 1
    assert set(res.criteria) == set(STYLE.names)
    assert res.passed["markdown_table"] and res.passed["bolded_key_points"] and res.passed["tests_pass"]
    assert not res.passed["approval_question"]
    # final_turn scope: the failure is at the last turn whatever turn the judge named
    assert res.criteria["approval_question"].failing_turns == [1]
    assert res.criteria["approval_question"].feedback == STYLE["approval_question"].feedback
    assert res.criteria["approval_question"].judge_feedback == fb
    assert res.total_reward == pytest.approx(1.0 + 0.2 * 6)
    assert res.llm_reply is not None
    req = srv.requests[0]
    assert req["model"] == "judge-model" and req["response_format"] == {"type": "json_object"}
    user = req["messages"][1]["content"]
    assert all(f'"{n}"' in user for n in LLM_NAMES)
    assert "markdown_table" not in user  # rule criteria are not sent
    assert "count() is off by one" in user and "test_count_empty" in user  # privileged info
    assert "=== ASSISTANT TURN 1 ===" in user and "Shall I proceed?" in user
    assert "characters omitted" in user  # long context blocks are cut, turns are not


def test_judge_feedback_source():
    srv = FakeJudge(("content", verdicts(commands_ran={"pass": False, "failing_turns": [1],
                                                       "feedback": "List `pytest -q`."})))
    res = judge_with(srv, feedback_source="judge")
    assert res.feedback_by_turn() == {1: "List `pytest -q`."}


def test_fenced_json_is_accepted():
    srv = FakeJudge(("content", "```json\n" + verdicts() + "\n```"))
    res = judge_with(srv)
    assert res.trainable and all(res.passed.values())


@pytest.mark.parametrize("reply,msg", [
    ("I think it all passes!", "not valid JSON"),
    (json.dumps({"verdicts": {}}), "no 'criteria'"),
    (json.dumps({"criteria": {n: {"pass": True} for n in LLM_NAMES[:-1]}}), f"omits criterion '{LLM_NAMES[-1]}'"),
    (verdicts(solution_description={"pass": "yes"}), "'pass' must be true or false"),
    (verdicts(solution_description={"pass": False, "failing_turns": [5]}), "out of range"),
    (verdicts(solution_description={"pass": False, "failing_turns": ["1"]}), "list of ints"),
    (verdicts(solution_description={"pass": False, "feedback": 3}), "feedback"),
])
def test_malformed_replies_become_judge_errors(reply, msg):
    srv = FakeJudge(("content", reply))
    res = judge_with(srv)
    assert not res.trainable and res.total_reward is None
    assert msg in res.judge_error and "after 3 attempts" in res.judge_error
    assert len(srv.requests) == 3  # malformed replies are retried like transport errors
    assert not any(n in res.criteria for n in LLM_NAMES)  # never a silent pass
    assert res.feedback_by_turn() == {}


def test_invalid_then_valid_recovers():
    srv = FakeJudge(("content", "oops"), ("content", verdicts()))
    res = judge_with(srv)
    assert res.trainable and len(srv.requests) == 2


def test_slow_reply_times_out_then_retry_succeeds():
    srv = FakeJudge(("slow", 0.6), ("content", verdicts()))
    res = judge_with(srv, timeout_s=0.15)
    assert res.trainable and len(srv.requests) == 2


def test_always_slow_is_a_judge_error():
    srv = FakeJudge(("slow", 0.6))
    res = judge_with(srv, timeout_s=0.15, max_attempts=2)
    assert not res.trainable and "timeout" in res.judge_error and len(srv.requests) == 2


def test_retryable_status_then_success_and_non_retryable_status():
    srv = FakeJudge(("status", (503, {"Retry-After": "0"})), ("status", (429, {})), ("content", verdicts()))
    assert judge_with(srv).trainable and len(srv.requests) == 3
    srv = FakeJudge(("status", (401, {})))
    res = judge_with(srv)
    assert not res.trainable and "HTTP 401" in res.judge_error and len(srv.requests) == 1


def test_not_a_chat_completion():
    srv = FakeJudge(("raw", json.dumps({"result": "ok"})))
    res = judge_with(srv)
    assert not res.trainable and "not an OpenAI chat completion" in res.judge_error


def test_connection_refused_is_a_judge_error():
    async def go():
        srv = FakeJudge(("content", verdicts()))
        async with srv as url:
            pass  # server stopped: the port now refuses connections
        conf = LLMJudgeConfig(base_url=url, timeout_s=0.5, max_attempts=2, backoff_s=0.01)
        async with LLMJudgeClient(conf) as client:
            tr = Transcript.from_assistant_texts(TEXTS, metadata={"tests_passed": True})
            return await Judge(STYLE, llm=client).judge(tr)
    res = asyncio.run(go())
    assert not res.trainable and "after 2 attempts" in res.judge_error


def test_rule_error_skips_the_llm_call():
    srv = FakeJudge(("content", verdicts()))
    res = judge_with(srv, metadata={})  # no hidden-test result
    assert not res.trainable and "tests_pass" in res.judge_error and srv.requests == []


EVERY = parse_rubric({"criteria": [{
    "name": "status_update", "scope": "every_turn", "feedback": "Give a status update.",
    "checker": {"type": "llm", "args": {"question": "Does each turn give a status update?"}}}]})


def test_every_turn_llm_criterion_uses_judge_turns():
    srv = FakeJudge(("content", json.dumps({"criteria": {"status_update": {
        "pass": False, "failing_turns": [0], "feedback": None}}})))
    res = judge_with(srv, rubric=EVERY)
    assert res.trainable and res.failing_turns() == {0: [("status_update", "Give a status update.")]}
    srv = FakeJudge(("content", json.dumps({"criteria": {"status_update": {"pass": False}}})))
    res = judge_with(srv, rubric=EVERY)
    assert not res.trainable and "names no failing turn" in res.judge_error


def test_api_key_from_env(monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
    srv = FakeJudge(("content", verdicts()))
    assert judge_with(srv, api_key_env="TEST_JUDGE_KEY").trainable
    assert srv.headers[0]["Authorization"] == "Bearer sk-test"
    monkeypatch.delenv("TEST_JUDGE_KEY")
    with pytest.raises(LLMJudgeError, match="TEST_JUDGE_KEY"):  # a config error: fail fast
        LLMJudgeClient(LLMJudgeConfig(api_key_env="TEST_JUDGE_KEY"))


def test_judge_many_preserves_order_and_bounds_concurrency():
    async def go():
        srv = FakeJudge(("content", verdicts()))
        async with srv as url:
            conf = LLMJudgeConfig(base_url=url, max_concurrency=2, timeout_s=2, backoff_s=0.01)
            async with LLMJudgeClient(conf) as client:
                trs = [Transcript.from_assistant_texts(TEXTS, metadata={"tests_passed": i % 2 == 0},
                                                       task_id=f"t{i}", rollout_id=f"r{i}")
                       for i in range(6)]
                out = await Judge(STYLE, llm=client).judge_many(trs, {f"t{i}": TASK for i in range(6)})
        return out, srv
    out, srv = asyncio.run(go())
    assert [r.rollout_id for r in out] == [f"r{i}" for i in range(6)]
    assert [r.passed["tests_pass"] for r in out] == [True, False] * 3
    assert len(srv.requests) == 6
