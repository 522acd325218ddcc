"""Engine loss and return around weight syncs, with embedded engines on gloo ranks.

Two trainer ranks (data parallel) sync a tiny Qwen3-MoE into two embedded engines that start
on other weights. Then: engine B is killed between syncs (the next sync re-forms the group
with A alone and A serves the new version); B is restarted on its base weights (after the
next sync it is brought to the current weights alone, checked, and rejoins); engine A is
killed in the middle of a sync, between two buckets (the sync re-forms the group with B and
pushes again, so B serves every tensor of that version). After each sync every live engine's
log-probs of a probe sequence equal the trainer's (the sync's own probe, and an independent
check at the end), and its weight version is the trainer's step. Both ranks run the same
number of pushes (a mismatch would hang their collectives; the run has a 120 s limit).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from megatron_tg.rollout.engine.launch import restart_engine, start_engines
from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import tiny_hf_model

LAYERS = 2


class _Side:
    """The sync half of rank 0's rollout side: one event loop, the client, the target;
    ``run_sync`` pauses generation around the push as the manager does."""

    def __init__(self, urls):
        from megatron_tg.rollout.client import SGLangClient

        self.loop = asyncio.new_event_loop()
        self.client = SGLangClient(urls, timeout_s=30, admin_timeout_s=60, probe_interval_s=0.2)
        self.target = None

    def call(self, coro):
        return self.loop.run_until_complete(coro)

    def weight_target(self):
        from megatron_tg.sampling.protocols import WeightTarget

        if self.target is None:
            group = self.call(self.client.init_weights_update_group("127.0.0.1", _port(), "tg-weights"))
            self.target = WeightTarget(self.client, group)
        return self.target

    def run_sync(self, push, version, *, restart=False):
        async def run():
            await self.client.pause_generation(mode="retract")
            try:
                return await push()
            finally:
                await self.client.continue_generation()
        return self.call(run())


def _port():
    from megatron_tg.parallel.ports import free_port

    return free_port()


def _loss_fn(rank, world, state, hf_cfg, engine_dir, log_dir, pp=1):
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel

    ctx = init_parallel(tp=1, pp=pp)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=1, pp=pp)
    load_hf_weights(model, state, arch, current_layout(model=model))
    engines = start_engines([engine_dir, engine_dir], log_dir) if rank == 0 else []
    box = [[e.url for e in engines]]
    torch.distributed.broadcast_object_list(box, src=0)
    a, b = box[0]
    try:
        return (_scenario if pp == 1 else _admitted_at_pp)(rank, model, arch, ctx, engines, a, b)
    finally:
        for e in engines:
            e.stop()


def _scenario(rank, model, arch, ctx, engines, a, b):
    from megatron_tg.weight_sync.checks import (SyncChecks, compare_logprobs, engine_logprobs, probe_tokens,
                                                trainer_logprobs)
    from megatron_tg.weight_sync.sync import sync_to_engines

    # bucket 0 MiB: every tensor is its own broadcast, so "between two buckets" is everywhere
    cfg = SimpleNamespace(rollout=SimpleNamespace(sync_bucket_mb=0, pause_mode="retract"))
    trainer = SimpleNamespace(model=model, arch=arch, ctx=ctx, cfg=cfg, step=0)
    checks = SyncChecks(verify_coverage=True, probe_interval=1, probe_tol=1e-3, probe_tokens=16)
    side = _Side([a, b]) if rank == 0 else None
    log = []

    def step(what):
        trainer.step += 1
        g = torch.Generator().manual_seed(trainer.step)  # the same update on both DP replicas
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        m = sync_to_engines(trainer, side, checks)
        versions = side.call(side.client.get_weight_version()) if side else None
        log.append((what, trainer.step, m.get("sync/engines"), m["sync/engines_lost"],
                    m["sync/engines_admitted"], versions, m.get("sync/probe_logprob_diff")))

    step("both")
    if rank == 0:
        engines[1].kill()
    step("b dead")
    if rank == 0:
        engines[1] = restart_engine(engines[1])  # on its base weights again
    step("b back")
    if rank == 0:  # A dies after the fifth tensor of the next sync
        real, calls = side.client.update_weights_from_distributed, [0]

        async def dying(group, what, **kw):
            out = await real(group, what, **kw)
            calls[0] += 1
            if calls[0] == 5:
                engines[0].kill()
            return out
        side.client.update_weights_from_distributed = dying
    step("a dies mid-sync")
    # independent check: the engine left serves the trainer's weights at the trainer's step
    tokens = probe_tokens(arch.vocab_size, 24)
    mine = trainer_logprobs(model, arch, ctx, tokens)
    if rank != 0:
        return log, None
    diff = compare_logprobs(b, side.call(engine_logprobs(side.client, b, tokens)), mine, 1e-3, trainer.step)
    side.call(side.client.destroy_weights_update_group(side.target.group))
    side.call(side.client.close())
    return log, diff


@pytest.fixture()
def engine_dir(tmp_path):
    d = tmp_path / "engine_model"
    _, other, _ = tiny_hf_model(seed=1, num_hidden_layers=LAYERS)  # the trainer's are seed 0
    other.save_pretrained(d)
    return d


def test_lost_engine_leaves_the_group_and_a_returned_one_rejoins_at_the_current_weights(engine_dir, tmp_path):
    cfg, _, state = tiny_hf_model(seed=0, num_hidden_layers=LAYERS)
    (log0, diff), (log1, _) = run_distributed(_loss_fn, 2, state, cfg.to_dict(), engine_dir,
                                              tmp_path / "logs", timeout=300, pg_timeout_s=120)
    rows = {what: row for what, *row in log0}
    for what, row in rows.items():
        print(what, row)
    assert rows["both"][1:4] == [2.0, 0.0, 0.0] and set(rows["both"][4].values()) == {"1"}
    assert rows["b dead"][1:4] == [1.0, 1.0, 0.0] and list(rows["b dead"][4].values()) == ["2"]
    assert rows["b back"][1:4] == [2.0, 0.0, 1.0] and set(rows["b back"][4].values()) == {"3"}
    assert len(rows["b back"][4]) == 2
    assert rows["a dies mid-sync"][1:4] == [1.0, 1.0, 0.0]
    assert list(rows["a dies mid-sync"][4].values()) == ["4"]
    assert all(row[5] is not None and row[5] <= 1e-3 for row in rows.values())  # probes passed
    assert diff <= 1e-3
    # rank 1 saw the same outcome of every sync (it runs the same pushes, collectively)
    assert [r[:2] + r[3:5] for r in log1] == [r[:2] + r[3:5] for r in log0]


def _admitted_at_pp(rank, model, arch, ctx, engines, a, b):
    """B lost, restarted, admitted, with the trainer in pipeline stages: B must serve the
    admission's log-prob probe (a /generate to it) before it gets the version and joins."""
    from megatron_tg.weight_sync.sync import SyncChecks, sync_to_engines

    cfg = SimpleNamespace(rollout=SimpleNamespace(sync_bucket_mb=0, pause_mode="retract"))
    trainer = SimpleNamespace(model=model, arch=arch, ctx=ctx, cfg=cfg, step=0)
    checks = SyncChecks(verify_coverage=False, probe_interval=1, probe_tol=1e-3, probe_tokens=16)
    side = _Side([a, b]) if rank == 0 else None
    out = []
    for what in ("both", "b dead", "b back"):
        if rank == 0 and what == "b dead":
            engines[1].kill()
        if rank == 0 and what == "b back":
            engines[1] = restart_engine(engines[1])
            real, calls = side.client._call, []

            async def recording(url, method, path, body=None, timeout_s=None):  # the real call, noted
                calls.append((url, path))
                return await real(url, method, path, body, timeout_s)
            side.client._call = recording
        trainer.step += 1
        m = sync_to_engines(trainer, side, checks)
        out.append((what, m.get("sync/engines"), m["sync/engines_lost"], m["sync/engines_admitted"]))
    if rank != 0:
        return out, None
    # what B was sent between its return and its joining the group (the version comes last)
    until = calls.index((b, "/update_weight_version"))
    probes = sum(1 for url, path in calls[:until] if (url, path) == (b, "/generate"))
    version = side.call(side.client.get_weight_version())[b]
    side.call(side.client.destroy_weights_update_group(side.target.group))
    side.call(side.client.close())
    return out, (probes, version)


def test_a_returned_engine_is_probed_before_it_joins_at_pp2(engine_dir, tmp_path):
    cfg, _, state = tiny_hf_model(seed=0, num_hidden_layers=LAYERS)
    (rows, (probes, version)), (rows1, _) = run_distributed(
        _loss_fn, 2, state, cfg.to_dict(), engine_dir, tmp_path / "logs", 2, timeout=300, pg_timeout_s=120)
    assert rows == [("both", 2.0, 0.0, 0.0), ("b dead", 1.0, 1.0, 0.0), ("b back", 2.0, 0.0, 1.0)]
    # the other stage ran the same pushes and the same probe (it holds no group: no engine count)
    assert [(w, lost, adm) for w, _, lost, adm in rows1] == [(w, lost, adm) for w, _, lost, adm in rows]
    assert probes == 1, "B joined without serving the admission probe"
    assert version == "3"
