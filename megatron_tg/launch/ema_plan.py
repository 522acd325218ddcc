"""The EMA expert's share of a trainer GPU, term by term, and its time per step.

Terms (bytes per GPU of the most loaded stage; :func:`ema_terms`):

* ``ema_shard``      the fp32 average, sharded like the optimizer's fp32 main parameters
  (dense over DP x CP, experts over expert-DP: 4 B / param / shard count); 0 on the device
  with ``objective.ema_placement=host``, where it is a host term and the device holds
  ``ema_shard_staging`` instead: the largest unit's fp32 shard, copied up for its gather;
* ``ema_copy``       ``ema_weights=replicated``: the persistent copy of the rank's weights in
  the model dtype (:mod:`megatron_tg.train.ema`);
* ``ema_gathered``   ``ema_weights=gathered`` (:mod:`megatron_tg.train.ema_gather`): under
  ``ema_gather_scope=layer`` the largest unit's weights (a decoder layer or the embedding),
  under ``step`` every unit's (a full copy for the length of the expert pass);
* ``ema_gather_buffer`` the all-gather's buffers of that unit: (n + 1) x its longest piece,
  at most 2 (n + 1) / n x the group's part of the unit (where the pieces are less equal the
  gather is an in-place all-reduce with none); the bound is counted;
* ``ema_head``       gathered: the output weight, gathered once per pass and held until the
  step's last loss reads it (last stage only).

Terms are summed with the rest of the plan as if they coexisted (the plan's convention), so
"step" is charged its full copy alongside the student pass's activations, which in fact it
precedes; it fits where a recipe's other terms leave that room.

Time (:func:`ema_time`): the gathers move, per gathered model, (n − 1) / n of its bytes per
GPU in an all-gather over the group (2 (n − 1) / n in the all-reduce fallback), at
``parallel.interconnect_gbps_per_gpu``: once per micro-batch with an expert pass ("layer";
an upper bound: every micro-batch gated) or once per step ("step"). Host placement adds the
copies up of the fp32 shard, per gathered model, and the update's up and down, at
``parallel.host_link_gbps_per_gpu``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_tg.config import TGConfig
from megatron_tg.parallel.dims import ParallelDims

FP32 = 4


@dataclass(frozen=True)
class StageSizes:
    """Parameter counts of one rank of the planned pipeline stage (from the memory plan)."""

    dense_params: int
    expert_params: int
    unit_dense: int
    """Dense parameters of the largest gathered unit (a decoder layer or the embedding)."""
    unit_expert: int
    """Expert parameters of that unit."""
    head_params: int
    """The output weight's parameters on this rank (0 before the last stage)."""


def _shards(cfg: TGConfig, dims: ParallelDims) -> tuple[int, int]:
    """How many ranks share the fp32 main copy of a dense and of an expert parameter."""
    if not cfg.parallel.use_distributed_optimizer:
        return 1, 1
    return dims.dp * dims.cp, dims.edp


def _buffer_bound(part: int, n: int, wb: int) -> float:
    return 0.0 if n == 1 else wb * part * 2 * (n + 1) / n


def ema_terms(cfg: TGConfig, dims: ParallelDims, s: StageSizes, wb: int) -> tuple[dict[str, float], dict[str, float]]:
    """(device terms, host terms) in bytes; empty unless ``objective.expert=ema``."""
    o = cfg.objective
    if o.expert != "ema":
        return {}, {}
    nd, ne = _shards(cfg, dims)
    shard = FP32 * (s.dense_params / nd + s.expert_params / ne)
    unit_shard = FP32 * (s.unit_dense / nd + s.unit_expert / ne)
    host = o.ema_placement == "host"
    terms = {"ema_shard": 0.0 if host else shard}
    if host:
        terms["ema_shard_staging"] = unit_shard
    if o.ema_weights == "replicated":
        terms["ema_copy"] = wb * (s.dense_params + s.expert_params)
    else:
        unit = wb * (s.unit_dense + s.unit_expert)
        full = wb * (s.dense_params + s.expert_params - s.head_params)
        terms["ema_gathered"] = unit if o.ema_gather_scope == "layer" else full
        # groups gather one after another: the larger one's buffer on top of the unit
        terms["ema_gather_buffer"] = max(_buffer_bound(s.unit_dense, nd, wb),
                                         _buffer_bound(s.unit_expert, ne, wb))
        terms["ema_head"] = wb * s.head_params
    return terms, ({"ema_shard": shard} if host else {})


def expert_passes_per_step(cfg: TGConfig, dims: ParallelDims) -> int:
    """Micro-batches per DP rank per step, each with an expert pass (upper bound)."""
    r = cfg.rollout
    per_rank = r.prompts_per_step * r.group_size * r.max_context_tokens / dims.dp
    return max(1, math.ceil(per_rank / cfg.optimizer.micro_batch_tokens))


def ema_time(cfg: TGConfig, dims: ParallelDims, s: StageSizes, wb: int) -> dict[str, Any] | None:
    """Seconds per step the gathered EMA expert spends moving weights (None unless the
    expert is a gathered EMA)."""
    o, p = cfg.objective, cfg.parallel
    if o.expert != "ema" or o.ema_weights != "gathered":
        return None
    nd, ne = _shards(cfg, dims)
    gathers = expert_passes_per_step(cfg, dims) if o.ema_gather_scope == "layer" else 1
    # per gathered model, bytes one GPU receives: (n - 1) / n of each group's part
    model_bytes = wb * (s.dense_params * (nd - 1) / nd + s.expert_params * (ne - 1) / ne)
    gather_bytes = gathers * model_bytes
    gather_s = gather_bytes / (p.interconnect_gbps_per_gpu * 1e9)
    shard = FP32 * (s.dense_params / nd + s.expert_params / ne)
    host_bytes = (gathers + 2) * shard if o.ema_placement == "host" else 0.0
    host_s = host_bytes / (p.host_link_gbps_per_gpu * 1e9)
    return {"scope": o.ema_gather_scope, "gathers_per_step": gathers,
            "gather_bytes_per_step": gather_bytes, "gather_s": round(gather_s, 2),
            "gather_s_all_reduce_bound": round(2 * gather_s, 2),
            "host_copy_bytes_per_step": host_bytes, "host_copy_s": round(host_s, 2),
            "interconnect_gbps_per_gpu": p.interconnect_gbps_per_gpu,
            "host_link_gbps_per_gpu": p.host_link_gbps_per_gpu}


def render(t: dict[str, Any] | None) -> list[str]:
    if t is None:
        return []
    out = [f"  ema       gathered expert ({t['scope']} scope): {t['gathers_per_step']} gathers "
           f"per step, {t['gather_bytes_per_step'] / 1e9:,.1f} GB per GPU -> {t['gather_s']:,} s "
           f"at {t['interconnect_gbps_per_gpu']:g} GB/s (parallel.interconnect_gbps_per_gpu; "
           f"<= {t['gather_s_all_reduce_bound']:,} s where it all-reduces)"]
    if t["host_copy_bytes_per_step"]:
        out.append(f"  ema       host placement: {t['host_copy_bytes_per_step'] / 1e9:,.1f} GB per "
                   f"GPU over the host link -> {t['host_copy_s']:,} s at "
                   f"{t['host_link_gbps_per_gpu']:g} GB/s (parallel.host_link_gbps_per_gpu)")
    return out
