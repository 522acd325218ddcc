"""Qwen3 / Qwen3-MoE on megatron-core: config translation, model builder, HF weight mapping."""

from megatron_tg.models.qwen3_moe.config import (
    Qwen3Arch,
    UnsupportedConfigError,
    padded_vocab_size,
    transformer_config,
)
from megatron_tg.models.qwen3_moe.model import RMSNorm, build_model, layer_spec

__all__ = ["Qwen3Arch", "UnsupportedConfigError", "padded_vocab_size", "transformer_config",
           "RMSNorm", "build_model", "layer_spec"]
