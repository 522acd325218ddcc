"""ObjectiveConfig: OmegaConf structured round-trip and validation errors that name the field."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from megatron_tg.config.objective import ObjectiveConfig


def test_structured_config_round_trip_with_overrides():
    base = OmegaConf.structured(ObjectiveConfig)
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist([
        "mode=always_on", "kl_direction=jsd", "criterion_weights.markdown=0.5",
        "entropy_guard.enabled=true", "primary_criteria=[tests_pass,lint]"]))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, ObjectiveConfig)
    cfg.validate()
    assert cfg.criterion_weights == {"markdown": 0.5} and cfg.entropy_guard.enabled
    assert cfg.primary_criteria == ["tests_pass", "lint"]


@pytest.mark.parametrize("field,value", [
    ("mode", "ppo"), ("kl_direction", "sideways"), ("kl_token_normalization", "per_token"),
    ("pg_token_normalization", "x"), ("expert", "teacher"), ("expert_sequence", "x"),
    ("kl_coef", -1.0), ("jsd_beta", 1.5), ("clip_eps_low", 1.0), ("adv_eps", 0.0),
    ("ema_decay", 1.0), ("logits_chunk_size", 0),
])
def test_validate_names_the_field(field, value):
    cfg = ObjectiveConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        cfg.validate()


def test_guard_validation_names_nested_field():
    cfg = ObjectiveConfig()
    cfg.entropy_guard.decay_factor = 1.5
    with pytest.raises(ValueError, match="entropy_guard.decay_factor"):
        cfg.validate()
