"""The embedded engine over real HTTP: SGLang shapes, sampling, log-probs, control, weights.

One engine subprocess (checkpoint A, with a tokenizer) serves the whole module; tests
that change its weights or pause it restore the state they found.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_tg.parallel.ports import free_port

PROMPT = [5, 17, 42, 7, 99]


@pytest.fixture(scope="module")
def engine(engine_launcher, model_a):
    (e,) = engine_launcher([model_a])
    yield e
    e.stop()


@pytest.fixture(scope="module")
def hf_a(model_a):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_a, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_b(model_b):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_b, dtype=torch.float32).eval()


def gen(http_call, engine, input_ids=PROMPT, **sp):
    body = {"input_ids": input_ids, "sampling_params": sp, "return_logprob": True}
    status, out = http_call(engine.url, "/generate", body)
    assert status == 200, out
    return out


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def forward_logprobs(model, prompt, output, temperature=1.0):
    """log_softmax(logits / T) of a plain forward pass, at the output positions."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return lp[pos, torch.tensor(output)]


def steps(http_call, engine) -> int:
    return http_call(engine.url, "/get_server_info")[1]["internal_states"][0]["decode_steps"]


def test_response_shape_and_greedy_equals_hf(http_call, engine, hf_a):
    out = gen(http_call, engine, temperature=0, max_new_tokens=12)
    meta = out["meta_info"]
    assert out["output_ids"] == hf_greedy(hf_a, PROMPT, 12)
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (5, 12)
    assert meta["weight_version"] == "default"
    assert isinstance(meta["id"], str) and isinstance(out["text"], str)
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and all(x is None for _, _, x in lps)
    # Greedy log-probs are those of the raw distribution (SGLang normalises T=0 to top_k=1, T=1).
    ref = forward_logprobs(hf_a, PROMPT, out["output_ids"])
    assert torch.allclose(torch.tensor([lp for lp, _, _ in lps]), ref, atol=1e-4)
    status, info = http_call(engine.url, "/get_model_info")
    assert status == 200 and info["weight_version"] == "default" and info["is_generation"] is True


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_forward_pass(http_call, engine, hf_a, temperature):
    out = gen(http_call, engine, temperature=temperature, max_new_tokens=10, sampling_seed=3)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    # SGLang convention: log_softmax(logits / T) at the sampled token, before top-k/top-p.
    ref = forward_logprobs(hf_a, PROMPT, out["output_ids"], temperature)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_top_p_top_k_logprobs_are_unfiltered(http_call, engine, hf_a):
    out = gen(http_call, engine, temperature=1.0, top_p=0.5, top_k=5, max_new_tokens=8, sampling_seed=1)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, forward_logprobs(hf_a, PROMPT, out["output_ids"]), atol=1e-4)


def test_prompt_logprobs(http_call, engine, hf_a):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2}
    meta = http_call(engine.url, "/generate", body)[1]["meta_info"]
    inp = meta["input_token_logprobs"]
    assert inp[0] == [None, PROMPT[0], None] and [t for _, t, _ in inp] == PROMPT
    ref = forward_logprobs(hf_a, PROMPT[:1], PROMPT[1:])
    assert torch.allclose(torch.tensor([lp for lp, _, _ in inp[1:]]), ref, atol=1e-4)
    assert len(meta["output_top_logprobs"]) == 1 and len(meta["output_top_logprobs"][0]) == 2


def test_seeded_sampling_is_reproducible(http_call, engine):
    a = gen(http_call, engine, temperature=1.0, max_new_tokens=16, sampling_seed=123)["output_ids"]
    b = gen(http_call, engine, temperature=1.0, max_new_tokens=16, sampling_seed=123)["output_ids"]
    c = gen(http_call, engine, temperature=1.0, max_new_tokens=16, sampling_seed=124)["output_ids"]
    assert a == b and a != c


def test_stop_token_ids_and_max_tokens(http_call, engine):
    ref = gen(http_call, engine, temperature=0, max_new_tokens=20)["output_ids"]
    k = 6
    stop = ref[k]
    first = ref.index(stop)
    out = gen(http_call, engine, temperature=0, max_new_tokens=20, stop_token_ids=[stop])
    assert out["output_ids"] == ref[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # ignore_eos also ignores stop_token_ids (SGLang's _check_token_based_finish).
    out = gen(http_call, engine, temperature=0, max_new_tokens=20, stop_token_ids=[stop], ignore_eos=True)
    assert out["output_ids"] == ref
    out = gen(http_call, engine, temperature=0, max_new_tokens=3)
    assert out["output_ids"] == ref[:3] and out["meta_info"]["finish_reason"]["type"] == "length"


def test_text_input_and_stop_string(http_call, engine):
    prompt_text = " ".join(f"w{t}" for t in PROMPT)
    status, out = http_call(engine.url, "/generate", {"text": prompt_text,
                                                      "sampling_params": {"temperature": 0, "max_new_tokens": 10}})
    assert status == 200 and out["text"] == " ".join(f"w{t}" for t in out["output_ids"])
    words = out["text"].split()
    status, cut = http_call(engine.url, "/generate", {"text": prompt_text,
                                                      "sampling_params": {"temperature": 0, "max_new_tokens": 10,
                                                                          "stop": [words[3]]}})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": words[3]}
    assert cut["output_ids"] == out["output_ids"][: words.index(words[3]) + 1]
    assert words[3] not in cut["text"]


def test_batch_and_n(http_call, engine):
    body = {"input_ids": [PROMPT, [3, 4]], "rid": "batch", "return_logprob": True,
            "sampling_params": {"temperature": 0.8, "max_new_tokens": 4, "n": 2}}
    status, outs = http_call(engine.url, "/generate", body)
    assert status == 200 and isinstance(outs, list) and len(outs) == 4
    assert [o["meta_info"]["id"] for o in outs] == ["batch_0_0", "batch_0_1", "batch_1_0", "batch_1_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [5, 5, 2, 2]


def test_bad_requests_are_400(http_call, engine):
    s, out = http_call(engine.url, "/generate", {"input_ids": PROMPT, "text": "w3"})
    assert s == 400 and "exactly one" in out["error"]["message"]
    s, out = http_call(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"repetition_penalty": 1.3}})
    assert s == 400 and "repetition_penalty" in out["error"]["message"]
    s, out = http_call(engine.url, "/generate", {"input_ids": [5, 300]})
    assert s == 400 and "input_ids" in out["error"]["message"]
    s, out = http_call(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"sampling_seed": 2**70}})
    assert s == 400 and "sampling_seed" in out["error"]["message"]
    # SGLang 0.5.23 builds SamplingParams(**sampling_params): a misspelt key is a 400
    s, out = http_call(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_tokens": 4}})
    assert s == 400 and "unknown field `max_tokens`" in out["error"]["message"]
    assert http_call(engine.url, "/health_generate")[0] == 200  # still serving


def test_concurrent_requests_are_batched(http_call, engine):
    prompts = [[3 + i, 10 + i, 20 + 2 * i] for i in range(8)]
    singles = [gen(http_call, engine, p, temperature=0, max_new_tokens=16)["output_ids"] for p in prompts[:2]]
    before = steps(http_call, engine)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: gen(http_call, engine, p, temperature=0, max_new_tokens=16), prompts))
    assert all(o["meta_info"]["completion_tokens"] == 16 for o in outs)
    assert [o["output_ids"] for o in outs[:2]] == singles  # padding/batching does not change greedy output
    # 8 x 16 tokens took far fewer than 128 forward passes: requests shared decode steps.
    assert steps(http_call, engine) - before < 64


def _run_in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()))
    t.start()
    return t, box


def _wait_running(http_call, engine, n=1, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http_call(engine.url, "/get_server_info")[1]["internal_states"][0]["num_running"] >= n:
            return
        time.sleep(0.01)
    raise AssertionError("request never started running")


def test_abort_mid_generation(http_call, engine):
    t, box = _run_in_thread(lambda: http_call(engine.url, "/generate", {
        "input_ids": PROMPT, "rid": "to-abort", "return_logprob": True,
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}))
    _wait_running(http_call, engine)
    time.sleep(0.1)
    assert http_call(engine.url, "/abort_request", {"rid": "to-abort"})[0] == 200
    t.join(30)
    status, out = box["out"]
    meta = out["meta_info"]
    assert status == 200 and meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 1000
    assert len(meta["output_token_logprobs"]) == len(out["output_ids"]) == meta["completion_tokens"]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_and_continue(http_call, engine, mode):
    # Long enough that the request cannot finish between "running" and the pause even on a
    # loaded machine (the tiny model makes ~700 tokens/s alone).
    n = 2000
    ref = gen(http_call, engine, temperature=0, max_new_tokens=n, ignore_eos=True)["output_ids"]
    t, box = _run_in_thread(lambda: gen(http_call, engine, temperature=0, max_new_tokens=n, ignore_eos=True))
    _wait_running(http_call, engine)
    assert http_call(engine.url, "/pause_generation", {"mode": mode})[1]["status"] == "ok"
    s1 = steps(http_call, engine)
    time.sleep(0.4)
    assert steps(http_call, engine) == s1 and t.is_alive()  # stopped at a token boundary, waiting
    assert http_call(engine.url, "/continue_generation", {})[0] == 200
    t.join(30)
    out = box["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
    assert out["output_ids"] == ref  # retract re-prefills prompt + tokens so far and carries on


def test_weight_update_waits_for_in_flight_requests(http_call, engine, model_a):
    # SGLang's model-update lock: an update (not paused) runs after in-flight requests finish,
    # so every token of a response comes from one version.
    t, box = _run_in_thread(lambda: gen(http_call, engine, max_new_tokens=400, ignore_eos=True))
    _wait_running(http_call, engine)
    s, out = http_call(engine.url, "/update_weights_from_disk", {"model_path": str(model_a), "weight_version": "w"})
    assert s == 200 and out["success"]
    t.join(0.5)
    assert not t.is_alive() and box["out"]["meta_info"]["completion_tokens"] == 400
    assert box["out"]["meta_info"]["weight_version"] != "w"
    assert gen(http_call, engine, max_new_tokens=1)["meta_info"]["weight_version"] == "w"


def test_pause_abort_mode_returns_partial_and_holds_new_requests(http_call, engine):
    t, box = _run_in_thread(lambda: gen(http_call, engine, max_new_tokens=1000, ignore_eos=True))
    _wait_running(http_call, engine)
    http_call(engine.url, "/pause_generation", {"mode": "abort"})
    t.join(10)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    t2, box2 = _run_in_thread(lambda: gen(http_call, engine, max_new_tokens=4, ignore_eos=True))
    time.sleep(0.4)
    assert t2.is_alive()  # queued while paused
    http_call(engine.url, "/continue_generation", {})
    t2.join(10)
    assert box2["out"]["meta_info"]["completion_tokens"] == 4


def test_flush_cache(http_call, engine):
    status, text = http_call(engine.url, "/flush_cache", {})
    assert status == 200 and "Cache flushed" in text


def test_update_weights_from_disk(http_call, engine, model_a, model_b, hf_b):
    base = gen(http_call, engine, temperature=0, max_new_tokens=12)["output_ids"]
    s, out = http_call(engine.url, "/update_weights_from_disk", {"model_path": str(model_b)})
    assert s == 200 and out["success"] is True, out
    new = gen(http_call, engine, temperature=0, max_new_tokens=12)
    assert new["output_ids"] != base and new["output_ids"] == hf_greedy(hf_b, PROMPT, 12)
    version = new["meta_info"]["weight_version"]
    assert version.isdigit() and int(version) >= 1  # no version given: the count of updates so far
    s, out = http_call(engine.url, "/update_weights_from_disk", {"model_path": str(model_a), "weight_version": "a"})
    assert out["success"] and http_call(engine.url, "/get_weight_version")[1] == {"weight_version": "a"}
    assert gen(http_call, engine, temperature=0, max_new_tokens=12)["output_ids"] == base
    s, out = http_call(engine.url, "/update_weights_from_disk", {"model_path": str(model_a) + "-missing"})
    assert s == 400 and out["success"] is False


def test_update_weights_from_distributed_equals_disk(http_call, engine, model_a, model_b):
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.rollout.engine.weights import iter_checkpoint
    from megatron_tg.rollout.transport import FlatBucket

    def probe():
        o = gen(http_call, engine, temperature=0.9, max_new_tokens=12, sampling_seed=7)
        return o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]

    base = probe()
    http_call(engine.url, "/update_weights_from_disk", {"model_path": str(model_b)})
    via_disk = probe()
    http_call(engine.url, "/update_weights_from_disk", {"model_path": str(model_a)})
    tensors_b = list(iter_checkpoint(str(model_b)))  # HF checkpoint names, per-expert
    tensors_a = list(iter_checkpoint(str(model_a)))

    async def trainer():
        async with SGLangClient([engine.url]) as client:
            group = await client.init_weights_update_group("127.0.0.1", free_port(), group_name="g1")
            try:
                await client.begin_weight_update(group)
                await client.update_weights_from_distributed(group, tensors_b, weight_version="dist-b")
                await client.end_weight_update(group)
                got_b = probe()
                name = "model.layers.1.mlp.experts.2.up_proj.weight"
                remote = http_call(engine.url, "/get_weights_by_name", {"name": name, "truncate_size": 1000})[1]
                assert torch.equal(torch.tensor(remote), dict(tensors_b)[name])
                # Same transport, one flat buffer (SGLang's load_format="flattened_bucket").
                bucket = FlatBucket(sum(t.numel() * t.element_size() for _, t in tensors_a), torch.device("cpu"))
                for n, t in tensors_a:
                    bucket.add(n, t)
                await client.begin_weight_update(group)
                await client.update_weights_from_distributed(group, bucket)
                await client.end_weight_update(group)
                got_a = probe()
                versions = await client.get_weight_version()
            finally:
                await client.destroy_weights_update_group(group)
            return got_b, got_a, versions

    got_b, got_a, versions = asyncio.run(trainer())
    assert got_b == via_disk and got_b != base
    assert got_a == base
    assert list(versions.values())[0].isdigit()  # no version given: bumped to the update count


def test_distributed_update_outside_begin_end_is_refused(http_call, engine, model_a):
    """Finding 3: from SGLang 0.5.21 an update outside begin/end is a 400 before the engine
    joins the broadcast, so the sender's broadcast only ends at the group's timeout."""
    from megatron_tg.rollout.client import SGLangClient, SGLangClientError
    from megatron_tg.rollout.engine.weights import iter_checkpoint

    assert http_call(engine.url, "/end_weight_update", {})[0] == 400  # nothing to end
    assert http_call(engine.url, "/begin_weight_update", {})[0] == 200
    status, out = http_call(engine.url, "/begin_weight_update", {})
    assert status == 400 and "already open" in out["message"]
    assert http_call(engine.url, "/end_weight_update", {})[0] == 200
    tensors = list(iter_checkpoint(str(model_a)))[:2]

    async def trainer():
        async with SGLangClient([engine.url]) as client:
            group = await client.init_weights_update_group("127.0.0.1", free_port(), group_name="bare",
                                                           timeout_s=3)
            try:
                with pytest.raises(SGLangClientError, match="must run between begin_weight_update"):
                    await client.update_weights_from_distributed(group, tensors)
            finally:
                await client.destroy_weights_update_group(group)

    asyncio.run(trainer())


def _between_begin_end(http_call, engine, path, body):
    assert http_call(engine.url, "/begin_weight_update", {})[0] == 200
    try:
        return http_call(engine.url, path, body)
    finally:
        assert http_call(engine.url, "/end_weight_update", {})[0] == 200


def test_flush_fails_while_paused_in_place_and_succeeds_retracted(http_call, engine, model_a):
    """Finding 4: in_place keeps requests in the running batch, where every flush fails
    (an update with SGLang's default flush_cache=true loads, then answers 400); retract
    moves them to the waiting queue, which a paused flush ignores (SGLang >= 0.5.21)."""
    from megatron_tg.rollout.engine.weights import iter_checkpoint
    from megatron_tg.rollout.transport import serialize

    name = "model.norm.weight"
    original = dict(iter_checkpoint(str(model_a)))[name]
    t, box = _run_in_thread(lambda: gen(http_call, engine, temperature=0, max_new_tokens=2000, ignore_eos=True))
    _wait_running(http_call, engine)
    try:
        http_call(engine.url, "/pause_generation", {"mode": "in_place"})
        assert http_call(engine.url, "/flush_cache", {})[0] == 400
        body = {"serialized_named_tensors": [serialize([(name, original * 3)])]}
        s, out = _between_begin_end(http_call, engine, "/update_weights_from_tensor", body)
        assert s == 400 and "cache was not flushed" in out["message"]
        got = torch.tensor(http_call(engine.url, "/get_weights_by_name", {"name": name})[1])
        assert torch.equal(got, original * 3)  # loaded all the same, as SGLang does
        http_call(engine.url, "/continue_generation", {})
        http_call(engine.url, "/pause_generation", {"mode": "retract"})
        assert http_call(engine.url, "/flush_cache", {})[0] == 200
        body = {"serialized_named_tensors": [serialize([(name, original)])], "flush_cache": True}
        s, out = _between_begin_end(http_call, engine, "/update_weights_from_tensor", body)
        assert s == 200 and out["success"], out
    finally:
        http_call(engine.url, "/continue_generation", {})
        t.join(60)
    meta = box["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["num_retractions"] == 1  # never lost


def test_update_weights_from_tensor(http_call, engine, model_a):
    from megatron_tg.rollout.engine.weights import iter_checkpoint
    from megatron_tg.rollout.transport import serialize

    name = "model.norm.weight"
    original = dict(iter_checkpoint(str(model_a)))[name]
    body = {"serialized_named_tensors": [serialize([(name, original * 2)])], "weight_version": "t"}
    assert http_call(engine.url, "/update_weights_from_tensor", body)[0] == 400  # outside begin/end
    s, out = _between_begin_end(http_call, engine, "/update_weights_from_tensor", body)
    assert s == 200 and out["success"], out
    assert torch.equal(torch.tensor(http_call(engine.url, "/get_weights_by_name", {"name": name})[1]), original * 2)
    body = {"serialized_named_tensors": [serialize([(name, original)])]}
    assert _between_begin_end(http_call, engine, "/update_weights_from_tensor", body)[1]["success"]


def test_unknown_weight_names_are_skipped_but_the_checker_names_what_was_missed(http_call, engine, model_a):
    """Finding 7: SGLang's loader skips names it does not know (no error, stale weights);
    snapshot -> reset_tensors -> update -> compare names the weight a renamed tensor missed."""
    from megatron_tg.rollout.engine.weights import iter_checkpoint
    from megatron_tg.rollout.transport import serialize

    tensors = list(iter_checkpoint(str(model_a)))
    typo = [("model.layers.0.self_attn.q_norm.weightt" if n == "model.layers.0.self_attn.q_norm.weight" else n, t)
            for n, t in tensors]
    check = lambda action: http_call(engine.url, "/weights_checker", {"action": action})  # noqa: E731
    try:
        assert check("snapshot")[0] == 200 and check("reset_tensors")[0] == 200
        s, out = _between_begin_end(http_call, engine, "/update_weights_from_tensor",
                          {"serialized_named_tensors": [serialize(typo)]})
        assert s == 200 and out["success"]  # the bad name went unnoticed by the loader
        s, out = check("compare")
        assert s == 400 and out["message"] == "check tensor equality failed: name=model.layers.0.self_attn.q_norm.weight"
        # With every name right the same sequence passes (from the real weights again).
        http_call(engine.url, "/update_weights_from_disk", {"model_path": str(model_a)})
        assert check("snapshot")[0] == 200 and check("reset_tensors")[0] == 200
        _between_begin_end(http_call, engine, "/update_weights_from_tensor",
                 {"serialized_named_tensors": [serialize(tensors)]})
        assert check("compare") == (200, {"success": True, "message": "Success."})
    finally:
        http_call(engine.url, "/update_weights_from_disk", {"model_path": str(model_a)})


def test_an_engine_older_than_the_pinned_range_is_refused_by_version(http_call, engine_launcher, model_plain):
    """An engine following SGLang 0.5.20's rules: no begin/end weight-update calls, and a paused
    flush fails while retracted requests wait (from 0.5.21 it ignores them). The client
    reads its version from /server_info and refuses it before forming any group."""
    from megatron_tg.rollout.client import SGLangClient, SGLangClientError
    from megatron_tg.rollout.engine.launch import start_engines

    (old,) = start_engines([model_plain], model_plain / "logs", extra_args=["--sglang-version", "0.5.20"])
    try:
        info = http_call(old.url, "/server_info")[1]
        assert (info["version"], info["tp_size"], info["pp_size"], info["dp_size"]) == ("0.5.20", 1, 1, 1)
        assert http_call(old.url, "/begin_weight_update", {})[0] == 404
        t, box = _run_in_thread(lambda: gen(http_call, old, temperature=0, max_new_tokens=2000, ignore_eos=True))
        _wait_running(http_call, old)
        http_call(old.url, "/pause_generation", {"mode": "retract"})
        assert http_call(old.url, "/flush_cache", {})[0] == 400  # the retracted request waits
        http_call(old.url, "/continue_generation", {})
        http_call(old.url, "/abort_request", {"abort_all": True})
        t.join(60)

        async def trainer():
            async with SGLangClient([old.url]) as client:
                await client.init_weights_update_group("127.0.0.1", free_port())

        with pytest.raises(SGLangClientError, match=f"{old.url} runs SGLang 0.5.20, older than 0.5.21"):
            asyncio.run(trainer())
    finally:
        old.stop()
