"""The trainer at pipeline size 2: one step equals PP=1 on the same samples (loss, gradients,
per-turn records, updated weights), and checkpoints move between PP=2 and PP=1 both ways
(policy, EMA expert and optimizer state: the step after a resume is the step without one).

At PP=1 the shared expert reuses the student's prefix keys/values; at PP=2 the trainer turns
that off and the expert pass runs over whole expert sequences: the comparison also checks
that both give the same loss and gradients (float32 rounding apart).
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import tiny_hf_model
from tests.train.common import make_samples

# Every test here under NCCL's rules (tests/conftest.py: comm_rules; plain gloo on request).
pytestmark = pytest.mark.usefixtures("comm_rules")


def _named(trainer, tensors):
    """HF name -> tensor for this rank's parameters (TP = EP = 1: whole tensors)."""
    from megatron_tg.models.qwen3_moe.mapping import current_layout, to_hf

    layout = current_layout(model=trainer.gpt)
    return {hf: t for (name, _), v in zip(trainer.gpt.named_parameters(), tensors)
            for hf, t in to_hf(name, v.detach().clone(), trainer.arch, layout)}


def _fn(rank, world, overrides, samples, steps, save):
    from megatron_tg.config import load_config
    from megatron_tg.train.trainer import Trainer

    trainer = Trainer(load_config("recipes/tiny_cpu.yaml", overrides))
    resumed = trainer.resume() is not None
    start = _named(trainer, list(trainer.gpt.parameters()))
    metrics = [trainer.train_step(samples) for _ in range(steps)]
    grads = _named(trainer, [p.main_grad for p in trainer.gpt.parameters()])
    after = _named(trainer, list(trainer.gpt.parameters()))
    expert = None
    if trainer.expert_model is not None:
        from megatron_tg.models.qwen3_moe.mapping import current_layout, to_hf

        layout = current_layout(model=trainer.expert_model)
        expert = {hf: t for name, p in trainer.expert_model.named_parameters()
                  for hf, t in to_hf(name, p.detach().clone(), trainer.arch, layout)}
    if save:
        trainer.save({})
        trainer.checkpointer.finalize(blocking=True)  # an async save completes before exit
    return dict(metrics=metrics, grads=grads, start=start, after=after, expert=expert,
                resumed=resumed, step=trainer.step, turns=trainer.turn_stats)


def _union(per_rank, key):
    out = {}
    for r in per_rank:
        out.update(r[key] or {})
    return out


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from megatron_tg.chat import get_tiny_tokenizer

    tok = get_tiny_tokenizer()
    d = tmp_path_factory.mktemp("policy4")
    cfg, model, state = tiny_hf_model(vocab_size=len(tok), num_hidden_layers=4)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, make_samples(tok, cfg.to_dict(), state)


def _base(d, tmp_path, *extra):
    return [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "objective.kl_coef=0.5", "optimizer.lr=1e-3",
            "optimizer.micro_batch_tokens=1024", f"checkpoint.dir={tmp_path}/ckpt",
            f"logging.run_dir={tmp_path}/run", "logging.samples_per_step=4", *extra]


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_pp2_step_equals_pp1(policy, tmp_path):
    d, samples = policy
    one = run_distributed(_fn, 1, _base(d, tmp_path / "a"), samples, 1, False)[0]
    two = run_distributed(_fn, 2, _base(d, tmp_path / "b", "parallel.pp=2"), samples, 1, False)
    m1, m2 = one["metrics"][0], two[0]["metrics"][0]
    assert m1["train/micro_batches"] > 1 and m1["kl/frac_gated"] > 0
    assert two[0]["metrics"] == two[1]["metrics"]  # the last stage's metrics on every rank
    assert two[0]["turns"] == two[1]["turns"] and two[0]["turns"].keys() == one["turns"].keys()
    dl = abs(m2["loss"] - m1["loss"])
    dg = _max_diff(_union(two, "grads"), one["grads"])
    dw = _max_diff(_union(two, "after"), one["after"])
    print(f"trainer PP2 vs PP1: |loss diff| {dl:.3g}, max |grad diff| {dg:.3g}, "
          f"max |weight diff after the step| {dw:.3g}")
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-6)
    assert m2["optim/grad_norm"] == pytest.approx(m1["optim/grad_norm"], rel=1e-5)
    torch.testing.assert_close(_union(two, "grads"), one["grads"], atol=3e-7, rtol=1e-4)


def test_checkpoint_moves_between_pp2_and_pp1(policy, tmp_path):
    d, samples = policy
    base = _base(d, tmp_path, "objective.expert=ema", "objective.ema_decay=0.5")
    a = run_distributed(_fn, 2, base + ["parallel.pp=2"], samples, 1, True)   # save at PP2
    b = run_distributed(_fn, 1, base, samples, 1, True)[0]                    # resume at PP1
    c = run_distributed(_fn, 2, base + ["parallel.pp=2"], samples, 1, False)  # resume at PP2
    assert not a[0]["resumed"] and b["resumed"] and c[0]["resumed"]
    assert b["step"] == 2 and c[0]["step"] == 3
    # The weights each resume starts from are the ones the other layout saved.
    torch.testing.assert_close(b["start"], _union(a, "after"), atol=0, rtol=0)
    torch.testing.assert_close(_union(c, "start"), b["after"], atol=0, rtol=0)
    # ... and so is the EMA expert (its fp32 average went through the checkpoint).
    assert b["expert"].keys() == _union(a, "expert").keys()
    # A reference without checkpoints: 3 steps at PP1 in one process.
    ref = run_distributed(_fn, 1, _base(d, tmp_path / "ref", "objective.expert=ema",
                                         "objective.ema_decay=0.5"), samples, 3, False)[0]
    dw = _max_diff(_union(c, "after"), ref["after"])
    print(f"PP2 -> PP1 -> PP2 resumed run vs 3 uninterrupted PP1 steps: max |weight diff| {dw:.3g}")
    torch.testing.assert_close(_union(c, "after"), ref["after"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(_union(c, "expert"), ref["expert"], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_pp2_dp2_with_megatron_s_distributed_optimizer(policy, tmp_path):
    """The GPU recipes' optimizer at PP > 1: 4 ranks (PP 2 x DP 2, every DP rank given the
    same samples, so the DP mean is the single rank's gradient; the optimizer's state is
    sharded over the two DP ranks). Its loss equals PP 1's; its step equals the default
    optimizer's at PP 2 (gradients are not compared: after the reduce-scatter each rank's
    buffer holds the reduced gradient in its own shard only)."""
    d, samples = policy
    one = run_distributed(_fn, 1, _base(d, tmp_path / "a"), samples, 1, False)[0]
    two = run_distributed(_fn, 2, _base(d, tmp_path / "b", "parallel.pp=2"), samples, 1, False)
    four = run_distributed(_fn, 4, _base(d, tmp_path / "c", "parallel.pp=2",
                                         "parallel.use_distributed_optimizer=true"),
                           samples, 1, False)
    m1, m4 = one["metrics"][0], four[0]["metrics"][0]
    assert all(r["metrics"] == four[0]["metrics"] for r in four)
    dl = abs(m4["loss"] - m1["loss"])
    dw = _max_diff(_union(four, "after"), _union(two, "after"))
    moved = _max_diff(_union(two, "after"), _union(two, "start"))
    print(f"trainer PP2 x DP2 with the distributed optimizer: |loss diff| vs PP1 {dl:.3g}; "
          f"max |weight diff after the step| vs PP2's default optimizer {dw:.3g} "
          f"(the step moves weights up to {moved:.3g})")
    assert m4["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-6)
    assert m4["optim/grad_norm"] == pytest.approx(m1["optim/grad_norm"], rel=1e-5)
    assert moved > 1e-4 and dw < 1e-6
