"""The trainer's state offloaded between steps (colocated mode) and onloaded: the storages are
freed (size 0, every view intact), the bytes come back exactly, and training goes on to the
same losses and weights as a run that never offloaded."""

from __future__ import annotations

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.train.common import make_samples
from tests.train.test_trainer import checkpoint  # noqa: F401 (fixture)


def _snapshot(trainer):
    from megatron_tg.train.offload import KINDS, _tensors

    return {k: [t.detach().clone() for t in _tensors(trainer, k)] for k in KINDS}


def _train_fn(rank, world, overrides, samples, steps, offload):
    from megatron_tg.config import load_config
    from megatron_tg.train.offload import KINDS, TrainerOffload, _tensors
    from megatron_tg.train.trainer import Trainer

    trainer = Trainer(load_config("recipes/tiny_cpu.yaml", overrides))
    dp = trainer.ctx.dims.dp
    mine = samples[rank % dp::dp]
    box = TrainerOffload(trainer)
    losses, freed = [], []
    for _ in range(steps):
        losses.append(trainer.train_step(mine)["loss"])
        if not offload:
            continue
        before = _snapshot(trainer)
        # the colocated order: optimizer state and gradients after the step, parameters later
        n = box.offload(["grads", "optimizer"]) + box.offload(["params"])
        freed.append(n)
        assert box.device_bytes() == 0 and box.offloaded == set(KINDS)
        for kind in KINDS:
            assert box.saved[kind], kind  # every kind had storages of its own
            for t in _tensors(trainer, kind):
                assert t.untyped_storage().nbytes() == 0, kind  # freed, the view kept
        assert box.onload() == n and not box.offloaded
        after = _snapshot(trainer)
        for kind in ("params", "optimizer"):  # bit-exact
            assert all(torch.equal(a, b) for a, b in zip(before[kind], after[kind])), kind
        assert all(not t.any() for t in after["grads"])  # scratch: zeros
    weights = torch.cat([p.detach().reshape(-1) for p in trainer.gpt.parameters()])
    return losses, freed, weights


@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed_optimizer"])
def test_offload_onload_keeps_training_exact(checkpoint, tmp_path, distributed):  # noqa: F811
    d, tok, cfg, state = checkpoint
    samples = make_samples(tok, cfg, state)
    base = [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "objective.kl_coef=0.5", "optimizer.lr=1e-3",
            f"checkpoint.dir={tmp_path}/ckpt", f"logging.run_dir={tmp_path}/run",
            f"parallel.use_distributed_optimizer={str(distributed).lower()}"]
    world = 2 if distributed else 1  # DP 2: the optimizer state is sharded
    plain = run_distributed(_train_fn, world, base, samples, 3, False)
    moved = run_distributed(_train_fn, world, base, samples, 3, True)
    for rank in range(world):
        assert moved[rank][0] == plain[rank][0]  # the same losses, exactly
        assert torch.equal(moved[rank][2], plain[rank][2])  # and the same weights
        assert all(n > 0 for n in moved[rank][1])
    print(f"\nlosses {plain[0][0]}; bytes freed per offload, rank 0: {moved[0][1]}")
