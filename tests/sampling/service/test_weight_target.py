"""With ``rollout.service=local`` the weight target lives with the trainer for the whole run,
as in process: the group engine loss re-forms is the one the next sync pushes into, group
names are never reused (within a run, nor by another trainer process at the same engines),
and the group carries ``timeouts.weight_sync_s``. Two embedded engines, a real service."""

from __future__ import annotations

import asyncio

from safetensors.torch import load_file

from megatron_tg.config import load_config
from megatron_tg.rollout.engine.launch import start_engines
from megatron_tg.sampling.service.client import start_local_service
from megatron_tg.sampling.service.server import FactorySpec
from megatron_tg.weight_sync.engine_loss import drop_engines
from tests.rollout.conftest import build_tiny_model


def _cfg(urls, run_dir):
    return load_config("recipes/tiny_cpu.yaml", [
        "rollout.engine=sglang", f"rollout.server_urls=[{','.join(urls)}]", f"logging.run_dir={run_dir}",
        "rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.buffer_size=2",
        "rollout.max_staleness=0", "rollout.service=local", "rollout.service_poll_s=1",
        "rollout.routing_replay=false", "rollout.sync_master_address=127.0.0.1", "timeouts.weight_sync_s=77"])


def test_the_regrouped_target_is_the_one_the_next_sync_uses(tmp_path):
    model = build_tiny_model(tmp_path / "model", seed=0)
    norm = [("model.norm.weight", load_file(str(model / "model.safetensors"))["model.norm.weight"] * 2)]
    engines = start_engines([model, model], tmp_path / "engines", timeout_s=300)
    a, b = (e.url for e in engines)
    spec = FactorySpec("tests.sampling.service.fake_side:make", {})
    clients = []
    try:
        first = start_local_service(_cfg([a, b], tmp_path / "run1"), spec)
        clients.append(first)
        target = first.weight_target()
        assert first.weight_target() is target  # one target for the run
        assert target.group.servers == [a, b] and target.group.timeout_s == 77
        names = [target.group.group_name]
        engines[1].kill()
        first.call(drop_engines(target, [b]))  # what a sync does on finding b lost
        again = first.weight_target()
        assert again is target and again.group.servers == [a]
        names.append(again.group.group_name)

        async def push(group):  # into the group the sync would use now
            c = first.client
            await c.begin_weight_update(group)
            await c.update_weights_from_distributed(group, norm)
            await c.end_weight_update(group)
            return await c.request(a, "POST", "/get_weights_by_name", {"name": "model.norm.weight",
                                                                      "truncate_size": 4})

        got = first.call(push(first.weight_target().group))
        assert got == norm[0][1][:4].tolist()  # a took the tensors of the re-formed group
        # another trainer process at the same engine (a requeued job) picks names of its own
        second = start_local_service(_cfg([a], tmp_path / "run2"), spec)
        clients.append(second)
        names.append(second.weight_target().group.group_name)
        assert len(set(names)) == 3 and target.run_id in names[0] and target.run_id in names[1]
        assert second.weight_target().run_id not in names[1]
    finally:
        for c in clients:
            c.close()
        for e in engines:
            e.stop()
