"""The colocated push at engine TP 2 (weight_sync/colocated_push.py: LockstepPush) on 2 gloo
ranks under NCCL's rules, into one embedded engine started with --tp-size 2 (the CPU stand-in
for SGLang's two TP ranks, on the GPUs of trainer ranks 0 and 1):

- trainer TP 2 and PP 2: in buckets far smaller than the model, every engine weight equals the
  checkpoint's to the bit afterwards, each engine rank's payload made by its own trainer
  rank's process (the engine's accounting), the two payloads bit-identical (else refused);
- an engine that refuses a bucket stops both ranks at that bucket with its message, and the
  engine's open update is ended (the next push goes through)."""

from __future__ import annotations

import asyncio
import os

import pytest

from megatron_tg.rollout.engine.launch import start_engines
from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import tiny_hf_model

pytestmark = pytest.mark.usefixtures("comm_rules")

# bytes: the 2-layer model (390 KB) takes several buckets, and its largest tensors (75 KiB, the
# embedding and the output layer, as the 30B model's 594 MiB ones exceed its 512 MiB buckets)
# are larger than one: they go alone, in buckets of their own size
BUCKET = 48 << 10
LAYOUTS = [(2, 1), (1, 2)]  # (tp, pp)


def _push_fn(rank, world, state, hf_cfg, url):
    from types import SimpleNamespace

    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.weight_sync.checks import SyncStats
    from megatron_tg.weight_sync.colocated_push import LockstepPush, check_senders, report_rank

    out = []
    for tp, pp in LAYOUTS:
        ctx = init_parallel(tp=tp, pp=pp)
        arch = Qwen3Arch.from_hf(hf_cfg)
        model = build_model(arch, tp=tp, pp=pp)
        load_hf_weights(model, state, arch, current_layout(model=model))
        trainer = SimpleNamespace(ctx=ctx, model=model, arch=arch)
        reports = [None] * world if rank == 0 else None
        import torch.distributed as dist

        dist.gather_object(report_rank(ctx), reports, dst=0)

        async def run():
            client = SGLangClient([url], timeout_s=60) if rank == 0 else None
            push = LockstepPush(trainer, [url], 2, None, client)
            try:
                stats = SyncStats()
                await push.push(stats, bucket_bytes=BUCKET, version=f"v{tp}{pp}")
                senders = check_senders(await client.get_server_info(strict=True), [url], 2, reports) \
                    if rank == 0 else None
                # The engine refuses the next push: released weights (rank 0 cannot know ahead)
                if rank == 0:
                    await client.release_memory_occupation(["weights"])
                try:
                    await push.push(SyncStats(), bucket_bytes=BUCKET, version="never")
                    refused = None
                except RuntimeError as exc:
                    refused = str(exc)
                if rank == 0:
                    await client.resume_memory_occupation(["weights"])
                await push.push(SyncStats(), bucket_bytes=BUCKET, version=f"v{tp}{pp}")  # ended: goes through
                return dict(stats=stats.as_metrics(), senders=senders, refused=refused, pid=os.getpid())
            finally:
                if client is not None:
                    await client.close()

        out.append(asyncio.run(run()))
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2_engine_model")
    _, other, _ = tiny_hf_model(seed=1, num_hidden_layers=2)  # the trainer's are seed 0
    other.save_pretrained(d)
    (e,) = start_engines([d], tmp_path_factory.mktemp("tp2_engine_logs"),
                         extra_args=["--tp-size", "2", "--enable-memory-saver"])
    yield e
    e.stop()


def test_every_rank_hands_its_engine_rank_the_weights_bit_exact(engine, tmp_path):
    from tests.rollout.conftest import http
    from tests.rollout.test_engine_memory import checksums, local_checksums

    cfg, hf, state = tiny_hf_model(seed=0, num_hidden_layers=2)
    hf.save_pretrained(tmp_path / "want")
    want = local_checksums(tmp_path / "want")
    assert checksums(http, engine.url) != want
    outs = run_distributed(_push_fn, 2, state, cfg.to_dict(), engine.url)
    size = sum(t.numel() * t.element_size() for t in state.values())
    assert sum(t.numel() * t.element_size() > BUCKET for t in state.values()) >= 2  # the solo path runs
    for i, (tp, pp) in enumerate(LAYOUTS):
        sender = outs[0][i]
        assert sender["stats"]["sync/tensors"] == len(state) and sender["stats"]["sync/bytes"] == size
        assert sender["stats"]["sync/buckets"] >= size // BUCKET  # one request per bucket, one engine
        # engine rank r read trainer rank r's memory (check_senders raises otherwise)
        assert sender["senders"] == {engine.url: [outs[0][i]["pid"], outs[1][i]["pid"]]}
        # both ranks stopped at the refused bucket with the engine's reason
        for o in outs:
            assert "weights' memory is released" in o[i]["refused"], (tp, pp, o[i]["refused"])
        assert outs[0][i]["refused"] == outs[1][i]["refused"]
    assert checksums(http, engine.url) == want  # bit-exact, after the last push of each layout
    info = http(engine.url, "/model_info")[1]
    assert info["weight_version"] == "v12"
