"""Trainer.train_step: micro-batching by token budget does not change the update, and the
trainer starts from an HF checkpoint directory (config + safetensors + tokenizer)."""

from __future__ import annotations

import pytest
import torch

from megatron_tg.config import load_config
from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import tiny_hf_model
from tests.train.common import make_samples


def _step_fn(rank, world, overrides, samples):
    from megatron_tg.config import load_config
    from megatron_tg.train.trainer import Trainer

    trainer = Trainer(load_config("recipes/tiny_cpu.yaml", overrides))
    dp = trainer.ctx.dims.dp
    metrics = trainer.train_step(samples[rank % dp::dp] if dp > 1 else samples)
    # The accumulated gradient (DDP's main_grad survives the optimizer step). Post-Adam
    # weights are not compared: Adam's first step is ~lr*sign(g), which turns rounding noise
    # on near-zero gradients into lr-sized differences.
    flat = torch.cat([p.main_grad.detach().reshape(-1) for p in trainer.gpt.parameters()])
    # Under EP each rank holds other experts: the same gradients by HF name (TP=1 here).
    from megatron_tg.models.qwen3_moe.mapping import current_layout, to_hf

    layout = current_layout(model=trainer.gpt)
    named = {hf: t for name, p in trainer.gpt.named_parameters()
             for hf, t in to_hf(name, p.main_grad.detach().clone(), trainer.arch, layout)}
    return metrics, flat, named, trainer.turn_stats


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from megatron_tg.chat import get_tiny_tokenizer

    tok = get_tiny_tokenizer()
    d = tmp_path_factory.mktemp("policy")
    cfg, model, state = tiny_hf_model(vocab_size=len(tok))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, tok, cfg.to_dict(), state


def test_micro_batching_does_not_change_the_update(checkpoint, tmp_path):
    d, tok, cfg, state = checkpoint
    samples = make_samples(tok, cfg, state)
    base = [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "objective.kl_coef=0.5", "optimizer.lr=1e-3",
            f"checkpoint.dir={tmp_path}/ckpt", f"logging.run_dir={tmp_path}/run"]
    one = run_distributed(_step_fn, 1, base + ["optimizer.micro_batch_tokens=4096"], samples)[0]
    split = run_distributed(_step_fn, 1, base + ["optimizer.micro_batch_tokens=1024"], samples)[0]
    assert one[0]["train/micro_batches"] == 1 and split[0]["train/micro_batches"] > 1
    torch.testing.assert_close(split[0]["loss"], one[0]["loss"], atol=1e-5, rtol=1e-5)
    # fp32 rounding of the packed forward differs with the split; with TIS every token
    # carries a gradient (no PPO clip zeroes any), hence 3e-7 rather than 1e-7.
    torch.testing.assert_close(split[1], one[1], atol=3e-7, rtol=1e-4)
    assert one[0]["kl/frac_gated"] > 0 and one[0]["optim/grad_norm"] > 0
    # TIS is on: π_old is the student's own log-probs (ratio exactly 1), and the weights
    # π_old/π_behaviour spread with the fixture's 0.3-nat noise on the behaviour log-probs.
    m = one[0]
    print("IS weights:", {k: f"{m[k]:.3g}" for k in sorted(m) if k.startswith("pg/is_")
                          or k == "pg/engine_logprob_gap"})
    assert m["pg/ratio_mean"] == 1.0 and m["pg/clip_frac"] == 0.0
    assert m["pg/is_weight_min"] < 0.8 < 1.25 < m["pg/is_weight_max"]
    assert 0.1 < m["pg/is_weight_std"] and 0.1 < m["pg/engine_logprob_gap"] < 0.5
    assert 0 < m["pg/is_frac_truncated"] < 0.2
    # Per-turn records (gathered over DP): the gate sits on the feedback turns only.
    stats = one[3]
    assert stats["r0"][0]["gated_tokens"] > 0 and stats["r0"][0]["kl_mean"] > 0
    assert all(t["gated_tokens"] == 0 for t in stats["r1"].values())
    assert stats["r0"][1]["gated_tokens"] == 0 and stats["r0"][1]["kl_mean"] is None
    # extrema are extrema over the micro-batches, not their mean
    assert split[0]["pg/is_weight_max"] == pytest.approx(m["pg/is_weight_max"], rel=1e-5)
    # Data parallel over 2 ranks, 2 rollouts each: the same update as one rank with all 4.
    dp2 = run_distributed(_step_fn, 2, base + ["optimizer.micro_batch_tokens=4096"], samples)
    torch.testing.assert_close(dp2[0][1], one[1], atol=3e-7, rtol=1e-4)
    torch.testing.assert_close(dp2[1][1], one[1], atol=3e-7, rtol=1e-4)
    assert dp2[0][3] == dp2[1][3] and dp2[0][3].keys() == one[3].keys()


def test_untrained_start_is_refused(tmp_path, checkpoint):
    d, *_ = checkpoint
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.hf_config={d}"])
    assert cfg.model.hf_checkpoint is None and cfg.model.megatron_checkpoint is None
    out = None
    with pytest.raises(RuntimeError, match="initial weights"):
        out = run_distributed(_step_fn, 1, [f"model.hf_config={d}"], [])
    assert out is None


def test_a_context_parallel_layout_that_does_not_match_the_world_is_refused():
    """The trainer runs ``parallel.cp > 1`` (tests/train/test_trainer_cp.py); a layout whose
    TP x CP x PP does not divide the world is refused before any process group, naming the
    numbers."""
    from megatron_tg.config.base import ConfigError

    cfg = load_config("recipes/tiny_cpu.yaml", ["parallel.cp=3"])
    with pytest.raises(ConfigError, match=r"world_size=4 is not divisible by tp\*cp\*pp=1\*3\*1=3") as err:
        cfg.layout(4)
    print(f"\nrefused: {err.value}")


def _expert_fn(rank, world, overrides, samples, ckpt_dir):
    from megatron_tg.config import load_config
    from megatron_tg.train.trainer import Trainer

    cfg = load_config("recipes/tiny_cpu.yaml", overrides)
    trainer = Trainer(cfg)
    flat = lambda m: torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()])
    before_policy, before_expert = flat(trainer.gpt), flat(trainer.expert_model)
    trainer.train_step(samples)
    after_policy, after_expert = flat(trainer.gpt), flat(trainer.expert_model)
    trainer.save({})
    trainer.checkpointer.finalize(blocking=True)  # an async save completes before a resume sees it
    again = Trainer(cfg)  # restarts from the same base weights, then resumes the checkpoint
    again.resume()
    return dict(before=(before_policy, before_expert), after=(after_policy, after_expert),
                resumed=(flat(again.gpt), flat(again.expert_model)))


@pytest.mark.parametrize("kind", ["frozen", "ema"])
def test_frozen_and_ema_expert(checkpoint, tmp_path, kind):
    d, tok, cfg, state = checkpoint
    samples = make_samples(tok, cfg, state)
    decay = 0.9
    out = run_distributed(_expert_fn, 1, [
        f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
        "rollout.max_context_tokens=1024", "optimizer.lr=1e-3", "optimizer.micro_batch_tokens=4096",
        f"objective.expert={kind}", f"objective.ema_decay={decay}", "objective.kl_coef=0.5",
        f"checkpoint.dir={tmp_path}/ckpt", f"logging.run_dir={tmp_path}/run"], samples,
        str(tmp_path / "ckpt"))[0]
    p0, e0 = out["before"]
    p1, e1 = out["after"]
    assert torch.equal(p0, e0) and not torch.equal(p0, p1)  # starts as the policy; policy moved
    if kind == "frozen":
        assert torch.equal(e1, e0)
    else:
        torch.testing.assert_close(e1, decay * e0 + (1 - decay) * p1, atol=1e-7, rtol=1e-6)
    assert torch.equal(out["resumed"][0], p1) and torch.equal(out["resumed"][1], e1)


def test_expert_parallel_ranks_with_different_work(checkpoint, tmp_path):
    """EP=2 over 2 DP ranks: one rank has failing turns (an expert pass) and two micro-batches,
    the other nothing gated and one micro-batch. The MoE all-to-alls must still pair up, and
    the accumulated gradient equals one rank doing all the work."""
    d, tok, cfg, state = checkpoint
    samples = make_samples(tok, cfg, state)
    # rank 0 takes samples 0 and 2 (both with feedback), rank 1 samples 1 and 3 (none)
    samples = [s if k % 2 == 0 else s.__class__(s.rollout, s.advantage, {})
               for k, s in enumerate(samples)]
    base = [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "objective.kl_coef=0.5", "optimizer.lr=1e-3",
            f"checkpoint.dir={tmp_path}/ckpt", f"logging.run_dir={tmp_path}/run"]
    # 1024-token micro-batches: rank 0's two 622-token rollouts need two, rank 1's 484-token
    # rollouts fit in one.
    one = run_distributed(_step_fn, 1, base + ["optimizer.micro_batch_tokens=1024"], samples)[0]
    ep2 = run_distributed(_step_fn, 2, base + ["optimizer.micro_batch_tokens=1024",
                                               "parallel.ep=2", "parallel.etp=1"], samples,
                          timeout=300)
    named = {**ep2[0][2], **ep2[1][2]}
    assert named.keys() == one[2].keys()
    for k, g in one[2].items():
        torch.testing.assert_close(named[k], g, atol=1e-7, rtol=1e-4, msg=k)
