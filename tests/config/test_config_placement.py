"""rollout.placement: disaggregated by default; colocated refuses, naming the field, what
cannot share the trainer's GPUs (docs/colocated.md)."""

from __future__ import annotations

import pytest

from megatron_tg.config import ConfigError, load_config

MODEL = "model.hf_config=models/tiny-qwen3-moe"
COLOCATED = [MODEL, "rollout.placement=colocated", "rollout.max_staleness=0"]


def test_disaggregated_is_the_default_and_the_recipe_colocates():
    assert load_config(None, [MODEL]).rollout.placement == "disaggregated"
    cfg = load_config("recipes/tiny_cpu.yaml", ["rollout.placement=colocated"])
    assert cfg.rollout.placement == "colocated" and cfg.rollout.max_staleness == 0


def test_an_unknown_placement_is_refused():
    with pytest.raises(ConfigError, match=r"rollout\.placement: must be one of 'disaggregated', "
                                          r"'colocated'; got 'shared'"):
        load_config(None, [MODEL, "rollout.placement=shared"])


@pytest.mark.parametrize("override, message, got", [
    # the default max_staleness=1 overlaps generation with training
    ("rollout.max_staleness=1", "rollout.max_staleness: must be 0 with rollout.placement='colocated'", "got 1"),
])
def test_colocated_refuses_what_cannot_share_the_gpus(override, message, got):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*COLOCATED, override])
    assert str(err.value).startswith(message) and str(err.value).endswith(got)
    load_config(None, COLOCATED)  # without the override it validates
    # the same values are fine when the engines have GPUs of their own
    load_config(None, [MODEL, override])


def test_colocated_takes_engines_wider_than_one_gpu():
    """Engine e's TP rank r takes its weights from trainer rank e * engine_tp + r
    (weight_sync/colocated_push.py); the layout is checked against the ranks' hosts at start."""
    cfg = load_config(None, [*COLOCATED, "rollout.engine_tp=2", "rollout.num_engines=4"])
    assert cfg.rollout.engine_tp == 2 and cfg.rollout.placement == "colocated"
