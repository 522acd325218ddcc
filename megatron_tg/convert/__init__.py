"""Checkpoint conversion between Hugging Face safetensors and megatron-core torch_dist (Qwen3-MoE).

- :func:`convert_hf_to_megatron` (``tools/convert_hf_to_megatron.py``): HF dir -> torch_dist
  checkpoint written by ``tp*ep*pp`` gloo workers, each reading only its slices; loads at
  any TP/EP/PP.
- :func:`convert_megatron_to_hf` (``tools/convert_megatron_to_hf.py``): torch_dist -> HF
  safetensors shards + index, streamed tensor by tensor.
- :func:`shard_plan` (``--dry-run``): per-rank tensors and bytes from config.json alone.

Per-tensor name/layout mapping lives in :mod:`megatron_tg.models.qwen3_moe.mapping`.
"""

from megatron_tg.convert.common import ConversionError
from megatron_tg.convert.hf_to_megatron import ConversionResult, convert_hf_to_megatron
from megatron_tg.convert.megatron_to_hf import convert_megatron_to_hf, load_megatron_checkpoint
from megatron_tg.convert.plan import shard_plan

__all__ = ["ConversionError", "ConversionResult", "convert_hf_to_megatron",
           "convert_megatron_to_hf", "load_megatron_checkpoint", "shard_plan"]
