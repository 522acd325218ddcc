"""The /generate requests the client builds and the replies the embedded engine returns,
checked with SGLang 0.5.23's own code rather than our reading of it:

* request bodies: the server's JSON contract gate (``api_contract.generate_contract_error``,
  the generated ``sglang.api.v1`` decoder), then ``io_struct.GenerateReqInput`` and its
  ``normalize_batch_and_arguments``, then ``SamplingParams(**sampling_params)`` with its
  ``normalize`` and ``verify`` -- the steps ``TokenizerManager`` runs;
* replies: ``sglang.api.v1.api_types.GenerateResponse.from_json_value``;
* the sampling keys the embedded engine accepts are exactly SGLang's, an unknown key is
  refused by both, and ``/model_info`` and ``/health`` behave as SGLang's do.

Python 3.12 lane only: ``pip install --no-deps sglang==0.5.23`` plus, for these imports,
orjson msgspec psutil pybase64 requests packaging pillow starlette pydantic pyzmq tqdm
IPython aiohttp fastapi uvicorn transformers==5.19.0 sentencepiece gguf openai
partial-json-parser dill loguru apache-tvm-ffi compressed-tensors and (``--no-deps``)
torchvision==0.29.1. ``sglang.srt.entrypoints.http_server`` itself does not import on
CPU (it pulls the whole serving stack: uvloop, xgrammar, soundfile, transformers'
AutoProcessor for multimodal models), so its /model_info keys and /health routes are
read from its source with ``ast``.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("sglang.srt.managers.io_struct", reason="sglang==0.5.23 is installed in the Python 3.12 lane only")

import aiohttp  # noqa: E402
from sglang.api.v1.api_types import GenerateResponse  # noqa: E402
from sglang.api.v1 import api_types  # noqa: E402
from sglang.srt.entrypoints.api_contract import generate_contract_error  # noqa: E402
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from megatron_tg.config import RolloutConfig  # noqa: E402
from megatron_tg.rollout.client import SGLangClient  # noqa: E402
from megatron_tg.rollout.context import RolloutContext  # noqa: E402
from megatron_tg.rollout.engine.launch import start_engines  # noqa: E402
from megatron_tg.rollout.engine.protocol import SGLANG_SAMPLING_KEYS  # noqa: E402
from tests.rollout.conftest import VOCAB, build_tiny_model, http  # noqa: E402

PROMPT = [5, 17, 42, 7, 99]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("model"), seed=0, with_tokenizer=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "2")  # SGLang's knob (20 s by default)
        (e,) = start_engines([model], tmp_path_factory.mktemp("logs"))
    yield e
    e.stop()


def sglang_accepts(body: dict, vocab: int = VOCAB) -> None:
    """What SGLang does with a /generate body before scheduling it; raises where it would 400."""
    err = generate_contract_error(body)
    assert err is None, f"SGLang's contract gate refuses {body}: {err}"
    req = GenerateReqInput(**body)
    req.normalize_batch_and_arguments()
    for sp in (req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params]):
        params = SamplingParams(**sp)
        params.normalize(None)  # input_ids only: no tokenizer, as with --skip-tokenizer-init
        params.verify(vocab)


def _tracing(bodies: list[dict]) -> aiohttp.ClientSession:
    """A client session that appends every /generate body it sends to ``bodies``."""
    async def on_chunk(session, ctx, params):
        if str(params.url).endswith("/generate"):
            bodies.append(json.loads(params.chunk))

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_chunk)
    return aiohttp.ClientSession(trace_configs=[trace])


async def captured_bodies(url: str) -> list[dict]:
    """Drive the client the way the rollout path does and return every /generate body sent."""
    bodies: list[dict] = []
    cfg = RolloutConfig()
    async with SGLangClient([url]) as client:
        client._session = _tracing(bodies)
        # RolloutManager's parameters, with RolloutContext's per-request seeds
        params = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": 6}
        ctx = RolloutContext(client, task=None, group_id="g", rollout_id="g/0", sampling_params=params,
                             vocab_size=VOCAB, seed=11)
        await ctx.generate(PROMPT)
        await ctx.generate(PROMPT + [3], max_new_tokens=3, stop_token_ids=[1])
        # the demo's expert probe (no log-probs), text input, greedy with prompt log-probs
        await client.generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": 7},
                              return_logprob=False, rid="probe/1/0/5")
        await client.generate(text="w5 w17 w42", sampling_params={"temperature": 0, "max_new_tokens": 3})
        await client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 2},
                              extra={"logprob_start_len": 0, "top_logprobs_num": 2})
    return bodies


def test_every_request_body_the_client_builds_is_accepted_by_sglang(engine):
    bodies = asyncio.run(captured_bodies(engine.url))
    assert len(bodies) == 5
    assert {b["rid"] for b in bodies} >= {"g/0/t0.0@0", "g/0/t1.0@0", "probe/1/0/5@0"}
    assert all(isinstance(b["sampling_params"].get("sampling_seed"), int) for b in bodies[:2])
    for body in bodies:
        sglang_accepts(body)


def test_hinted_turn_requests_are_accepted_by_sglang(tmp_path):
    """objective.hinted_samples' two requests per hinted sample -- the turn sampled on the
    feedback context (seeded) and the prefill that asks for the student sequence's routing
    (max_new_tokens=1, return_routed_experts, routed_experts_start_len) -- pass SGLang's own
    request checks."""
    from megatron_tg.chat import get_tiny_tokenizer
    from megatron_tg.chat.builder import simulate_rollout
    from megatron_tg.models.qwen3_moe import Qwen3Arch
    from megatron_tg.models.tiny import build_tiny_policy
    from megatron_tg.sampling.hinted import add_hinted_turns
    from megatron_tg.sampling.train_sample import TrainSample
    from tests.chat.convos import SEARCH_TOOL, conversation

    policy = build_tiny_policy(tmp_path / "policy")
    arch = Qwen3Arch.from_hf(policy)
    routing = dict(moe_layers=arch.moe_layers, num_layers=arch.num_layers,
                   top_k=arch.num_experts_per_tok, num_experts=arch.num_experts)
    tok = get_tiny_tokenizer()
    ro = simulate_rollout(tok, conversation()[:6], tools=[SEARCH_TOOL], group_id="g", rollout_id="r")
    sample = TrainSample(ro, 1.0, {1: "Use the lines= argument of the search tool."})
    (e,) = start_engines([policy], tmp_path / "logs", extra_args=["--enable-return-routed-experts"])
    bodies: list[dict] = []

    async def go():
        async with SGLangClient([e.url]) as client:
            client._session = _tracing(bodies)
            return await add_hinted_turns(client, [sample], tok, n=1, framing="user",
                                          sampling_params={"temperature": 1.0, "max_new_tokens": 6},
                                          seed=3, routing=routing, vocab_size=len(tok))
    try:
        metrics = asyncio.run(go())
    finally:
        e.stop()
    assert metrics["hinted/samples"] == 1 and metrics["hinted/failed"] == 0
    assert len(bodies) == 2
    turn, route = bodies
    assert isinstance(turn["sampling_params"]["sampling_seed"], int)
    # The simulated rollout carries no routing of its own, so every row is asked for.
    assert route["return_routed_experts"] is True and route["routed_experts_start_len"] == 0
    assert route["input_ids"] == ro.token_ids[:ro.assistant_turns()[1].start] + sample.hinted[0].token_ids
    assert route["sampling_params"]["max_new_tokens"] == 1
    for body in bodies:
        sglang_accepts(body, vocab=arch.vocab_size)


def test_every_reply_decodes_as_sglangs_generate_response(engine):
    bodies = asyncio.run(captured_bodies(engine.url))
    bodies.append({"input_ids": [PROMPT, [3, 4]], "rid": "batch", "return_logprob": True,
                   "sampling_params": {"temperature": 0.8, "max_new_tokens": 3, "n": 2}})
    for body in bodies:
        sglang_accepts(body)
        status, reply = http(engine.url, "/generate", body)
        assert status == 200, reply
        for one in reply if isinstance(reply, list) else [reply]:
            resp = GenerateResponse.from_json_value(one)  # raises JsonContractError on a bad shape
            meta = resp.meta_info
            assert meta.id and meta.completion_tokens == len(resp.output_ids) > 0
            assert isinstance(meta.finish_reason, (api_types.FinishLength, api_types.FinishStop))
            assert meta.weight_version == "default"
            if body.get("return_logprob"):
                assert len(meta.output_token_logprobs) == meta.completion_tokens
                assert [e.token_id for e in meta.output_token_logprobs] == list(resp.output_ids)
                assert all(e.logprob <= 0.0 for e in meta.output_token_logprobs)
            if body.get("top_logprobs_num"):
                assert len(meta.input_token_logprobs) == len(PROMPT) and len(meta.output_top_logprobs[0]) == 2


def test_stop_and_abort_replies_decode_as_sglangs(engine):
    greedy = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    first = http(engine.url, "/generate", greedy)[1]["output_ids"]
    stop = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                     "stop_token_ids": [first[2]]}}
    sglang_accepts(stop)
    meta = GenerateResponse.from_json_value(http(engine.url, "/generate", stop)[1]).meta_info
    assert isinstance(meta.finish_reason, api_types.FinishStop) and meta.finish_reason.matched == first[2]

    long = {"input_ids": PROMPT, "rid": "cut", "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}
    sglang_accepts(long)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http, engine.url, "/generate", long)
        deadline = time.monotonic() + 30
        while http(engine.url, "/server_info")[1]["internal_states"][0]["num_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http(engine.url, "/abort_request", {"rid": "cut"})[0] == 200
        status, reply = pending.result(timeout=60)
    resp = GenerateResponse.from_json_value(reply)
    assert status == 200 and isinstance(resp.meta_info.finish_reason, api_types.FinishAbort)
    assert resp.meta_info.finish_reason.status_code is None and 0 < len(resp.output_ids) < 5000


def test_sampling_keys_are_sglangs_and_unknown_keys_are_refused_by_both(engine):
    api = set(api_types.SamplingParams.__struct_fields__)
    engine_side = set(SamplingParams.__struct_fields__)
    assert SGLANG_SAMPLING_KEYS == api & engine_side  # API fields that SamplingParams(**) takes
    body = {"input_ids": PROMPT, "sampling_params": {"max_tokens": 4}}  # the OpenAI spelling
    sglang_says = generate_contract_error(body)
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(**body["sampling_params"])
    status, out = http(engine.url, "/generate", body)
    assert sglang_says.startswith("unknown field `max_tokens`")
    assert status == 400 and out["error"]["message"].startswith("unknown field `max_tokens`")


def _http_server_source() -> ast.Module:
    spec = importlib.util.find_spec("sglang.srt.entrypoints.http_server")
    return ast.parse(open(spec.origin).read())


def _function(tree: ast.Module, name: str) -> ast.AsyncFunctionDef:
    return next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def _routes(fn) -> list[str]:
    return [d.args[0].value for d in fn.decorator_list
            if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)]


def test_model_info_has_sglangs_keys(engine):
    tree = _http_server_source()
    fn = _function(tree, "model_info")
    assert "/model_info" in _routes(fn) and "/get_model_info" in _routes(_function(tree, "get_model_info"))
    result = next(n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
                  and any(getattr(t, "id", None) == "result" for t in n.targets))
    keys = {k.value for k in result.keys}
    status, info = http(engine.url, "/model_info")
    assert status == 200 and keys <= set(info), keys - set(info)
    assert http(engine.url, "/get_model_info")[1] == info  # the deprecated name answers the same


def test_health_generates_as_sglangs_does(engine):
    tree = _http_server_source()
    routes = _routes(_function(tree, "health_generate"))
    assert {"/health", "/health_generate"} <= set(routes)  # one handler: /health generates a token
    assert envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get() is True  # SGLang's default
    # The embedded engine's /health generates too: while paused nothing is generated, so
    # it answers 503 after the health-check timeout, and /ready says paused at once.
    assert http(engine.url, "/health")[0] == 200 and http(engine.url, "/ready")[0] == 200
    assert http(engine.url, "/pause_generation", {"mode": "retract"})[0] == 200
    try:
        assert http(engine.url, "/ready")[0] == 503
        assert http(engine.url, "/health", timeout=30)[0] == 503
        assert http(engine.url, "/model_info")[0] == 200  # liveness without a generation
    finally:
        http(engine.url, "/continue_generation", {})
    assert http(engine.url, "/health")[0] == 200
