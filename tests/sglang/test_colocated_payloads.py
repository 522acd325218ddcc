"""Colocated mode against SGLang 0.5.23's own code: the request classes of
``/release_memory_occupation``, ``/resume_memory_occupation`` and
``/update_weights_from_tensor`` (``sglang.srt.managers.io_struct``), its
``MultiprocessingSerializer`` and its ``FlattenedTensorBucket``.

* the record tests/rollout/sglang_fields.py keeps for the CPU lane is SGLang's;
* every body the client sends in the colocated sequence to an embedded engine is one SGLang's
  FastAPI layer accepts (only fields of the class, validated from JSON by pydantic);
* what the trainer serialises, SGLang's own deserialiser and bucket code read bit-exact in
  other processes, each of two engines x TP 2 opening only its own rank's entry
  (``deserialize_own_rank``); and what SGLang's own code serialises (slime's way), the
  embedded engine's reader reads bit-exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys

import pytest
import torch

from megatron_tg.rollout import transport as T
from megatron_tg.rollout.engine.launch import start_engines
from megatron_tg.rollout.engine.weights import iter_checkpoint
from tests.rollout.conftest import build_tiny_model
from tests.rollout.sglang_fields import FIELDS, MEMORY_TAGS, ROUTES
from tests.sglang.test_admin_payloads import RecordingClient, sglang_routes

SGLANG_READER = r"""
import hashlib, json, sys
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
monkey_patch_torch_reductions()
payloads, rank = json.loads(sys.stdin.read()), int(sys.argv[1])
d = MultiprocessingSerializer.deserialize(payloads[rank])
# as ModelRunner's _update_weights_from_flattened_bucket converts the metadata
meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                end_idx=m.end_idx, numel=m.numel) for m in d["metadata"]]
out = FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"], metadata=meta).reconstruct_tensors()
import torch
print(json.dumps([[n, str(t.dtype), list(t.shape),
                   hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
                  for n, t in out]))
"""

SGLANG_WRITER = r"""
import sys, time, torch
import torch.multiprocessing as mp
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
mp.set_sharing_strategy("file_system")  # a separate program reads it (see rollout.transport)
g = torch.Generator().manual_seed(0)
named = [("a", torch.randn(7, 5, generator=g)), ("b", torch.randn(4, 3, generator=g).to(torch.bfloat16))]
b = FlattenedTensorBucket(named_tensors=named)
print(MultiprocessingSerializer.serialize({"flattened_tensor": b.get_flattened_tensor(),
                                          "metadata": b.get_metadata()}, output_str=True), flush=True)
sys.stdin.read()  # keep the tensors alive until the reader is done
"""


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def test_the_recorded_fields_are_sglangs():
    import msgspec
    from sglang.srt import constants
    from sglang.srt.managers import io_struct

    for cls_name, fields in FIELDS.items():
        assert tuple(f.name for f in msgspec.structs.fields(getattr(io_struct, cls_name))) == fields
    routes = sglang_routes()
    assert {p: routes[p] for p in ROUTES} == ROUTES
    assert tuple(constants.GPU_MEMORY_ALL_TYPES) == MEMORY_TAGS


def test_colocated_requests_are_ones_sglang_accepts(tmp_path_factory):
    import msgspec
    import pydantic
    from sglang.srt.managers import io_struct

    model = build_tiny_model(tmp_path_factory.mktemp("model"), seed=0)
    (e,) = start_engines([model], tmp_path_factory.mktemp("logs"), extra_args=["--enable-memory-saver"])
    try:
        async def sequence() -> list:
            async with RecordingClient([e.url]) as client:
                await client.release_memory_occupation()
                await client.resume_memory_occupation(["weights"])
                await client.send_weights_from_tensor(e.url, iter_checkpoint(str(model)), bucket_bytes=1 << 17,
                                                      weight_version="3")
                await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
            return client.sent

        sent = asyncio.run(sequence())
    finally:
        e.stop()
    routes = sglang_routes()
    checked = set()
    for _method, path, body in sent:
        if path not in ROUTES:
            continue
        cls = getattr(io_struct, routes[path])
        assert set(body) <= {f.name for f in msgspec.structs.fields(cls)}, (path, body)
        req = pydantic.TypeAdapter(cls).validate_json(json.dumps(body))  # as FastAPI parses it
        checked.add(path)
        if path == "/update_weights_from_tensor":
            # what the scheduler receives: raw serializer bytes, one per TP rank
            assert req.load_format == "flattened_bucket" and len(req.serialized_named_tensors) == 1
            assert isinstance(req.serialized_named_tensors[0], bytes)
    assert checked == set(ROUTES)


def test_sglangs_deserializer_reads_the_trainers_buckets_bit_exact_two_engines_tp2():
    g = torch.Generator().manual_seed(1)
    tensors = [("model.layers.0.mlp.experts.0.down_proj.weight", torch.randn(6, 4, generator=g)),
               ("model.layers.0.input_layernorm.weight", torch.randn(6, generator=g).to(torch.bfloat16)),
               ("model.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16))]
    bucket = T.FlatBucket(1 << 10, torch.device("cpu"))
    for n, t in tensors:
        bucket.add(n, t)
    requests = [[T.serialize_bucket(bucket) for _rank in range(2)] for _engine in range(2)]
    want = [[n, str(t.dtype), list(t.shape), digest(t)] for n, t in tensors]
    procs = [(subprocess.Popen([sys.executable, "-c", SGLANG_READER, str(rank)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), json.dumps(payloads))
             for payloads in requests for rank in range(2)]
    for p, stdin in procs:
        out, err = p.communicate(stdin, timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == want


def test_the_engines_reader_reads_sglangs_own_serialisation_bit_exact():
    writer = subprocess.Popen([sys.executable, "-c", SGLANG_WRITER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        payload = writer.stdout.readline().strip()
        got = T.reconstruct_bucket(T.deserialize_payload(payload))
        g = torch.Generator().manual_seed(0)
        want = [("a", torch.randn(7, 5, generator=g)), ("b", torch.randn(4, 3, generator=g).to(torch.bfloat16))]
        assert [(n, t.dtype, digest(t)) for n, t in got] == [(n, t.dtype, digest(t)) for n, t in want]
        del got
    finally:
        # Not communicate(): the writer's shared-memory manager (torch_shm_manager, started for
        # the file_system strategy) inherits its stdout and stderr and outlives it a while, so
        # the pipes do not reach EOF when the writer exits.
        writer.stdin.close()
        writer.wait(timeout=60)
        writer.stdout.close()
        writer.stderr.close()
    assert writer.returncode == 0


def test_the_senders_uuid_rewrite_is_sglangs():
    """The sender writes a CUDA handle's device as its UUID at the argument SGLang's own patch
    rewrites and reads back (utils/patch_torch.py); checked against SGLang's code, not a copy."""
    from sglang.srt.utils import patch_torch

    from megatron_tg.rollout import transport as T

    assert patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX == T._CUDA_DEVICE_ARG
    # the reader side maps a UUID string back to an index (some versions accept nothing else)
    reader = getattr(patch_torch, "_device_from_maybe_uuid", None) or patch_torch._device_from_uuid
    assert callable(reader) and callable(patch_torch._device_to_uuid)
