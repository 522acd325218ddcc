"""Which model is trained, from where its weights come, and at what precision."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

from megatron_tg.config.base import ConfigError, check_choice, check_range

PARAMS_DTYPES = ("float32", "bfloat16")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
RECOMPUTE_MODES = ("none", "selective", "full")  # megatron_tg.models.qwen3_moe.config maps them

# Keys under which HF configs of MoE families store the routed-expert count.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass
class ModelConfig:
    """The policy model. Architecture comes from an HF config; weights from HF or Megatron."""

    hf_config: str = MISSING
    """Path to an HF ``config.json`` or to a model directory holding one. Defines the
    architecture (layers, heads, experts). Relative paths resolve against the working directory.
    Required: ``???`` is OmegaConf's marker for a value a recipe or override must set."""

    hf_checkpoint: Optional[str] = None
    """Directory of HF safetensors weights to start from; None = random init (tests only)."""

    megatron_checkpoint: Optional[str] = None
    """Megatron ``torch_dist`` checkpoint directory to start from; wins over ``hf_checkpoint``."""

    tokenizer: Optional[str] = None
    """Tokenizer directory; None = the directory of ``hf_checkpoint`` (or of ``hf_config``)."""

    params_dtype: str = "bfloat16"
    """Dtype of the model weights during training: "float32" or "bfloat16"."""

    seq_length: int = 4096
    """Longest sequence the trainer packs, in tokens; a whole rollout must fit in it."""

    transformer_impl: str = "auto"
    """Layer implementation: "transformer_engine" (GPU), "local" (plain torch, runs on CPU),
    "auto" = transformer_engine when CUDA is available, else local."""

    recompute: str = "none"
    """Activation recompute of the policy and of any separate expert copy (megatron-core's
    recompute settings; the mapping is ``recompute_kwargs`` in megatron_tg/models/qwen3_moe/
    config.py): "none" = keep every activation for backward; "selective" = recompute the
    attention kernel and, for MoE models, the routed-expert layer (which then keeps only its
    input); "full" = every transformer layer keeps only its input and reruns its forward in
    backward (one more forward pass of compute, the least memory). ``megatron-tg memory``
    prints what each leaves per GPU."""

    def validate(self) -> None:
        if not self.hf_config or self.hf_config == MISSING:
            raise ConfigError(f"model.hf_config: required (a config.json or model dir); got {self.hf_config!r}")
        check_choice("model.params_dtype", self.params_dtype, PARAMS_DTYPES)
        check_choice("model.transformer_impl", self.transformer_impl, TRANSFORMER_IMPLS)
        check_range("model.seq_length", self.seq_length, ge=1)
        check_choice("model.recompute", self.recompute, RECOMPUTE_MODES)

    def hf_config_file(self) -> Path:
        """The ``config.json`` that ``hf_config`` points at (it may not exist on this machine)."""
        path = Path(self.hf_config)
        return path / "config.json" if path.is_dir() else path

    def read_hf_config(self) -> dict[str, Any] | None:
        """The HF config as a dict, or None when the file is not on this machine.

        Recipes for large clusters name model directories that exist only there, so a
        missing file is not an error at config time; a present but unreadable one is.
        """
        path = self.hf_config_file()
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"model.hf_config: cannot read {str(path)!r}: {exc}") from exc

    def num_experts(self) -> int | None:
        """Routed experts per MoE layer from the HF config; 0 = dense; None = config not here."""
        hf = self.read_hf_config()
        if hf is None:
            return None
        return next((int(hf[k]) for k in _EXPERT_COUNT_KEYS if hf.get(k)), 0)
