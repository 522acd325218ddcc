"""The engine GPU of the memory plan: SGLang preallocates its share of the bf16 weights and a
KV cache of what ``mem_fraction_static`` leaves; do the in-flight rollouts at full context fit
in it (:func:`engine_plan`)? Also the first-sync coverage check's host memory."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_tg.config import TGConfig
from megatron_tg.launch.memory_terms import BF16, GIB, H100_MEMORY_GIB, RolePlan

if TYPE_CHECKING:  # the model module imports torch: only where a plan is computed
    from megatron_tg.models.qwen3_moe.config import Qwen3Arch


def sglang_default_mem_fraction(gpu_mib: float, tp: int) -> float:
    """SGLang 0.5.23's default ``mem_fraction_static`` for an 80 GB-class GPU, restated from
    ``sglang/srt/arg_groups/memory_hook.py`` (``handle_gpu_memory_settings``): reserve
    512 MiB + 1.5 MiB x chunked-prefill tokens (8,192 on 60-90 GiB GPUs) + tp/8 GiB + 2 MiB x
    decode CUDA-graph batch (256 below tp 4, else 512), at least 10 GiB. The launcher passes no
    ``--mem-fraction-static``, so this is what the engines run with."""
    reserved = 512 + 8192 * 1.5 + tp / 8 * 1024 + 2 * (256 if tp < 4 else 512)
    reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def engine_plan(cfg: TGConfig, arch: Qwen3Arch, total_params: int,
                mem_fraction: float | None = None) -> RolePlan:
    r = cfg.rollout
    tp = r.engine_tp
    gpu_mib = H100_MEMORY_GIB * 1024
    frac = sglang_default_mem_fraction(gpu_mib, tp) if mem_fraction is None else mem_fraction
    weights = BF16 * total_params / tp
    kv_heads = max(arch.num_key_value_heads / tp, 1)  # heads replicate past TP = groups
    kv_per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * BF16
    pool = frac * gpu_mib * 2 ** 20 - weights
    kv_tokens = max(int(pool // kv_per_token), 0)
    inflight = r.max_inflight_rollouts or r.buffer_size * r.group_size
    per_engine = math.ceil(inflight / max(r.num_engines, 1))
    need = per_engine * r.max_context_tokens
    concurrent = kv_tokens // r.max_context_tokens
    terms = {"weights": weights, "kv_cache": max(pool, 0.0),
             "sglang_reserved": (1 - frac) * gpu_mib * 2 ** 20}
    verdict = "fit" if need <= kv_tokens else "queue"
    notes = [f"mem_fraction_static={frac} ({'SGLang default' if mem_fraction is None else 'given'}); "
             f"KV cache {kv_tokens:,} tokens per engine ({kv_per_token:,} B/token/GPU)",
             f"in flight: {per_engine} rollouts per engine x {r.max_context_tokens:,} tokens = "
             f"{need:,} tokens: {verdict} ({concurrent} rollouts at full context fit at once)"]
    plan = RolePlan("engine", terms, notes, usable_fraction=1.0, kv={"kv_tokens": kv_tokens, "needed_tokens": need, "rollouts_at_full_context": concurrent,
               "in_flight_per_engine": per_engine, "in_flight": verdict, "mem_fraction_static": frac})
    if pool <= 0:
        plan.notes.append(f"weights {weights / GIB:.1f} GiB exceed mem_fraction_static x GPU: "
                          "raise rollout.engine_tp")
    if r.sync_verify_coverage:
        plan.kv["coverage_check"] = cov = coverage_check_host_bytes(cfg, arch, total_params)
        plan.notes.append(
            f"first-sync coverage check (rollout.sync_verify_coverage): per-tensor checksums, "
            f"{cov['checksum_bytes'] / 2**20:.1f} MiB of host memory per rollout node "
            f"(SGLang's snapshot -> compare would pin {cov['snapshot_bytes'] / 1e9:,.0f} GB there)")
    return plan


def coverage_check_host_bytes(cfg: TGConfig, arch: Qwen3Arch, total_params: int) -> dict[str, float]:
    """Host memory of the first-sync coverage check on one rollout node (engines of
    ``rollout.engine_tp`` GPUs packed on ``parallel.gpus_per_node``): the checksum reply (a
    name and a 16-digit hash per tensor per TP rank, at most ~200 B with its JSON; the HF
    tensor count bounds SGLang's, which fuses experts), against the snapshot SGLang's
    ``compare`` needs (every TP rank's weights in bf16, the whole model per engine)."""
    r = cfg.rollout
    engines = max(cfg.parallel.gpus_per_node // r.engine_tp, 1)
    tensors = arch.num_layers * (3 * max(arch.num_experts or 0, 1) + 12) + 3
    return {"engines_per_node": engines, "checksum_bytes": float(engines * r.engine_tp * tensors * 200),
            "snapshot_bytes": float(engines * BF16 * total_params)}
