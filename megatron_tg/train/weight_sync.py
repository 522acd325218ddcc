"""Push the trainer's weights to the rollout engines, in Hugging Face names, bucket by bucket.

Collective over the trainer's ranks (every rank calls :func:`iter_hf_weights` in lock-step):
each parameter is all-gathered over its TP group (expert-TP for experts) and merged with the
mapping's :func:`merge_tp_shards`; expert weights are then all-gathered over the EP group so
global rank 0 holds every expert; pipeline stages send their layers to global rank 0 over
the PP group. Only global rank 0 yields ``(hf_name, tensor)``: it is the single sender in the
engines' weight-update group (SGLang's ``init_weights_update_group``: trainer rank 0 plus
every engine rank), and broadcasts size-capped buckets while the engines'
``/update_weights_from_distributed`` calls are open. On GPU clusters that group is NCCL
(SGLang's own); the embedded CPU engine implements the same endpoints over gloo.

Peak extra memory on rank 0: one merged parameter (all experts of one weight kind under EP)
plus one bucket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_tg.models.qwen3_moe.config import Qwen3Arch
from megatron_tg.models.qwen3_moe.mapping import (ShardLayout, current_layout, merge_tp_shards,
                                                  param_info, to_hf)
from megatron_tg.parallel.dims import Axis
from megatron_tg.train.policy import unwrap


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [t]
    t = t.contiguous()  # gloo corrupts non-contiguous tensors silently
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


@torch.no_grad()
def iter_hf_weights(model: torch.nn.Module, arch: Qwen3Arch, ctx) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the model, yielded on global rank 0 only (collective)."""
    from megatron.core import parallel_state as mps

    gpt = unwrap(model)
    layout = current_layout(model=gpt)
    ep_group = ctx.group(Axis.EP)
    ep_ranks = dist.get_world_size(ep_group)
    pp_group = ctx.group(Axis.PP)
    pp_size = dist.get_world_size(pp_group)
    pp_rank = mps.get_pipeline_model_parallel_rank()
    on_rank0 = ctx.rank == 0
    for stage in range(pp_size):
        pending: list[tuple[str, torch.Tensor]] = []
        if stage == pp_rank:
            for name, p in gpt.named_parameters():
                info = param_info(name, arch, layout)
                group = ctx.group(Axis.ETP if info.is_expert else Axis.TP)
                full = merge_tp_shards(name, _all_gather(p.detach(), group), arch, layout)
                if info.is_expert and ep_ranks > 1:
                    for r, t in enumerate(_all_gather(full, ep_group)):
                        pending += list(to_hf(name, t, arch, _with_ep_rank(layout, r)))
                else:
                    pending += list(to_hf(name, full, arch, layout))
        if stage > 0:
            pending = _send_stage_to_rank0(pending, stage, pp_group, pp_rank, on_rank0)
        if on_rank0:
            yield from pending


def _with_ep_rank(layout: ShardLayout, ep_rank: int) -> ShardLayout:
    from dataclasses import replace

    return replace(layout, ep_rank=ep_rank)


def _send_stage_to_rank0(pending, stage, pp_group, pp_rank, on_rank0):
    """Move one later stage's HF tensors to the first stage over the PP group (objects)."""
    box = [pending if pp_rank == stage else None]
    src = dist.get_global_rank(pp_group, stage)
    dist.broadcast_object_list(box, src=src, group=pp_group)
    return box[0] if on_rank0 else []


def buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        yield cur


@dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        return {"sync/tensors": self.tensors, "sync/bytes": self.bytes,
                "sync/buckets": self.buckets, "sync/seconds": self.seconds,
                "sync/MBps": self.bytes / 2**20 / max(self.seconds, 1e-9)}


async def push_weights(client, group, model: torch.nn.Module, arch: Qwen3Arch, ctx, *,
                       version: int, bucket_bytes: int = 512 * 2**20,
                       dtype: torch.dtype | None = None) -> SyncStats:
    """Collective: all trainer ranks call it; rank 0 (the sender) needs ``client``/``group``.

    The caller pauses generation first and continues after (the rollout manager does); the
    last bucket carries the new ``weight_version`` so engines switch version atomically.
    """
    start = time.perf_counter()
    stats = SyncStats()
    pending = None
    for bucket in buckets(iter_hf_weights(model, arch, ctx), bucket_bytes):
        if dtype is not None:
            bucket = [(n, t.to(dtype)) for n, t in bucket]
        if pending is not None:
            await client.update_weights_from_distributed(group, pending,
                                                         load_format="flattened_bucket")
        pending = bucket
        stats.tensors += len(bucket)
        stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        stats.buckets += 1
    if pending is not None:
        await client.update_weights_from_distributed(group, pending, weight_version=str(version),
                                                     load_format="flattened_bucket")
    stats.seconds = time.perf_counter() - start
    return stats
