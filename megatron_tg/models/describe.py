"""Parameter counts and per-rank shard sizes of a Qwen3(-MoE) config.

Two independent counts that must agree:
- analytic, from the HF config alone (:func:`param_counts`): total parameters and *active*
  parameters per token (attention, norms, router, the top-k experts, embeddings and the
  output layer);
- built, from the real megatron model of one rank per pipeline stage, constructed on the
  meta device (no memory) inside a fake process group of the requested world size, so the
  shard sizes are those the builder really produces under TP/EP/PP.

``megatron-tg describe`` (:mod:`megatron_tg.models.command`) prints them; its last line is JSON (``total_params``, ``active_params``, per-rank shards).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from megatron_tg.models.qwen3_moe.config import Qwen3Arch, padded_vocab_size
from megatron_tg.parallel.dims import ParallelDims


def param_counts(arch: Qwen3Arch) -> dict[str, int]:
    """Total and active parameter counts of the HF model (unpadded vocabulary)."""
    h, v, hd = arch.hidden_size, arch.vocab_size, arch.head_dim
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    attn = h * nq * hd + 2 * h * nkv * hd + nq * hd * h + 2 * hd  # q, k, v, o, q/k norms
    if arch.attention_bias:
        attn += nq * hd + 2 * nkv * hd
    norms = 2 * h
    embed = v * h * (1 if arch.tie_word_embeddings else 2) + h  # + final norm
    total = active = embed
    for i in range(arch.num_layers):
        total += attn + norms
        active += attn + norms
        if arch.is_moe_layer(i):
            expert = 3 * h * arch.moe_intermediate_size
            router = arch.num_experts * h
            total += router + arch.num_experts * expert
            active += router + arch.num_experts_per_tok * expert
        else:
            total += 3 * h * arch.intermediate_size
            active += 3 * h * arch.intermediate_size
    return {"total_params": total, "active_params": active}


@contextlib.contextmanager
def _fake_world(world_size: int, rank: int):
    """A process group that never communicates: enough for megatron to build one rank."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("describe builds in a fake process group; torch.distributed is "
                           "already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def built_shards(arch: Qwen3Arch, *, tp: int = 1, ep: int = 1, pp: int = 1,
                 etp: int | None = None, bytes_per_param: int = 2) -> list[dict[str, Any]]:
    """Build rank 0 of every pipeline stage on the meta device; count what it holds."""
    from megatron.core import parallel_state as mps

    from megatron_tg.models.qwen3_moe.model import build_model
    from megatron_tg.parallel.cpu_patches import apply_cpu_patches

    world = ParallelDims.smallest_world(tp=tp, ep=ep, pp=pp, etp=etp)
    dims = ParallelDims(world_size=world, tp=tp, pp=pp, ep=ep, etp=etp)
    dims.check_model(num_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
                     num_query_groups=arch.num_key_value_heads, num_experts=arch.num_experts)
    if not torch.cuda.is_available():
        apply_cpu_patches()
    stages = []
    ranks_per_stage = world // pp
    for stage in range(pp):
        with _fake_world(world, rank=stage * ranks_per_stage):
            mps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                          pipeline_model_parallel_size=pp,
                                          expert_model_parallel_size=ep,
                                          expert_tensor_parallel_size=dims.etp,
                                          create_gloo_process_groups=False)
            try:
                with torch.device("meta"):
                    model = build_model(arch, tp=tp, ep=ep, pp=pp, etp=dims.etp,
                                        params_dtype=torch.bfloat16, use_te=False,
                                        perform_initialization=False, on_cpu=True)
                dense = expert = tensors = 0
                for name, p in model.named_parameters():
                    tensors += 1
                    if ".experts." in name:
                        expert += p.numel()
                    else:
                        dense += p.numel()
            finally:
                mps.destroy_model_parallel()
        stages.append({"pp_stage": stage, "tensors": tensors, "dense_params": dense,
                       "expert_params": expert, "params": dense + expert,
                       "bytes": (dense + expert) * bytes_per_param})
    return stages


def describe(hf_config: Any, *, tp: int = 1, ep: int = 1, pp: int = 1,
             etp: int | None = None) -> dict[str, Any]:
    arch = Qwen3Arch.from_hf(hf_config)
    counts = param_counts(arch)
    stages = built_shards(arch, tp=tp, ep=ep, pp=pp, etp=etp)
    return {
        **counts,
        "model_type": arch.model_type,
        "num_experts": arch.num_experts,
        "layout": {"tp": tp, "ep": ep, "pp": pp, "etp": ParallelDims.resolve_etp(tp, etp)},
        "padded_vocab_size": padded_vocab_size(arch.vocab_size, tp),
        "per_rank": stages,
    }
