"""Weight sync trainer -> engine at TP=2 x EP=2: afterwards the engine's log-probs for a fixed
sequence equal the trainer's own (megatron, vocab-parallel) log-probs.

The engine starts from *different* weights (another seed), so equality proves the sync.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_tg.rollout.engine.launch import free_port, start_engines
from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import tiny_hf_model


def _sync_fn(rank, world, state, hf_cfg, url, port, prompt):
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.ops import fused_vocab_parallel_logprob
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.train.policy import forward_hidden
    from megatron_tg.train.step import ops_reduce_hidden_grad
    from megatron_tg.train.weight_sync import push_weights

    ctx = init_parallel(tp=2, ep=2, etp=1)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=2, ep=2, etp=1)
    load_hf_weights(model, state, arch, current_layout(model=model))

    async def sync():
        if rank != 0:
            return await push_weights(None, None, model, arch, ctx, version=1, bucket_bytes=64 << 10)
        client = SGLangClient([url], timeout_s=60)
        group = await client.init_weights_update_group("127.0.0.1", port, group_name="tg-test")
        await client.pause_generation(mode="retract")
        stats = await push_weights(client, group, model, arch, ctx, version=1,
                                   bucket_bytes=64 << 10)
        await client.continue_generation()
        res = await client.generate(prompt, {"temperature": 0.0, "max_new_tokens": 8,
                                             "ignore_eos": True}, return_logprob=True)
        version = await client.get_weight_version()
        await client.destroy_weights_update_group(group)
        await client.close()
        return stats, res, version

    out = asyncio.run(sync())
    # Everyone needs the engine's output tokens to run the trainer's forward on them.
    box = [list(prompt) + list(out[1].output_ids) if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    seq = torch.tensor([box[0]])
    pad = (-seq.shape[1]) % 2
    tokens = torch.nn.functional.pad(seq, (0, pad))
    with torch.no_grad():
        h = forward_hidden(model, tokens, torch.arange(tokens.shape[1])[None], None)
        n = len(box[0])
        rows = h.hidden[0, len(prompt) - 1:n - 1]
        lp = fused_vocab_parallel_logprob(rows, h.output_weight, seq[0, len(prompt):n],
                                          ctx.group(Axis.TP), vocab_size=arch.vocab_size,
                                          reduce_hidden_grad=ops_reduce_hidden_grad(model))
    if rank != 0:
        return None
    stats, res, version = out
    return dict(trainer=lp, engine=torch.tensor(res.output_logprobs), version=version,
                stats=stats.as_metrics())


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # The engine serves seed-1 weights; the trainer holds seed-0 weights.
    d = tmp_path_factory.mktemp("engine_model")
    _, other, _ = tiny_hf_model(seed=1)
    other.save_pretrained(d)
    (e,) = start_engines([d], tmp_path_factory.mktemp("engine_logs"))
    yield e
    e.stop()


def test_sync_makes_engine_logprobs_equal_trainer(engine):
    cfg, model, state = tiny_hf_model(seed=0)
    prompt = [5, 17, 42, 7, 99, 3]
    out = run_distributed(_sync_fn, 4, state, cfg.to_dict(), engine.url, free_port(), prompt)[0]
    assert list(out["version"].values()) == ["1"]
    assert out["stats"]["sync/tensors"] == len(state)  # every HF tensor, once
    assert out["stats"]["sync/buckets"] > 1
    torch.testing.assert_close(out["engine"], out["trainer"], atol=1e-4, rtol=1e-4)
