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

    def __init__(self, *replies, api_key=None):
        self.replies = list(replies)
        self.api_key = api_key  # require it as an SGLang judge started with --api-key does
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
        from megatron_tg.auth import aiohttp_middleware

        app = web.Application(middlewares=[aiohttp_middleware(self.api_key)] if self.api_key else [])
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


def test_a_keyed_judge_server_takes_the_jobs_key_file(tmp_path):
    import os

    from megatron_tg.auth import read_key, write_key_dir

    key_file, _ = write_key_dir(tmp_path / "secret")
    key = read_key(key_file)
    srv = FakeJudge(("content", verdicts()), api_key=key)
    assert judge_with(srv, api_key_file=str(key_file)).trainable
    assert srv.headers[0]["Authorization"] == f"Bearer {key}"
    refused = FakeJudge(("content", verdicts()), api_key=key)
    res = judge_with(refused)  # no key: 401 before the handler, not retried, not trainable
    assert not res.trainable and "HTTP 401" in res.judge_error and refused.requests == []
    os.chmod(key_file, 0o644)
    with pytest.raises(LLMJudgeError, match="readable by group or others"):  # a config error: fail fast
        LLMJudgeClient(LLMJudgeConfig(api_key_file=str(key_file)))


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


# ---------------------------------------------------------------------- transcript budgets
class ContextLimitedJudge(FakeJudge):
    """Answers like an SGLang judge server whose context holds ``context`` tokens (a token
    counted as 4 characters here): over it, HTTP 400 with the body SGLang 0.5.23 sends
    (``ErrorResponse`` from its OpenAI server around the tokenizer manager's message
    "The input (N tokens) is longer than the model's context length (M tokens).")."""

    def __init__(self, context_tokens: int):
        super().__init__()
        self.context = context_tokens
        self.sizes: list[int] = []

    async def handle(self, request):
        body = await request.json()
        self.requests.append(body)
        n = sum(len(m["content"]) for m in body["messages"]) // 4
        self.sizes.append(n)
        if n >= self.context:
            msg = (f"The input ({n} tokens) is longer than the model's context length "
                   f"({self.context} tokens).")
            return web.json_response({"object": "error", "message": msg, "type": "BadRequestError",
                                      "param": None, "code": 400}, status=400)
        return web.json_response(completion(verdicts()))

LONG = [f"Step {i}: reading. " + "Looking at the code. " * 100 + "\n\n" + TEXTS[0]
        for i in range(40)] + [FINAL]  # ~90k characters of assistant turns


def test_long_transcript_is_cut_in_the_middle_and_judged():
    tr = Transcript.from_assistant_texts(LONG, context=["TASK: fix count()"] + ["x" * 3000] * 40)
    text, omitted = tr.render_within(4000, budget_chars=20_000)
    assert len(text) <= 20_000 and omitted  # fits, and says what it left out
    assert text.startswith("=== PROMPT (context) ===\nTASK: fix count()")
    assert f"=== ASSISTANT TURN {len(LONG) - 1} ===" in text and "Shall I proceed?" in text
    assert f"assistant turns {omitted[0]}-{omitted[-1]}" in text and "OMITTED" in text
    assert omitted == list(range(omitted[0], omitted[-1] + 1))  # one contiguous middle
    full, none = tr.render_within(4000, budget_chars=None)
    assert none == [] and len(full) > 100_000


def test_context_overflow_is_resent_shorter_not_dropped():
    srv = ContextLimitedJudge(context_tokens=10_000)
    res = judge_with(srv, texts=LONG, max_transcript_chars=200_000)
    assert res.trainable, res.judge_error
    assert res.llm_overflow_retries == 1 and res.llm_requests == 2 and res.llm_omitted_turns > 0
    assert srv.sizes[0] >= 10_000 > srv.sizes[1]  # the re-sent prompt fits
    user = srv.requests[-1]["messages"][1]["content"]
    assert "OMITTED to fit the judge's budget" in user and "Shall I proceed?" in user


def test_overflow_that_cannot_fit_is_a_judge_error_of_kind_overflow():
    srv = ContextLimitedJudge(context_tokens=50)  # smaller than the task text itself
    res = judge_with(srv, texts=LONG, overflow_retries=2)
    assert not res.trainable and res.judge_error_kind == "overflow"
    assert "does not fit the judge's context" in res.judge_error and len(srv.requests) == 3


def test_other_400s_are_not_taken_for_overflow():
    srv = FakeJudge(("status", (400, {})))
    res = judge_with(srv, texts=LONG)
    assert not res.trainable and res.judge_error_kind == "config" and len(srv.requests) == 1


def test_per_criterion_budget_gets_its_own_request():
    crit = {c.name: c for c in STYLE.criteria}
    rb = parse_rubric({"name": "b", "criteria": [
        {"name": n, "scope": crit[n].scope, "feedback": crit[n].feedback,
         "checker": {"type": "llm", "args": dict(crit[n].checker_args)},
         **({"judge_budget_chars": 8000} if i == 0 else {})}
        for i, n in enumerate(LLM_NAMES[:2])]})
    srv = ContextLimitedJudge(context_tokens=10**9)
    res = judge_with(srv, rubric=rb, texts=LONG)
    assert res.trainable and len(srv.requests) == 2
    small, big = sorted(srv.requests, key=lambda r: len(r["messages"][1]["content"]))
    assert f'"{LLM_NAMES[0]}"' in small["messages"][1]["content"]
    assert f'"{LLM_NAMES[0]}"' not in big["messages"][1]["content"]
    assert len(small["messages"][1]["content"]) < 8000 + 3000  # budget + the prompt's own text


def test_judge_drop_metrics_by_length():
    from types import SimpleNamespace

    from megatron_tg.judge import JudgeResult
    from megatron_tg.sampling.rollouts import judge_drop_metrics

    ros = [SimpleNamespace(token_ids=[0] * n) for n in (10, 20, 30, 40, 50, 60)]
    res = [JudgeResult(str(i), "t", "g") for i in range(6)]
    for r in res[4:]:  # the two longest rollouts lost to overflow
        r.judge_error, r.judge_error_kind = "llm judge: overflow", "overflow"
    m = judge_drop_metrics(list(zip(ros, res)))
    assert (m["judge/error_rate_short"], m["judge/error_rate_mid"], m["judge/error_rate_long"]) == (0, 0, 1)
    assert m["judge/overflow_errors"] == 2
