"""The trainer's side of the weight-update group hosts its store whatever launched it.

torchrun sets ``TORCHELASTIC_USE_AGENT_STORE=True`` in every worker, and torch's ``tcp://``
rendezvous then starts no store on rank 0 (it expects the elastic agent's). The engines are
not torchrun workers, so with that rendezvous both sides waited as store clients until the
timeout. The member below joins exactly as SGLang's ``init_custom_process_group`` does
(``rendezvous("tcp://…")``, ``PrefixStore(group_name)``, torch's group constructor), in a
process without torchrun's environment.
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch

from megatron_tg.rollout.transport import init_weight_update_group
from megatron_tg.testing.distributed import free_port

GROUP = "tg-weights-store"


def _member(port: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=60)
    store, rank, world = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend("gloo"),
                                           dist.PrefixStore(GROUP, store), group_name=GROUP,
                                           backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    t = torch.zeros(4)
    dist.broadcast(t, src=0, group=pg)
    out.put(t.tolist())


@pytest.mark.parametrize("agent_store", ["unset", "True"])
def test_trainer_side_hosts_the_store_even_under_torchrun(monkeypatch, agent_store):
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_member, args=(port, out), daemon=True)
    proc.start()  # the member starts without torchrun's environment
    if agent_store == "True":
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    try:
        group = init_weight_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=60)
        group.broadcast(torch.arange(4, dtype=torch.float32))
        assert out.get(timeout=60) == [0.0, 1.0, 2.0, 3.0]
        group.close()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
