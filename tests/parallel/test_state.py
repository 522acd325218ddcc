"""Parallel set-up: launcher env parsing, megatron groups per named axis, the CPU RNG tracker."""

import torch

from megatron_tg.parallel.state import LaunchEnv
from megatron_tg.testing.distributed import run_distributed


def test_launch_env_torchrun_slurm_and_plain():
    t = LaunchEnv.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                            "MASTER_ADDR": "node1", "MASTER_PORT": "6000"})
    assert (t.rank, t.world_size, t.local_rank, t.master_addr, t.master_port) == (
        3, 8, 1, "node1", 6000)
    s = LaunchEnv.from_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5"})
    assert (s.rank, s.world_size, s.local_rank) == (5, 16, 5)
    p = LaunchEnv.from_env({})
    assert (p.rank, p.world_size) == (0, 1)


def _groups_fn(rank, world):
    from megatron.core import tensor_parallel

    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel

    ctx = init_parallel(tp=2, ep=2, etp=1, seed=11)
    sizes = {a.value: torch.distributed.get_world_size(ctx.group(a)) for a in Axis}
    ranks = {a.value: ctx.rank_in(a) for a in (Axis.TP, Axis.DP, Axis.EP)}
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():  # the model-parallel stream: differs across TP ranks
        tp_draw = torch.rand(4)
    default_draw = torch.rand(4)  # the default stream: same on every rank (same seed)
    return sizes, ranks, tp_draw, default_draw


def test_groups_and_rng_streams_on_four_ranks():
    out = run_distributed(_groups_fn, 4)
    for sizes, _, _, _ in out:
        assert sizes == {"tp": 2, "cp": 1, "ep": 2, "pp": 1, "dp": 2, "etp": 1, "edp": 2}
    # megatron's order: TP fastest. Ranks 0,1 form a TP group; 0,2 a DP group.
    assert [o[1]["tp"] for o in out] == [0, 1, 0, 1]
    assert [o[1]["dp"] for o in out] == [0, 0, 1, 1]
    assert not torch.equal(out[0][2], out[1][2])      # TP ranks draw different dropout
    assert torch.equal(out[0][2], out[2][2])          # DP replicas draw the same
    assert all(torch.equal(out[0][3], o[3]) for o in out)
