"""The embedded engine started with ``--tp-size 2``: the CPU stand-in for SGLang's two TP ranks,
each reading its own entry of ``/update_weights_from_tensor`` (docs/colocated.md). It takes
exactly two payloads, opens both (here one from another process), refuses them unless they are
bit-identical, naming the rank that differs, and reports which processes made each payload's
shared memory."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time

import pytest
import torch

from megatron_tg.rollout.client import SGLangClient
from megatron_tg.rollout.engine.weights import iter_checkpoint
from megatron_tg.rollout.transport import FlatBucket, serialize_bucket
from tests.rollout.conftest import http
from tests.rollout.test_engine_memory import checksums, local_checksums

BUCKET = 1 << 20  # bytes: the tiny model (~450 KB) in one bucket


@pytest.fixture(scope="module")
def engine(model_b, tmp_path_factory):
    from megatron_tg.rollout.engine.launch import start_engines

    (e,) = start_engines([model_b], tmp_path_factory.mktemp("tp_logs"), extra_args=["--tp-size", "2"])
    yield e
    e.stop()


def _bucket(model_dir, change: str | None = None) -> FlatBucket:
    b = FlatBucket(BUCKET, torch.device("cpu"))
    for name, t in iter_checkpoint(str(model_dir)):
        b.add(name, t + 1 if name == change else t)
    return b


def _child(model_dir, out, done) -> None:
    """Another process's payload of the same bucket, kept alive until the engine has read it."""
    b = _bucket(model_dir)
    out.put(serialize_bucket(b))
    done.wait(120)


def _reap(child) -> None:
    """Wait for the child's exit by its status, not ``join``: ``join`` waits on a pipe that the
    child's torch_shm_manager inherits, and that manager lives on while another process (the
    engine here) has opened one of its files."""
    deadline = time.monotonic() + 60
    while child.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0


def _update(url: str, payloads: list[str]) -> dict:
    """One update inside begin/end, its reply whatever its status."""
    assert http(url, "/begin_weight_update", {})[0] == 200
    try:
        return http(url, "/update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                        "load_format": "flattened_bucket", "flush_cache": False})[1]
    finally:
        assert http(url, "/end_weight_update", {})[0] == 200


def test_two_payloads_from_two_processes_load_bit_exact(http_call, engine, model_a, model_b):
    url = engine.url
    info = http_call(url, "/server_info")[1]
    assert info["tp_size"] == 2 and info["tensor_payloads"]["payloads_opened"] == 0
    assert checksums(http_call, url) == local_checksums(model_b)
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_child, args=(str(model_a), out, done))
    child.start()
    try:
        theirs = out.get(timeout=120)
        mine = _bucket(model_a)
        reply = _update(url, [theirs, serialize_bucket(mine)])
    finally:
        done.set()
        _reap(child)
    assert reply["success"], reply
    assert checksums(http_call, url) == local_checksums(model_a)
    acc = http_call(url, "/server_info")[1]["tensor_payloads"]
    # TP rank 0's memory was the child's, rank 1's this process's
    assert acc["last_senders"] == [[child.pid], [os.getpid()]] and acc["payloads_opened"] == 2
    # The one-process path serialises one payload per rank of the engine's tp_size
    async def again():
        async with SGLangClient([url]) as client:
            return await client.send_weights_from_tensor(url, iter_checkpoint(str(model_b)), bucket_bytes=BUCKET)
    assert asyncio.run(again()) == 1
    assert checksums(http_call, url) == local_checksums(model_b)
    assert http_call(url, "/server_info")[1]["tensor_payloads"]["payloads_opened"] == 4


def test_payloads_that_differ_or_miscount_are_refused(http_call, engine, model_a, model_b):
    url = engine.url
    before = checksums(http_call, url)
    same, other = _bucket(model_a), _bucket(model_a, change="model.norm.weight")
    reply = _update(url, [serialize_bucket(same), serialize_bucket(other)])
    assert reply == {"success": False, "message": "serialized_named_tensors[1] (TP rank 1) differs from TP rank "
                     "0's: tensor model.norm.weight holds other bytes; every TP rank must receive the same "
                     "full tensors"}, reply
    assert checksums(http_call, url) == before  # nothing loaded
    for n in (1, 3):
        reply = _update(url, [serialize_bucket(same) for _ in range(n)])
        assert reply == {"success": False, "message": "serialized_named_tensors must hold one payload per TP "
                         f"rank of this engine (tp_size=2), got {n}"}, reply
    # the broadcast path joins as one rank: refused at this size
    s, out = http_call(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                           "rank_offset": 1, "world_size": 2})
    assert s == 400 and "--tp-size 2" in out["message"]
    assert checksums(http_call, url) == before
