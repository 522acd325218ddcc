"""Weight sync from a context-parallel trainer: the engine receives what CP 1 sends.

CP 2 (alone, and with EP 2, whose expert-parallel group is the CP pair: each CP rank holds
half of the experts) trains a step with megatron's distributed optimizer (fp32 masters
sharded over DP x CP, the weights all-gathered after the update) and checkpoints; CP 1
resumes that checkpoint. Each pushes its weights into one embedded engine through
``push_weights`` under SGLang's weight checker (checksum -> reset_tensors -> push ->
checksum: a tensor the push did not write fails), and rank 0 also records every HF tensor
``iter_hf_weights`` streams. The CP 2 and CP 1 pushes stream the same tensors bit for bit,
and the engine's per-tensor checksums after them are equal, and differ from the base
weights the engine started on (so the push moved them). Every CP rank holds bit-equal
dense weights (the replica the sender does not read cannot drift)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_tg.parallel.ports import free_port
from megatron_tg.testing.distributed import run_distributed
from tests.train.common import make_samples, tiny_policy

pytestmark = pytest.mark.usefixtures("comm_rules")

BUCKET = 64 << 10  # several buckets per push


def _push(rank, world, overrides, samples, resume, url, port):
    from megatron.core import parallel_state as mps

    from megatron_tg.config import load_config
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.train.trainer import Trainer
    from megatron_tg.weight_sync.sync import iter_hf_weights, push_weights, verify_coverage

    trainer = Trainer(load_config("recipes/tiny_cpu.yaml", overrides))
    if resume:
        assert trainer.resume() is not None and trainer.step == 1
    else:
        trainer.train_step(samples)
        trainer.save({})
        trainer.checkpointer.finalize(blocking=True)
    # Every CP rank's replica of the dense weights (CP splits tokens, not them; under EP 2
    # here the CP pair is the EP group, so the experts differ by design).
    cp_group = mps.get_context_parallel_group()
    mine = torch.cat([p.detach().reshape(-1) for n, p in trainer.gpt.named_parameters()
                      if ".experts." not in n])
    replicas = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(cp_group))]
    torch.distributed.all_gather(replicas, mine, group=cp_group)
    replicas_equal = all(torch.equal(r, mine) for r in replicas)
    streamed = {n: t.clone() for n, t in iter_hf_weights(trainer.model, trainer.arch, trainer.ctx)}

    def push(client=None, group=None):
        return push_weights(client, group, trainer.model, trainer.arch, trainer.ctx, version=1,
                            bucket_bytes=BUCKET)

    async def sync():
        if rank != 0:
            await push()  # the gathers, a second time for the coverage check's push
            await push()
            return None
        async with SGLangClient([url], timeout_s=60) as client:
            group = await client.init_weights_update_group("127.0.0.1", port, group_name=f"cp-{port}")
            try:
                await client.pause_generation(mode="retract")
                base = await client.weights_checker("checksum")
                await push(client, group)
                stats = []

                async def again():
                    stats.append(await push(client, group))

                await verify_coverage(client, group, again)  # raises naming an unwritten tensor
                after = await client.weights_checker("checksum")
                await client.continue_generation()
            finally:
                await client.destroy_weights_update_group(group)
        return dict(base=base[url], after=after[url], stats=stats[0].as_metrics())

    engine = asyncio.run(sync())
    return dict(streamed=streamed, engine=engine, replicas_equal=replicas_equal,
                cp=trainer.ctx.dims.cp, ep=trainer.ctx.dims.ep)


async def _pristine_checksums(url):
    from megatron_tg.rollout.client import SGLangClient

    async with SGLangClient([url], timeout_s=60) as client:
        await client.pause_generation(mode="retract")
        reply = await client.weights_checker("checksum")
        await client.continue_generation()
    return _checksums(reply[url])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_tg.rollout.engine.launch import start_engines
    from tests.models.qwen3_moe.common import tiny_hf_model

    tok, cfg, state = tiny_policy()
    d = tmp_path_factory.mktemp("policy")
    _cfg, model, _state = tiny_hf_model(vocab_size=len(tok))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    (engine,) = start_engines([d], tmp_path_factory.mktemp("engine_logs"), timeout_s=300)
    # The checkpoint's checksums, before any test pushes: a later layout's push starts from
    # the weights an earlier one wrote (the dense ones equal), so "moved" is judged from here.
    engine.pristine = asyncio.run(_pristine_checksums(engine.url))
    base = [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "objective.kl_coef=0.5", "optimizer.lr=1e-3",
            "optimizer.micro_batch_tokens=4096", "parallel.use_distributed_optimizer=true"]
    yield base, make_samples(tok, cfg, state), engine
    engine.stop()


def _checksums(reply) -> dict[str, str]:
    (rank,) = reply["ranks"]  # the embedded engine: one rank
    return rank["checksums"]


# (CP 2's extra overrides, CP 1's world and overrides). The distributed optimizer's checkpoint
# resumes at another DP size only, so CP 2 x EP 2 resumes at DP 2 x EP 2 (CP 1).
LAYOUTS = {"cp2": (["parallel.cp=2"], 1, []),
           "cp2-ep2": (["parallel.cp=2", "parallel.ep=2"], 2, ["parallel.ep=2"])}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_engine_receives_at_cp2_what_it_receives_at_cp1(setup, tmp_path, name):
    base, samples, engine = setup
    extra, world1, extra1 = LAYOUTS[name]
    common = base + [f"checkpoint.dir={tmp_path}/ckpt", f"logging.run_dir={tmp_path}/run"]
    cp2 = run_distributed(_push, 2, common + extra, samples, False, engine.url, free_port())
    cp1 = run_distributed(_push, world1, common + extra1, samples, True, engine.url, free_port())[0]
    assert [o["cp"] for o in cp2] == [2, 2] and cp1["cp"] == 1
    assert all(o["replicas_equal"] for o in cp2)
    sent2, sent1 = cp2[0]["streamed"], cp1["streamed"]
    assert sent2 and not any(o["streamed"] for o in cp2[1:])  # rank 0 alone sends
    assert list(sent2) == list(sent1)  # the same HF tensors, in the same order
    for n, t in sent1.items():
        assert sent2[n].dtype == t.dtype and torch.equal(sent2[n], t), n
    e2, e1 = cp2[0]["engine"], cp1["engine"]
    assert e2["stats"]["sync/tensors"] == e1["stats"]["sync/tensors"] == len(sent1)
    after2, after1 = _checksums(e2["after"]), _checksums(e1["after"])
    assert after2 == after1
    assert set(_checksums(e2["base"])) == set(engine.pristine) == set(after2)
    moved = [n for n in after2 if after2[n] != engine.pristine[n]]
    print(f"\n{name}: {len(sent1)} HF tensors streamed, bit-equal to CP 1's resume; "
          f"engine checksums equal on all {len(after2)} tensors ({len(moved)} moved from the base "
          f"by the step); {e2['stats']['sync/buckets']:.0f} buckets")
    assert len(moved) > len(after2) // 2
