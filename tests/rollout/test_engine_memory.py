"""Colocated mode's engine side, over real HTTP to embedded engine processes: release and
resume of memory (engine/memory.py) and weights written from tensors in SGLang's payload
format (rollout.transport), through the client's public calls.

The embedded engine has one TP rank, so "two engines x TP 2" is two engines x TP 1 here
(tests/rollout/test_transport_payloads.py reads 2 x 2 payloads in four processes)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from megatron_tg.rollout.client import SGLangClient, SGLangClientError
from megatron_tg.rollout.engine.weights import WeightChecker, iter_checkpoint
from tests.rollout.sglang_fields import FIELDS, ROUTES

PROMPT = [5, 17, 42, 7, 99]
BUCKET = 96 << 10  # bytes: the tiny model (~450 KB) takes several buckets (its largest tensor is 75 KiB)


@pytest.fixture(scope="module")
def engines(engine_launcher, model_b, tmp_path_factory):
    from megatron_tg.rollout.engine.launch import start_engines

    es = start_engines([model_b, model_b], tmp_path_factory.mktemp("mem_logs"),
                       extra_args=["--enable-memory-saver"])
    yield es
    for e in es:
        e.stop()


@pytest.fixture(scope="module")
def backed_up(model_a, tmp_path_factory):
    from megatron_tg.rollout.engine.launch import start_engines

    (e,) = start_engines([model_a], tmp_path_factory.mktemp("backup_logs"),
                         extra_args=["--enable-memory-saver", "--enable-weights-cpu-backup"])
    yield e
    e.stop()


def local_checksums(model_dir) -> dict[str, str]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return WeightChecker(model).handle("checksum")[0]["checksums"]


class RecordingClient(SGLangClient):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent: list[tuple[str, object]] = []

    async def _call(self, url, method, path, body=None, timeout_s=None):
        self.sent.append((path, body))
        return await super()._call(url, method, path, body, timeout_s)


def occupation(http_call, url) -> dict:
    return http_call(url, "/server_info")[1]["memory_occupation"]


def checksums(http_call, url) -> dict[str, str]:
    s, out = http_call(url, "/weights_checker", {"action": "checksum"})
    assert s == 200, out
    return out["ranks"][0]["checksums"]


def test_colocated_sync_sequence_writes_the_trainers_weights_bit_exact(http_call, engines, model_a, model_b):
    """slime's order: release all -> (train) -> resume weights -> update from tensors ->
    resume kv_cache. Both engines end up with checkpoint A's weights to the bit."""
    urls = [e.url for e in engines]
    want_a, want_b = local_checksums(model_a), local_checksums(model_b)
    assert all(checksums(http_call, u) == want_b for u in urls) and want_a != want_b
    full = occupation(http_call, urls[0])["weights_bytes"]
    assert full > 400_000

    async def sync() -> tuple[list, list]:
        async with RecordingClient(urls) as client:
            await client.release_memory_occupation()  # every tag
            released = [occupation(http_call, u) for u in urls]
            with pytest.raises(SGLangClientError, match="memory is released"):
                await client.generate_on(urls[0], {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            with pytest.raises(SGLangClientError, match="weights' memory is released"):
                await client.send_weights_from_tensor(urls[0], iter_checkpoint(str(model_a)), bucket_bytes=BUCKET)
            await client.resume_memory_occupation(["weights"])
            sent = [await client.send_weights_from_tensor(u, iter_checkpoint(str(model_a)), bucket_bytes=BUCKET,
                                                          weight_version="a1") for u in urls]
            with pytest.raises(SGLangClientError, match="kv_cache"):  # KV still released: no generation
                await client.generate_on(urls[1], {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
            return released, sent, client.sent

    released, sent, requests = asyncio.run(sync())
    for occ in released:  # the engine's own accounting: nothing held while released
        assert occ["weights_bytes"] == 0 and occ["kv_cache_bytes"] == 0 and occ["weights_backup_bytes"] < 1024
        assert occ["released"] == ["cuda_graph", "kv_cache", "weights"]
    assert all(n >= 5 for n in sent)  # bucketed: ~450 KB in 96 KiB requests
    for u in urls:
        assert checksums(http_call, u) == want_a
        assert occupation(http_call, u)["weights_bytes"] == full
        assert http_call(u, "/model_info")[1]["weight_version"] == "a1"
        s, out = http_call(u, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
        assert s == 200 and len(out["output_ids"]) == 3
    # every body uses only fields SGLang 0.5.23's request class has
    for path, body in requests:
        if path in ROUTES:
            assert set(body) <= set(FIELDS[ROUTES[path]]), (path, body)
    update = next(b for p, b in requests if p == "/update_weights_from_tensor")
    assert update["load_format"] == "flattened_bucket" and len(update["serialized_named_tensors"]) == 1
    assert {b["tags"] is None for p, b in requests if p == "/release_memory_occupation"} == {True}


def test_resumed_weights_without_a_backup_are_not_the_old_ones(http_call, engines, model_b):
    """Without --enable-weights-cpu-backup resumed weights are undefined (NaN here), as on
    SGLang: a sync that skips the update after resume cannot go unnoticed."""
    url = engines[0].url
    want = checksums(http_call, url)
    assert http_call(url, "/release_memory_occupation", {"tags": ["weights"]}) == (200, None)
    assert http_call(url, "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
    got = checksums(http_call, url)
    buffers = {n for n in want if "rotary" in n}
    assert all(got[n] != want[n] for n in want if n not in buffers) and all(got[n] == want[n] for n in buffers)
    assert http_call(url, "/update_weights_from_disk", {"model_path": str(model_b)})[0] == 200
    assert checksums(http_call, url) == local_checksums(model_b)


def test_a_cpu_backup_restores_the_weights_bit_exact(http_call, backed_up, model_a):
    url = backed_up.url
    before, full = checksums(http_call, url), occupation(http_call, url)["weights_bytes"]
    assert http_call(url, "/release_memory_occupation", {}) == (200, None)
    occ = occupation(http_call, url)
    assert occ["weights_bytes"] == 0 and occ["weights_backup_bytes"] == full
    s, out = http_call(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert s == 400 and "resume_memory_occupation" in out["error"]["message"]
    assert http_call(url, "/health_generate")[0] == 503
    assert http_call(url, "/resume_memory_occupation", {"tags": None}) == (200, None)
    assert checksums(http_call, url) == before == local_checksums(model_a)
    assert occupation(http_call, url) == {**occ, "weights_bytes": full, "weights_backup_bytes": 0, "released": []}


def test_release_needs_an_idle_engine_and_retracted_requests_wait_for_the_kv_cache(http_call, backed_up):
    url = backed_up.url
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", http_call(url, "/generate", {
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while http_call(url, "/server_info")[1]["internal_states"][0]["num_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        http_call(url, "/pause_generation", {"mode": "in_place"})
        assert occupation(http_call, url)["kv_cache_bytes"] > 0  # the running batch's cache
        s, out = http_call(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert s == 400 and "only when server is idle" in out["error"]["message"]
        http_call(url, "/pause_generation", {"mode": "retract"})  # drops the KV, requeues the request
        assert http_call(url, "/release_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
        assert occupation(http_call, url)["kv_cache_bytes"] == 0
        s, out = http_call(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert s == 400 and "already released" in out["error"]["message"]
        assert http_call(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 400  # not released
        assert http_call(url, "/release_memory_occupation", {"tags": ["kv"]})[0] == 400  # not a tag
        http_call(url, "/continue_generation", {})
        time.sleep(0.3)
        state = http_call(url, "/server_info")[1]["internal_states"][0]
        assert state["num_running"] == 0 and state["num_waiting"] == 1  # held: no KV to run in
        assert http_call(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
    finally:
        http_call(url, "/continue_generation", {})
        t.join(120)
    status, out = box["out"]
    assert status == 200 and len(out["output_ids"]) == 400 and out["meta_info"]["num_retractions"] == 1
