"""Checkpoint/resume of model + CPU AdamW + RNG through megatron distributed checkpoints.

A run of 3 optimizer steps at TP=2 saves after step 2; a fresh model with different
weights, restored from that checkpoint, reproduces step 3's loss exactly. The same
checkpoint loads at TP=1 (megatron reshards) and gives step 3's loss to float tolerance.
A half-written save never becomes ``latest``. The save's helper process outlives the
SIGUSR1/SIGTERM that Slurm sends to every process of the trainer's step.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.testing.distributed import run_distributed
from megatron_tg.train.checkpoint import Checkpointer
from tests.train.common import make_samples, tiny_policy

# Every test here under NCCL's rules (tests/conftest.py: comm_rules; plain gloo on request).
pytestmark = pytest.mark.usefixtures("comm_rules")


def _train_fn(rank, world, tp, state, hf_cfg, samples, tok_dir, ckpt_root, mode, seed):
    """mode 'fresh': 3 steps, save after step 2 ('fresh_async': the save is written in the
    background while step 3 trains). mode 'resume': load, 1 step.
    Returns the losses of the steps run (async: and whether ``latest`` existed during step 3)."""
    from transformers import AutoTokenizer

    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)

    from megatron_tg.config.train import OptimizerConfig
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.objectives import TGObjective
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.batching import build_micro_batch
    from megatron_tg.train.optim import build_optimizer
    from megatron_tg.train.step import ops_reduce_hidden_grad, run_step

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ctx = init_parallel(tp=tp, seed=seed)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=tp)
    if mode.startswith("fresh"):
        load_hf_weights(model, state, arch, current_layout())
    ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), module=model)
    opt = build_optimizer(ddp, OptimizerConfig(lr=1e-3, grad_clip=1.0))
    obj_cfg = ObjectiveConfig(mode="tg", kl_coef=0.5)
    objective = TGObjective(obj_cfg, group=ctx.group(Axis.TP),
                            reduce_hidden_grad=ops_reduce_hidden_grad(ddp))
    ckpt = Checkpointer(ckpt_root, keep_last=2, async_save=mode == "fresh_async")
    first = 0
    if mode == "resume":
        trainer_state = ckpt.load(ckpt.latest(), ddp, opt)
        first = trainer_state["step"]
    losses = []
    row = 2 * max(len(s.rollout.token_ids) for s in samples)
    for step in range(first, 3):
        # A random perturbation of the advantages exercises the restored RNG stream.
        noise = torch.randn(len(samples))
        batch = [s.__class__(s.rollout, s.advantage + 0.1 * float(n), s.feedback_by_turn)
                 for s, n in zip(samples, noise)]
        mb = build_micro_batch(batch, tok, obj_cfg, row_tokens=row, pad_multiple=tp)
        opt.zero_grad()
        out, = run_step(ddp, objective, [mb], vocab_size=arch.vocab_size)
        finalize_model_grads([ddp])
        opt.step()
        losses.append(out.loss.detach())
        if mode.startswith("fresh") and step + 1 == 2:
            ckpt.save(2, ddp, opt, {"note": "after step 2"})
    if mode == "fresh_async":  # step 3 changed the weights while the writer wrote step 2's
        early = os.path.exists(os.path.join(ckpt_root, "latest"))
        assert ckpt.finalize(blocking=True) == [2]
        return losses, early
    return losses


@pytest.fixture(scope="module")
def setup():
    tok, cfg, state = tiny_policy()
    return tok, cfg, state, make_samples(tok, cfg, state)


def test_resume_reproduces_the_next_step(setup, tmp_path):
    tok, cfg, state, samples = setup
    root = tmp_path / "ckpt"
    fresh = run_distributed(_train_fn, 2, 2, state, cfg, samples, tok.name_or_path, str(root),
                            "fresh", 5)
    assert (root / "latest").read_text().strip() == "step_00000002"
    resumed = run_distributed(_train_fn, 2, 2, state, cfg, samples, tok.name_or_path, str(root),
                              "resume", 99)  # a different seed: the RNG must come from the ckpt
    assert len(resumed[0]) == 1
    assert torch.equal(resumed[0][0], fresh[0][2]), (resumed[0][0], fresh[0][2])
    # Resharded to TP=1: megatron reassembles the shards; the RNG file of rank 0 still applies.
    tp1 = run_distributed(_train_fn, 1, 1, state, cfg, samples, tok.name_or_path, str(root),
                          "resume", 99)
    torch.testing.assert_close(tp1[0][0], fresh[0][2], atol=1e-5, rtol=1e-4)


def test_async_save_writes_the_saved_step_while_training_goes_on(setup, tmp_path):
    tok, cfg, state, samples = setup
    root = tmp_path / "ckpt"
    fresh = run_distributed(_train_fn, 2, 2, state, cfg, samples, tok.name_or_path, str(root),
                            "fresh_async", 5)
    assert [early for _, early in fresh] == [False, False]  # not latest before every rank finished
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not list(root.glob(".tmp-*"))
    resumed = run_distributed(_train_fn, 2, 2, state, cfg, samples, tok.name_or_path, str(root),
                              "resume", 99)
    # step 3 from the checkpoint equals step 3 of the run that kept training during the write:
    # the writer wrote the weights of step 2, not those step 3 changed under it
    assert torch.equal(resumed[0][0], fresh[0][0][2]), (resumed[0][0], fresh[0][0][2])


def test_partial_save_never_becomes_latest(tmp_path):
    root = tmp_path / "ckpt"
    done = root / "step_00000001"
    done.mkdir(parents=True)
    (done / "COMPLETE").write_text("1\n")
    (root / "latest").write_text("step_00000001\n")
    (root / ".tmp-step_00000002" / "dist").mkdir(parents=True)  # a save killed midway
    assert Checkpointer(root).latest() == done
    (root / "latest").write_text("step_00000002\n")
    with pytest.raises(RuntimeError, match="incomplete or missing"):
        Checkpointer(root).latest()


def test_writer_queue_helper_survives_slurm_stop_signals(monkeypatch):
    """megatron's torch_dist writer keeps a spawned manager process (its results queue) across
    saves; Slurm's step signals reach it too. Killed, the checkpoint the signal asked for fails."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_tg.train import checkpoint

    if not hasattr(filesystem_async, "_results_queue"):
        pytest.skip("this megatron-core keeps no writer results queue")
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    monkeypatch.setattr(checkpoint, "_WRITER_MANAGERS", [])
    checkpoint._signal_proof_writer_queue()
    (manager,) = checkpoint._WRITER_MANAGERS
    try:
        queue = filesystem_async._results_queue  # megatron's getter returns it from now on
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            os.kill(manager._process.pid, sig)
        time.sleep(0.5)
        queue.put("still serving")
        assert queue.get(timeout=10) == "still serving"
        assert manager._process.is_alive()
    finally:
        manager.shutdown()
