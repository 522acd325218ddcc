"""The TG micro-batch (expert pass + student pass + GRPO + gated KL) on the megatron policy:
loss and gradients at TP=2, EP=2 and TP=2 x EP=2 equal the single-process TP=1 run.

Data: multi-turn rollouts rendered with the tiny Qwen3-Coder-framed tokenizer, some turns
failing with feedback (shared expert sequences), packed two per row and run as THD packed
sequences (``PackedSeqParams``). Behaviour log-probs are the HF model's own plus noise, so the PPO ratio, clipping and
TIS are all exercised. With DP > 1 each DP rank takes half the rollouts; megatron's DDP
average over DP then equals the single-process mean over all rollouts.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.testing.distributed import run_distributed
from tests.train.common import compare_step, make_samples, step_rank_fn, tiny_policy

CONFIGS = [ObjectiveConfig(mode="tg", kl_direction="reverse", kl_coef=0.5),
           ObjectiveConfig(mode="tg", kl_direction="forward", kl_coef=0.5,
                           expert_sequence="exact"),
           ObjectiveConfig(mode="grpo"),
           ObjectiveConfig(mode="tg", kl_direction="jsd", kl_coef=0.5, expert="frozen")]


@pytest.fixture(scope="module")
def setup():
    tok, cfg, state = tiny_policy()
    samples = make_samples(tok, cfg, state)
    ref = run_distributed(step_rank_fn, 1, [(1, 1, 1)], state, cfg, samples, CONFIGS,
                          tok.name_or_path)[0][0]
    return tok, cfg, state, samples, ref


@pytest.mark.parametrize("world,layouts", [(2, [(2, 1, 2), (1, 2, 1)]), (4, [(2, 2, 1)])],
                         ids=["tp2-ep2", "tp2xep2"])
def test_parallel_step_matches_single_process(setup, world, layouts):
    tok, cfg, state, samples, ref = setup
    assert ref[0]["n_gated"] > 0 and ref[1]["n_gated"] > 0 and ref[2]["n_gated"] == 0
    assert ref[3]["n_gated"] > 0
    out = run_distributed(step_rank_fn, world, layouts, state, cfg, samples, CONFIGS,
                          tok.name_or_path)
    for i, layout in enumerate(layouts):
        for c, obj in enumerate(CONFIGS):
            compare_step([o[i][c] for o in out], ref[c], world // layout[0],
                     f"{layout} {obj.mode}/{obj.kl_direction}/{obj.expert_sequence}")


def test_kl_changes_the_gradient(setup):
    """The TG and GRPO gradients differ (the KL term is really there), and a separate expert
    with other weights changes it again."""
    *_, ref = setup

    def diff(a, b):
        return max((ref[a]["grads"][k] - ref[b]["grads"][k]).abs().max().item() for k in ref[a]["grads"])

    assert diff(0, 2) > 1e-4 and diff(3, 2) > 1e-4


def test_tg_with_nothing_failing_equals_grpo_bitwise(setup):
    tok, cfg, state, samples, _ = setup
    passing = [s.__class__(s.rollout, s.advantage, {}) for s in samples]
    tg, grpo = run_distributed(step_rank_fn, 1, [(1, 1, 1)], state, cfg, passing,
                               [ObjectiveConfig(mode="tg"), ObjectiveConfig(mode="grpo")],
                               tok.name_or_path)[0][0]
    assert tg["n_gated"] == 0
    assert torch.equal(tg["loss"], grpo["loss"])
    assert all(torch.equal(tg["grads"][k], grpo["grads"][k]) for k in grpo["grads"])
