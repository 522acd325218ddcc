"""The /update_weights_from_tensor payload (rollout.transport) across real processes.

Each reader is its own program (``subprocess``), as an engine is: CPU tensors must cross by
shared-memory file name (torch's file_descriptor strategy would need the sender's
multiprocessing authkey). Two engines x TP 2 are four readers, each opening only its own
entry, as SGLang's ``deserialize_own_rank`` does."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import types

import pytest
import torch

from megatron_tg.rollout import transport as T
from megatron_tg.rollout.engine.memory import ALL_TAGS

from tests.rollout.sglang_fields import MEMORY_TAGS

READER = r"""
import hashlib, json, sys
from megatron_tg.rollout import transport as T
payloads = json.loads(sys.stdin.read())
rank = int(sys.argv[1])
out = T.reconstruct_bucket(T.deserialize_payload(payloads[rank]))
print(json.dumps([[n, str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()] for n, t in out]))
"""


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
            ("model.layers.0.mlp.experts.3.up_proj.weight", torch.randn(4, 3, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(5, generator=g).to(torch.bfloat16))]


def test_two_engines_at_tp2_each_rank_reads_its_own_entry_bit_exact(tmp_path):
    tensors = mixed_tensors()
    bucket = T.FlatBucket(1 << 10, torch.device("cpu"))
    for n, t in tensors:
        bucket.add(n, t)
    # one serialisation per (engine, rank): each reader gives back the reference it takes
    requests = [[T.serialize_bucket(bucket) for _rank in range(2)] for _engine in range(2)]
    want = [[n, str(t.dtype), list(t.shape), digest(t)] for n, t in tensors]
    procs = [subprocess.Popen([sys.executable, "-c", READER, str(rank)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for payloads in requests for rank in range(2)]
    inputs = [json.dumps(payloads) for payloads in requests for _ in range(2)]
    for p, stdin in zip(procs, inputs):
        out, err = p.communicate(stdin, timeout=120)
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out) == want


def test_metadata_pickles_as_sglang_reads_it():
    """SGLang reads the metadata by attribute; its SafeUnpickler admits SimpleNamespace, not
    our class; offsets are byte offsets into the uint8 buffer."""
    import io
    import pickle

    bucket = T.FlatBucket(1 << 10, torch.device("cpu"))
    for n, t in mixed_tensors():
        bucket.add(n, t)
    meta = T.bucket_metadata(bucket)
    got = pickle.loads(pickle.dumps(meta))
    assert all(type(m) is types.SimpleNamespace for m in got)
    assert [(m.name, m.start_idx, m.end_idx, m.numel, m.dtype, tuple(m.shape)) for m in got] == [
        ("model.embed_tokens.weight", 0, 140, 140, torch.float32, (7, 5)),
        ("model.layers.0.mlp.experts.3.up_proj.weight", 140, 164, 24, torch.bfloat16, (4, 3)),
        ("model.norm.weight", 164, 174, 10, torch.bfloat16, (5,))]
    buf = io.BytesIO()
    pickle.dump(meta, buf)
    assert b"megatron_tg" not in buf.getvalue()  # nothing an SGLang process could not import


def test_the_reader_rebuilds_data_only():
    import base64
    import os
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    evil = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    with pytest.raises(ValueError, match="Blocked unsafe global"):
        T.deserialize_payload(evil)
    with pytest.raises(ValueError):  # base64 is validated, as SGLang's b64decode(validate=True)
        T.deserialize_payload("not base64 !")


def test_a_bucket_whose_metadata_does_not_match_its_bytes_is_refused():
    flat = torch.zeros(10, dtype=torch.uint8)

    def meta(start, end, dtype=torch.float32, shape=(1,)):
        return types.SimpleNamespace(name="w", shape=torch.Size(shape), dtype=dtype, start_idx=start,
                                     end_idx=end, numel=end - start)

    with pytest.raises(ValueError, match="Unaligned"):
        T.reconstruct_bucket({"flattened_tensor": flat, "metadata": [meta(2, 6)]})
    with pytest.raises(ValueError, match="do not hold"):
        T.reconstruct_bucket({"flattened_tensor": flat, "metadata": [meta(8, 12)]})
    with pytest.raises(ValueError, match="do not hold"):
        T.reconstruct_bucket({"flattened_tensor": flat, "metadata": [meta(0, 8)]})
    (name, t), = T.reconstruct_bucket({"flattened_tensor": flat, "metadata": [meta(4, 8)]})
    assert name == "w" and t.dtype == torch.float32 and t.data_ptr() == flat.data_ptr() + 4  # a view, no copy


def test_memory_tags_are_sglangs():
    assert ALL_TAGS == MEMORY_TAGS


def test_cuda_handles_carry_the_device_uuid_as_sglangs_senders_write_it(monkeypatch):
    """A CUDA tensor's device goes out as its UUID (SGLang's monkey_patch_torch_reductions on
    the sender's side), so an engine process that numbers its GPUs differently opens the
    right one; everything else about torch's reduction is kept. Run on CPU with torch's
    reduce_tensor standing in for a CUDA tensor's (the CUDA path itself: docs/first-gpu-run.md)."""
    from torch.multiprocessing import reductions as R

    from megatron_tg.rollout import transport as T

    cuda_args = ("cls", (4,), (1,), 0, "storage", torch.float32, 3, b"handle", 16, 0, False, b"ref", 0, b"ev", True)
    monkeypatch.setattr(R, "reduce_tensor", lambda t: (R.rebuild_cuda_tensor, cuda_args))
    monkeypatch.setattr(T, "device_uuid", lambda i: f"GPU-uuid-of-{i}")
    fn, args = T._reduce_tensor_by_uuid(torch.zeros(4))
    assert fn is R.rebuild_cuda_tensor and args[T._CUDA_DEVICE_ARG] == "GPU-uuid-of-3"
    assert args[:6] == cuda_args[:6] and args[7:] == cuda_args[7:]
    monkeypatch.undo()
    cpu = torch.arange(4.0)
    (fn, args), (want_fn, want_args) = T._reduce_tensor_by_uuid(cpu), R.reduce_tensor(cpu)
    assert fn is want_fn is R.rebuild_tensor and args[2] == want_args[2]  # CPU: torch's own, unchanged
    assert args[1].data_ptr() == want_args[1].data_ptr()
    # and the pickler uses it for tensors and parameters
    pickler = T._forking_pickler()(io.BytesIO())
    assert pickler.dispatch_table[torch.Tensor] is T._reduce_tensor_by_uuid
    assert pickler.dispatch_table[torch.nn.Parameter] is T._reduce_tensor_by_uuid
