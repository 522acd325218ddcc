"""The memory plan of a colocated GPU (``rollout.placement=colocated``, docs/colocated.md): the
trainer and an engine take turns on it, so the plan has two phases, each of which must fit.

- **Train phase**: the trainer's whole plan (:func:`megatron_tg.launch.memory.train_plan`) plus
  what an engine keeps after ``/release_memory_occupation`` of every tag (weights, KV cache,
  CUDA graphs): :data:`ENGINE_RELEASED_GIB`.
- **Generate phase**: the engine's weights, KV cache and SGLang's reserve
  (:func:`megatron_tg.launch.engine_memory.engine_plan`) at the mem_fraction_static colocated
  engines run with (:func:`colocated_mem_fraction`), plus what the trainer's offload
  (``TrainerOffload``: parameters, gradients, optimizer state) leaves on the GPU: the
  train plan's CUDA/NCCL reserve and :data:`FRAGMENTS_GIB`.

The two constants are assumptions until measured on a GPU (docs/first-gpu-run.md's colocated
items: ``memory_reserved``/``mem_get_info`` after offload and after a release). Layouts that
cannot colocate are refused by :func:`layout_refusal`, naming the numbers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_tg.config import RolloutConfig, TGConfig
from megatron_tg.launch.engine_memory import engine_plan, sglang_default_mem_fraction
from megatron_tg.launch.memory_terms import GIB, H100_MEMORY_GIB, RUNTIME_RESERVE_GIB, RolePlan

if TYPE_CHECKING:
    from megatron_tg.models.qwen3_moe.config import Qwen3Arch

ENGINE_RELEASED_GIB = 2.0
"""What a released SGLang engine keeps on its GPU: its CUDA context, its TP group's NCCL
communicators and the buffers no memory-saver tag covers. An assumption (not measured)."""
FRAGMENTS_GIB = 1.0
"""What the trainer's caching allocator keeps after offload and ``empty_cache()`` (memory still
occupied by tensors the offload does not move). An assumption (not measured)."""


def trainer_left_gib() -> float:
    """GiB the trainer keeps on a GPU during generation: its CUDA/NCCL reserve (the train
    plan's ``runtime`` term) and the allocator's fragments."""
    return RUNTIME_RESERVE_GIB + FRAGMENTS_GIB


def colocated_mem_fraction(r: RolloutConfig) -> float:
    """The ``--mem-fraction-static`` colocated engines get (the launcher passes it): SGLang's
    default for the engine's TP, less what the trainer keeps on the GPU while they generate.
    SGLang sizes its KV pool as a fraction of the whole GPU, so without it the pool would be
    planned over memory the trainer still holds."""
    gpu_mib = H100_MEMORY_GIB * 1024
    frac = sglang_default_mem_fraction(gpu_mib, r.engine_tp)
    return math.floor((frac - trainer_left_gib() / H100_MEMORY_GIB) * 1000) / 1000  # never above the sum


def layout_refusal(cfg: TGConfig, world_size: int) -> str | None:
    """None when the layout can colocate; else why not, with the numbers: every GPU of the
    trainer hosts one engine TP rank, so the engines' GPUs are the trainer's."""
    r, gpn = cfg.rollout, cfg.parallel.gpus_per_node
    if gpn % r.engine_tp:
        return (f"rollout.placement='colocated': rollout.engine_tp={r.engine_tp} does not divide "
                f"parallel.gpus_per_node={gpn} (an engine's TP ranks share one node's GPUs with the trainer)")
    if r.num_engines * r.engine_tp != world_size:
        return (f"rollout.placement='colocated': rollout.num_engines x rollout.engine_tp = "
                f"{r.num_engines} x {r.engine_tp} = {r.num_engines * r.engine_tp} GPUs, but the trainer has "
                f"{world_size}: set rollout.num_engines={world_size // r.engine_tp} (one engine TP rank "
                f"on each trainer GPU)")
    return None


def colocated_roles(cfg: TGConfig, arch: Qwen3Arch, total_params: int, train: RolePlan,
                    mem_fraction: float | None = None) -> dict[str, RolePlan]:
    """The two phases of a colocated GPU, as the plan's ``train`` and ``engine`` roles."""
    frac = colocated_mem_fraction(cfg.rollout) if mem_fraction is None else mem_fraction
    gen = engine_plan(cfg, arch, total_params, frac)
    gen.role = "colocated GPU, generate phase"
    # SGLang's own reserve is what its default leaves; the fraction taken off that default is the
    # trainer's, a term of its own
    gpu_mib = H100_MEMORY_GIB * 1024
    gen.terms["sglang_reserved"] = (1 - sglang_default_mem_fraction(gpu_mib, cfg.rollout.engine_tp)) * gpu_mib * 2 ** 20
    gen.terms["trainer_offloaded"] = trainer_left_gib() * GIB
    gen.fixes["trainer_offloaded"] = "nothing in the recipe (the trainer's CUDA/NCCL reserve and fragments)"
    gen.fixes["kv_cache"] = ("a larger rollout.engine_tp (its weights split over more GPUs; "
                             "recipes/tg_30b_colocated.yaml runs 8 engines x TP 2) or a smaller "
                             "rollout.max_context_tokens")
    gen.notes.insert(0, f"colocated: mem_fraction_static={frac} (SGLang's default less the "
                        f"{trainer_left_gib():.1f} GiB the trainer keeps while the engine generates)")
    phase = RolePlan("colocated GPU, train phase", {**train.terms, "engine_released": ENGINE_RELEASED_GIB * GIB},
                     notes=[f"colocated: plus {ENGINE_RELEASED_GIB:.1f} GiB a released engine keeps (assumed)",
                            *train.notes],
                     capacity_gib=train.capacity_gib, fixes={**train.fixes,
                     "engine_released": "nothing in the recipe (a released engine's context)"},
                     host=dict(train.host), usable_fraction=train.usable_fraction)
    offloaded = sum(train.terms.get(k, 0.0) for k in ("weights", "optimizer"))  # gradients: freed
    phase.host["colocated_offload"] = offloaded
    phase.notes.append(f"colocated: {offloaded / GIB:.1f} GiB per GPU offloaded to host memory while the "
                       "engine generates (parameters, optimizer state; gradients freed)")
    return {"train": phase, "engine": gen}
