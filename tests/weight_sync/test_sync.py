"""Weight sync trainer -> engine at TP=2 x EP=2: afterwards the engine's log-probs for a fixed
sequence equal the trainer's own (megatron, vocab-parallel) log-probs, and no rank held more
than one merged parameter plus one bucket at any time during the sync.

The engine starts from *different* weights (another seed), so equality proves the sync.
Peak memory is measured by following every tensor storage the sync creates (:class:`LiveBytes`).
"""

from __future__ import annotations

import asyncio
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tg.parallel.ports import free_port
from megatron_tg.rollout.engine.launch import start_engines
from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import tiny_hf_model

pytestmark = pytest.mark.usefixtures("comm_rules")


def _sync_fn(rank, world, state, hf_cfg, url, port, prompt):
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.ops import fused_vocab_parallel_logprob
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.train.policy import forward_hidden
    from megatron_tg.train.step import ops_reduce_hidden_grad
    from megatron_tg.weight_sync.sync import push_weights

    ctx = init_parallel(tp=2, ep=2, etp=1)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=2, ep=2, etp=1)
    load_hf_weights(model, state, arch, current_layout(model=model))

    async def sync():
        if rank != 0:
            return await push_weights(None, None, model, arch, ctx, version=1, bucket_bytes=BUCKET)
        client = SGLangClient([url], timeout_s=60)
        group = await client.init_weights_update_group("127.0.0.1", port, group_name="tg-test")
        await client.pause_generation(mode="retract")
        stats = await push_weights(client, group, model, arch, ctx, version=1, bucket_bytes=BUCKET)
        await client.continue_generation()
        res = await client.generate(prompt, {"temperature": 0.0, "max_new_tokens": 8,
                                             "ignore_eos": True}, return_logprob=True)
        version = await client.get_weight_version()
        await client.destroy_weights_update_group(group)
        await client.close()
        return stats, res, version

    largest = max(_merged_bytes(name, p, arch, model) for name, p in model.named_parameters())
    out, peak = peak_extra_bytes(lambda: asyncio.run(sync()), model)
    # Everyone needs the engine's output tokens to run the trainer's forward on them.
    box = [list(prompt) + list(out[1].output_ids) if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    seq = torch.tensor([box[0]])
    pad = (-seq.shape[1]) % 2
    tokens = torch.nn.functional.pad(seq, (0, pad))
    with torch.no_grad():
        h = forward_hidden(model, tokens)
        n = len(box[0])
        rows = h.hidden[0, len(prompt) - 1:n - 1]
        lp = fused_vocab_parallel_logprob(rows, h.output_weight, seq[0, len(prompt):n],
                                          ctx.group(Axis.TP), vocab_size=arch.vocab_size,
                                          reduce_hidden_grad=ops_reduce_hidden_grad(model))
    if rank != 0:
        return dict(peak=peak, largest=largest)
    stats, res, version = out
    return dict(trainer=lp, engine=torch.tensor(res.output_logprobs), version=version,
                stats=stats.as_metrics(), peak=peak, largest=largest)


BUCKET = 16 << 10
LAYERS = 8  # enough that the whole model is far larger than one parameter plus a bucket


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created while active and still referenced by a tensor.

    Every op's outputs are seen by the dispatcher; a storage counts from the first tensor
    on it until the last such tensor is garbage. Storages that existed before (the model's
    parameters, which ``detach`` views) are not extra. (torch's profiler cannot be used:
    it records frees on the calling thread only, and gloo's worker thread often drops a
    collective's last reference, so those tensors would look held forever.)"""

    def __init__(self, existing):
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, live tensors]
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr == 0 or ptr in self.existing:
            return
        entry = self.storages.get(ptr)
        if entry is None:
            entry = self.storages[ptr] = [st.nbytes(), 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.storages[ptr]
            self.live -= entry[0]


def peak_extra_bytes(fn, model):
    """(fn(), the most extra bytes the sync held at once)."""
    with LiveBytes(list(model.parameters()) + list(model.buffers())) as meter:
        out = fn()
    return out, meter.peak


def _merged_bytes(name, p, arch, model) -> int:
    """Bytes of one parameter merged over TP (expert-TP) and, for experts, gathered over EP."""
    from megatron_tg.models.qwen3_moe.mapping import current_layout, param_info

    layout = current_layout(model=model)
    if param_info(name, arch, layout).is_expert:
        return p.numel() * p.element_size() * layout.etp * layout.ep
    return p.numel() * p.element_size() * layout.tp


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # The engine serves seed-1 weights; the trainer holds seed-0 weights.
    d = tmp_path_factory.mktemp("engine_model")
    _, other, _ = tiny_hf_model(seed=1, num_hidden_layers=LAYERS)
    other.save_pretrained(d)
    (e,) = start_engines([d], tmp_path_factory.mktemp("engine_logs"))
    e.model_dir = d
    yield e
    e.stop()


def test_sync_makes_engine_logprobs_equal_trainer(engine):
    cfg, model, state = tiny_hf_model(seed=0, num_hidden_layers=LAYERS)
    prompt = [5, 17, 42, 7, 99, 3]
    outs = run_distributed(_sync_fn, 4, state, cfg.to_dict(), engine.url, free_port(), prompt)
    out = outs[0]
    assert list(out["version"].values()) == ["1"]
    assert out["stats"]["sync/tensors"] == len(state)  # every HF tensor, once
    assert out["stats"]["sync/buckets"] > 1
    # Streaming: one merged parameter in flight (its TP gather buffers, the merge, the HF
    # split: 3 copies at most) plus the one bucket on the sender, never the whole model.
    total = out["stats"]["sync/bytes"]
    for rank, r in enumerate(outs):
        bound = 3 * r["largest"] + (BUCKET if rank == 0 else 0)
        print(f"rank {rank}: peak extra {r['peak']} B during the sync; bound {bound} B; model {total} B")
        assert 0 < r["peak"] <= bound
    assert total > 2 * (3 * out["largest"] + BUCKET)  # so holding the whole model would fail
    torch.testing.assert_close(out["engine"], out["trainer"], atol=1e-4, rtol=1e-4)


def test_probe_and_coverage_check_name_the_engine_and_the_weight(engine):
    """The log-prob probe passes on the weights the engine loaded and stops, naming the
    engine, when one weight is off; the weight checker's checksum -> reset -> push ->
    checksum (no snapshot in host memory) names the weight a push with a misnamed tensor
    left unwritten, and only that one."""
    from safetensors.torch import load_file

    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.weight_sync.checks import SyncCheckError, compare_logprobs, engine_logprobs, probe_tokens
    from megatron_tg.weight_sync.sync import verify_coverage

    _, hf, _ = tiny_hf_model(seed=1, num_hidden_layers=LAYERS)
    state = load_file(str(engine.model_dir / "model.safetensors"))
    tokens = probe_tokens(hf.config.vocab_size, 32)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    trainer = lp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]

    async def main():
        async with SGLangClient([engine.url]) as client:
            await client.update_weights_from_disk(str(engine.model_dir))  # the seed-1 weights again
            group = await client.init_weights_update_group("127.0.0.1", free_port(), group_name="probe")

            def push(named):
                async def go():
                    await client.begin_weight_update(group)
                    await client.update_weights_from_distributed(group, named)
                    await client.end_weight_update(group)
                return go

            try:
                diff = compare_logprobs(engine.url, await engine_logprobs(client, engine.url, tokens), trainer,
                                        0.1, version=1)
                bad = dict(state, **{"model.norm.weight": state["model.norm.weight"] * 3})
                await push(list(bad.items()))()
                with pytest.raises(SyncCheckError, match=f"engine {engine.url} does not serve") as bad_diff:
                    compare_logprobs(engine.url, await engine_logprobs(client, engine.url, tokens), trainer,
                                     0.1, version=2)
                print(bad_diff.value)
                await push(list(state.items()))()
                typo = [(n + "_" if n == "model.norm.weight" else n, t) for n, t in state.items()]
                with pytest.raises(SyncCheckError, match=r"1 tensor\(s\), e.g. tp0:model.norm.weight$"):
                    await verify_coverage(client, group, push(typo))
                await push(list(state.items()))()
                await verify_coverage(client, group, push(list(state.items())))  # all names right: passes
            finally:
                await client.destroy_weights_update_group(group)
            return diff

    diff = asyncio.run(main())
    print(f"probe: mean |engine - HF| log-prob over {len(tokens) - 1} positions = {diff:.3g}")
    assert diff < 1e-4


def _stages_fn(rank, world, layouts, state, hf_cfg, tokens):
    """Per layout: every HF tensor the sync streams (rank 0, the sender) and the trainer's
    probe log-probs (every rank)."""
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.weight_sync.checks import trainer_logprobs
    from megatron_tg.weight_sync.sync import iter_hf_weights

    out = []
    for tp, ep, etp, pp in layouts:
        ctx = init_parallel(tp=tp, ep=ep, etp=etp, pp=pp)
        arch = Qwen3Arch.from_hf(hf_cfg)
        model = build_model(arch, tp=tp, ep=ep, etp=etp, pp=pp)
        load_hf_weights(model, state, arch, current_layout(model=model))
        names, streamed = [], {}
        for name, t in iter_hf_weights(model, arch, ctx):
            names.append(name)
            streamed[name] = t.clone()
        # everywhere=True (the colocated push): every rank gets every tensor, in one order
        everywhere = [(name, t.clone()) for name, t in iter_hf_weights(model, arch, ctx, everywhere=True)]
        out.append(dict(names=names, streamed=streamed, everywhere=everywhere,
                        logprobs=trainer_logprobs(model, arch, ctx, tokens)))
    return out


@pytest.mark.parametrize("world,layouts", [(2, [(1, 1, 1, 2)]), (4, [(2, 1, 2, 2), (1, 2, 1, 2)])],
                         ids=["pp2", "tp2xpp2+pp2xep2"])
def test_every_stage_reaches_the_sender(world, layouts):
    """Under PP each stage's tensors reach global rank 0 (relayed over the PP group), merged
    over TP and EP: rank 0 streams every HF tensor exactly once, equal to the checkpoint's
    (and with ``everywhere=True`` every rank does, in the same order);
    the probe log-probs (a forward-only schedule, computed on the last stage) equal PP=1's."""
    from megatron_tg.weight_sync.checks import probe_tokens

    cfg, _, state = tiny_hf_model(seed=0, num_hidden_layers=4)
    tokens = probe_tokens(cfg.vocab_size, 21)  # odd length: padded for TP=2
    ref = run_distributed(_stages_fn, 1, [(1, 1, 1, 1)], state, cfg.to_dict(), tokens)[0][0]
    outs = run_distributed(_stages_fn, world, layouts, state, cfg.to_dict(), tokens)
    for i, layout in enumerate(layouts):
        sender = outs[0][i]
        assert sorted(sender["names"]) == sorted(state) and len(sender["names"]) == len(state)
        for name, t in state.items():
            assert torch.equal(sender["streamed"][name], t), (layout, name)
        assert all(not o[i]["names"] for o in outs[1:])  # only the sender yields tensors
        for rank, o in enumerate(outs):  # everywhere: each rank the same sequence, equal to the checkpoint's
            assert [n for n, _ in o[i]["everywhere"]] == [n for n, _ in outs[0][i]["everywhere"]], (layout, rank)
            assert sorted(n for n, _ in o[i]["everywhere"]) == sorted(state)
            for name, t in o[i]["everywhere"]:
                assert torch.equal(t, state[name]), (layout, rank, name)
        for o in outs:
            torch.testing.assert_close(o[i]["logprobs"], ref["logprobs"], atol=1e-5, rtol=1e-5)
        print(f"{layout}: max |probe log-prob diff| vs PP1 "
              f"{max(float((o[i]['logprobs'] - ref['logprobs']).abs().max()) for o in outs):.3g}")


def _push_fn(rank, world, layouts, state, hf_cfg, urls, ports):
    """Per layout: snapshot every engine's weights (the checkpoint's, loaded from disk), reset
    them to random values, push the trainer's (the same checkpoint) and compare: SGLang's
    weight checker on each engine names every tensor that is not bit-equal to the snapshot."""
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.weight_sync.sync import push_weights, verify_coverage

    out = []
    for (tp, ep, etp, pp), port in zip(layouts, ports):
        ctx = init_parallel(tp=tp, ep=ep, etp=etp, pp=pp)
        arch = Qwen3Arch.from_hf(hf_cfg)
        model = build_model(arch, tp=tp, ep=ep, etp=etp, pp=pp)
        load_hf_weights(model, state, arch, current_layout(model=model))
        largest = max(_merged_bytes(name, p, arch, model) for name, p in model.named_parameters())

        async def sync():
            if rank != 0:
                return await push_weights(None, None, model, arch, ctx, version=3, bucket_bytes=BUCKET)
            stats = []
            async with SGLangClient(urls, timeout_s=60) as client:
                group = await client.init_weights_update_group("127.0.0.1", port,
                                                               group_name=f"pp-sync-{port}")
                try:
                    await client.pause_generation(mode="retract")

                    async def push():
                        stats.append(await push_weights(client, group, model, arch, ctx, version=3,
                                                        bucket_bytes=BUCKET))

                    await verify_coverage(client, group, push)  # raises naming a wrong tensor
                    await client.continue_generation()
                    versions = await client.get_weight_version()
                finally:
                    await client.destroy_weights_update_group(group)
            return stats[0], versions

        res, peak = peak_extra_bytes(lambda: asyncio.run(sync()), model)
        out.append(dict(peak=peak, largest=largest, **(
            dict(stats=res[0].as_metrics(), versions=res[1]) if rank == 0 else {})))
    return out


@pytest.fixture(scope="module")
def checkpoint_engines(tmp_path_factory):
    """Two engine GPUs (one engine each) serving the checkpoint the trainer loads."""
    d = tmp_path_factory.mktemp("pp_engine_model")
    _, hf, _ = tiny_hf_model(seed=0, num_hidden_layers=4)
    hf.save_pretrained(d)
    engines = start_engines([d, d], tmp_path_factory.mktemp("pp_engine_logs"), timeout_s=300)
    yield engines
    for e in engines:
        e.stop()


@pytest.mark.parametrize("world,layouts", [(2, [(1, 1, 1, 2)]), (4, [(2, 1, 2, 2), (1, 2, 1, 2)])],
                         ids=["pp2", "tp2xpp2+pp2xep2"])
def test_pipeline_sync_is_bit_exact_on_every_engine(checkpoint_engines, world, layouts):
    """Weight sync at PP 2, TP 2 x PP 2 and PP 2 x EP 2 into two engines: every engine's every
    weight is bit-equal to the checkpoint afterwards, every HF tensor went once, and no rank
    held more than one merged parameter (3 copies: gathers, merge, split) plus, on the sender,
    one bucket. Under NCCL's rules the relay of the later stage must use device buffers."""
    cfg, _, state = tiny_hf_model(seed=0, num_hidden_layers=4)
    urls = [e.url for e in checkpoint_engines]
    outs = run_distributed(_push_fn, world, layouts, state, cfg.to_dict(), urls,
                           [free_port() for _ in layouts])
    for i, layout in enumerate(layouts):
        sender = outs[0][i]
        assert list(sender["versions"].values()) == ["3", "3"], sender["versions"]
        assert sender["stats"]["sync/tensors"] == len(state)
        assert sender["stats"]["sync/bytes"] == sum(t.numel() * t.element_size() for t in state.values())
        for rank, o in enumerate(outs):
            r = o[i]
            bound = 3 * r["largest"] + (BUCKET if rank == 0 else 0)
            print(f"{layout} rank {rank}: peak extra {r['peak']} B; bound {bound} B")
            assert 0 < r["peak"] <= bound, (layout, rank)


def _push_tensor_fn(rank, world, state, hf_cfg, urls):
    """Colocated's way (weight_sync/colocated.py: Colocated.sync): every rank takes part in the
    HF gathers, rank 0 sends each engine its tensors with /update_weights_from_tensor; checked
    by the weight checker as the distributed sync is."""
    from types import SimpleNamespace

    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.weight_sync.sync import iter_hf_weights, verify_coverage

    ctx = init_parallel(tp=2, ep=2, etp=1)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=2, ep=2, etp=1)
    load_hf_weights(model, state, arch, current_layout(model=model))
    if rank != 0:  # the gathers only: once per engine (verify_coverage pushes once)
        for _ in range(len(urls)):
            for _ in iter_hf_weights(model, arch, ctx):
                pass
        return None
    sent: list[tuple[str, list[int]]] = []

    async def sync():
        async with SGLangClient(urls, timeout_s=60) as client:
            await client.pause_generation(mode="retract")

            async def push():
                for url in urls:
                    def named():
                        for name, t in iter_hf_weights(model, arch, ctx):
                            sent.append((name, list(t.shape)))
                            yield name, t
                    await client.send_weights_from_tensor(url, named(), bucket_bytes=1 << 20, weight_version="5")

            await verify_coverage(client, SimpleNamespace(servers=urls), push)  # raises naming a wrong tensor
            await client.continue_generation()
            return await client.get_weight_version()

    versions = asyncio.run(sync())
    return dict(versions=versions, sent=sent)


def test_update_from_tensor_at_tp2_ep2_is_bit_exact_on_every_engine(checkpoint_engines):
    """The colocated path at TP 2 x EP 2 into two engines: the tensors rank 0 serialises carry
    exactly the checkpoint's HF names and shapes (the names SGLang's Qwen3-MoE loader maps: it
    loads HF checkpoints), each once per engine, and every engine weight is bit-equal
    to the checkpoint afterwards (the weight checker compares each against its snapshot)."""
    cfg, _, state = tiny_hf_model(seed=0, num_hidden_layers=4)
    urls = [e.url for e in checkpoint_engines]
    outs = run_distributed(_push_tensor_fn, 4, state, cfg.to_dict(), urls)
    sender = outs[0]
    assert list(sender["versions"].values()) == ["5", "5"], sender["versions"]
    assert len(sender["sent"]) == len(urls) * len(state)  # checksum -> reset -> send -> checksum
    assert sorted(set(map(tuple, [(n, tuple(s)) for n, s in sender["sent"]]))) == \
        sorted((n, tuple(t.shape)) for n, t in state.items())
