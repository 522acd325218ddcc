"""The TG step through megatron's pipeline schedule: loss and gradients at PP=2, TP=2 x PP=2
and PP=2 x EP=2 equal the single-process PP=1 run of the same samples.

The model has 4 layers (2 per stage, the first dense, the rest MoE). Each DP rank's samples
are split into two micro-batches of different shapes, so the 1F1B schedule runs warm-up,
steady state and cool-down and the stages exchange a new shape per micro-batch. Under
PP=2 x EP=2 the two DP ranks' first micro-batches differ in whether anything is gated: the
rank with nothing gated runs a lock-step dummy expert pass (the pass plan). The configs
cover the shared expert (expert pass as a forward-only schedule on the policy) and a
frozen expert with other weights (its own model, its own output weight on the last stage).
"""

from __future__ import annotations

import pytest

from megatron_tg.chat import get_tiny_tokenizer
from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import tiny_hf_model
from tests.train.common import compare_step, make_samples, step_rank_fn

pytestmark = pytest.mark.usefixtures("comm_rules")

CONFIGS = [ObjectiveConfig(mode="tg", kl_direction="reverse", kl_coef=0.5),
           ObjectiveConfig(mode="tg", kl_direction="jsd", kl_coef=0.5, expert="frozen")]
MICRO = 2  # micro-batches per DP rank


@pytest.fixture(scope="module")
def setup():
    tok = get_tiny_tokenizer()
    cfg, _, state = tiny_hf_model(vocab_size=len(tok), num_hidden_layers=4)
    cfg = cfg.to_dict()
    samples = make_samples(tok, cfg, state)
    ref = run_distributed(step_rank_fn, 1, [(1, 1, 1, 1)], state, cfg, samples, CONFIGS,
                          tok.name_or_path, MICRO)[0][0]
    return tok, cfg, state, samples, ref


@pytest.mark.parametrize("world,layouts", [(2, [(1, 1, 1, 2)]), (4, [(2, 1, 2, 2), (1, 2, 1, 2)])],
                         ids=["pp2", "tp2xpp2+pp2xep2"])
def test_pipeline_step_matches_single_stage(setup, world, layouts):
    tok, cfg, state, samples, ref = setup
    assert all(r["n_gated"] > 0 for r in ref)
    out = run_distributed(step_rank_fn, world, layouts, state, cfg, samples, CONFIGS,
                          tok.name_or_path, MICRO)
    for i, layout in enumerate(layouts):
        tp, ep, etp, pp = layout
        for c, obj in enumerate(CONFIGS):
            dl, dg = compare_step([o[i][c] for o in out], ref[c], world // (tp * pp),
                              f"tp{tp} ep{ep} pp{pp} {obj.kl_direction}/{obj.expert}")
            print(f"tp{tp} ep{ep} pp{pp} {obj.kl_direction}/{obj.expert}: "
                  f"max |loss diff| {dl:.3g}, max |grad diff| {dg:.3g}")


def test_recompute_under_1f1b_replays_each_micro_batchs_experts(setup):
    """With routing replay and full activation recompute, 1F1B runs the next micro-batch's
    forward before this one's backward; the recomputed forward must still replay its own
    micro-batch's experts (megatron pops them first in, first out). The routers are flipped
    (the trainer's free routing would differ from the engine's), so only replay agrees:
    PP=2 with recompute equals PP=1 without."""
    tok, cfg, state, samples, _ = setup
    flipped = {k: (-v if k.endswith("mlp.gate.weight") else v) for k, v in state.items()}
    obj = [CONFIGS[0]]
    ref = run_distributed(step_rank_fn, 1, [(1, 1, 1, 1)], flipped, cfg, samples, obj,
                          tok.name_or_path, MICRO, dict(routing_replay=True))[0][0]
    out = run_distributed(step_rank_fn, 2, [(1, 1, 1, 2)], flipped, cfg, samples, obj,
                          tok.name_or_path, MICRO, dict(routing_replay=True, recompute="full"))
    dl, dg = compare_step([o[0][0] for o in out], ref[0], 1, "pp2 recompute+replay")
    print(f"pp2 full recompute + routing replay vs pp1: max |loss diff| {dl:.3g}, "
          f"max |grad diff| {dg:.3g}")
