"""The weight-update group with SGLang's own engine-side code against the trainer's side.

Two engines x TP 2 run as four gloo processes. Each forms its own TP group (as SGLang's
scheduler has one) and joins the weight-update group through SGLang 0.5.23's
``WeightUpdater.init_weights_update_group`` (``model_runner_components/weight_updater.py``),
which ranks it ``rank_offset + tp_rank`` and forms the group with
``sglang.srt.utils.common.init_custom_process_group``; it receives through the same class's
``receive_weights_from_distributed`` (``FlattenedTensorBucket.empty`` for flattened buckets).
The trainer forms its side with the project's ``init_weight_update_group``, lays the group out
with the client's ``group_layout``, packs mixed-dtype buckets with ``FlatBucket`` and
broadcasts. Receipt must be bit-exact.

Nearest real piece, not the whole engine: SGLang's scheduler, tokenizer manager and HTTP
server need CUDA kernels (sglang-kernel) and cannot start on CPU, so the request bodies
travel through a queue instead of HTTP; the class methods called are SGLang's unchanged,
on a plain object holding the fields they read (``tp_rank``, ``device``,
``_model_update_group``), since building a real ``WeightUpdater`` needs a loaded model.
"""

from __future__ import annotations

import functools
import os
import types

import pytest
import torch
import torch.multiprocessing as mp

from megatron_tg.rollout.transport import FlatBucket, init_weight_update_group, send_tensors
from megatron_tg.rollout.weight_client import EngineInfo, group_layout
from megatron_tg.testing.distributed import free_port

GROUP = "tg-weights"
TIMEOUT_S = 240.0


def weights() -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of mixed dtypes, in an order that packed back to back would
    leave wider dtypes at misaligned offsets (bf16 [3] then fp32, fp16 [5] then fp64)."""
    g = torch.Generator().manual_seed(0)
    spec = [("model.norm.weight", torch.bfloat16, (3,)),
            ("model.layers.0.mlp.gate.weight", torch.float32, (4, 6)),
            ("model.layers.0.self_attn.q_norm.weight", torch.float16, (5,)),
            ("model.layers.0.mlp.gate.e_score_correction_bias", torch.float64, (4,)),
            ("model.layers.0.mlp.experts.0.up_proj.weight", torch.bfloat16, (8, 6)),
            ("model.layers.0.mlp.experts.1.up_proj.weight", torch.bfloat16, (8, 6)),
            ("model.layers.0.self_attn.q_proj.weight", torch.float32, (16, 6)),
            ("model.embed_tokens.weight", torch.bfloat16, (40, 6))]
    out = [(n, (torch.randn(s, generator=g) * 3).to(d)) for n, d, s in spec]
    out[0][1][1] = float("nan")  # bit-exact means NaN payloads too
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _engine_gpu(engine: int, tp_rank: int, tp_port: int, master_port: int, rank_offset: int,
                world_size: int, backend: str, inbox, outbox) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        device = "cpu"
        if backend == "nccl":  # one GPU per group member, as on a node: the trainer has GPU 0
            torch.cuda.set_device(rank_offset + tp_rank)
            device = "cuda"
        import torch.distributed as dist
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        # The engine's own TP group; SGLang asserts a default process group exists.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=2)
        me = types.SimpleNamespace(tp_rank=tp_rank, device=device, _model_update_group={})
        me._receive_bucketed_weights_from_distributed = functools.partial(
            WeightUpdater._receive_bucketed_weights_from_distributed, me)
        ok, msg = WeightUpdater.init_weights_update_group(me, "127.0.0.1", master_port, rank_offset, world_size,
                                                          GROUP, backend=backend)
        rank = me._model_update_group[GROUP].rank() if ok else None
        got = []
        while ok and (req := inbox.get(timeout=TIMEOUT_S)) is not None:
            # As raw bytes: a tensor through a queue would be shared memory owned by this process.
            got += [(n, str(t.dtype), tuple(t.shape), _bits(t.cpu()).numpy().tobytes())
                    for n, t in WeightUpdater.receive_weights_from_distributed(
                me, names=req["names"], dtypes=req["dtypes"], shapes=req["shapes"], group_name=GROUP,
                load_format=req.get("load_format"))]
        if ok:
            WeightUpdater.destroy_weights_update_group(me, GROUP)
        outbox.put((engine, tp_rank, ok, msg, rank, got))
    except BaseException as exc:  # report, never hang the parent
        import traceback

        outbox.put((engine, tp_rank, False, traceback.format_exc() + repr(exc), None, []))


@pytest.mark.parametrize("backend", [
    "gloo",
    # The GPU twin: the same code with NCCL and GPU tensors (five GPUs: trainer + 2 x TP 2).
    pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 5, reason="needs 5 CUDA GPUs")]),
])
def test_two_tp2_engines_join_via_sglangs_helper_and_receive_bit_exact(backend):
    infos = [EngineInfo(f"engine{i}", "0.5.23", tp_size=2) for i in range(2)]
    world, offsets = group_layout(infos)
    assert (world, offsets) == (5, [1, 3])
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    inboxes, procs = [], []
    master_port = free_port()
    for e in range(2):
        tp_port = free_port()
        for tp in range(2):
            inbox = ctx.Queue()
            inboxes.append(inbox)
            procs.append(ctx.Process(target=_engine_gpu, args=(e, tp, tp_port, master_port, offsets[e], world,
                                                               backend, inbox, outbox), daemon=True))
    for p in procs:
        p.start()
    bodies = []
    try:
        if backend == "nccl":
            torch.cuda.set_device(0)
        group = init_weight_update_group("127.0.0.1", master_port, 0, world, GROUP, backend, timeout_s=TIMEOUT_S)

        def post(body):  # what /update_weights_from_distributed would carry to each engine
            bodies.append(body)
            for q in inboxes:
                q.put(body)

        bucket = FlatBucket(512, group.device)
        tensors = weights()
        for name, t in tensors[:-1]:
            if not bucket.fits(t):
                post({"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                      "load_format": "flattened_bucket"})
                group.broadcast(bucket.flat())
                bucket.clear()
            bucket.add(name, t)
        post({"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
              "load_format": "flattened_bucket"})
        group.broadcast(bucket.flat())
        # The last tensor goes the per-tensor way (no load_format): one broadcast per tensor.
        last = tensors[-1:]
        post({"names": [last[0][0]], "dtypes": ["bfloat16"], "shapes": [list(last[0][1].shape)]})
        send_tensors(group, last)
        for q in inboxes:
            q.put(None)
        results = [outbox.get(timeout=TIMEOUT_S) for _ in procs]
        group.close()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for engine, tp_rank, ok, msg, rank, got in results:
        assert ok, f"engine {engine} tp_rank {tp_rank}: {msg}"
        assert rank == offsets[engine] + tp_rank  # SGLang's ranking, laid out without collisions
        assert [g[0] for g in got] == [n for n, _ in tensors]
        for (name, want), (_, dtype, shape, raw) in zip(tensors, got):
            assert dtype == str(want.dtype) and shape == tuple(want.shape), name
            assert raw == _bits(want).numpy().tobytes(), f"{name} differs on engine {engine} tp {tp_rank}"
    assert len(bodies) >= 3 and any(len(set(b["dtypes"])) > 1 for b in bodies)  # mixed-dtype buckets


def test_flat_buckets_are_what_sglangs_bucket_accepts():
    """0.5.23's ``FlattenedTensorBucket.empty`` refuses a tensor at a byte offset that is not
    a multiple of its element size; FlatBucket never produces one, naive packing does."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    tensors = weights()
    naive = FlattenedTensorBucket(named_tensors=tensors[:2])  # SGLang's own sender packs back to back
    meta = naive.get_metadata()
    with pytest.raises(ValueError, match="Unaligned received tensor model.layers.0.mlp.gate.weight"):
        FlattenedTensorBucket.empty([m.name for m in meta], [m.dtype for m in meta], [m.shape for m in meta], "cpu")
    bucket, buckets = FlatBucket(1 << 20, torch.device("cpu")), []
    for name, t in tensors:
        if not bucket.fits(t):
            buckets.append((list(bucket.names), list(bucket.dtypes), list(bucket.shapes), bucket.flat().clone()))
            bucket.clear()
        bucket.add(name, t)
    buckets.append((bucket.names, bucket.dtypes, bucket.shapes, bucket.flat().clone()))
    assert len(buckets) > 1
    received = []
    for names, dtypes, shapes, flat in buckets:
        empty = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        empty.get_flattened_tensor().copy_(flat)  # what the broadcast would write
        received += empty.reconstruct_tensors()
    assert [n for n, _ in received] == [n for n, _ in tensors]
    for (_, want), (_, have) in zip(tensors, received):
        assert torch.equal(_bits(have), _bits(want))
