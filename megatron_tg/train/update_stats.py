"""What one optimizer step did to the weights: the size and the shape of the update.

Contract. With θ the fp32 main weights (each rank's :class:`~megatron_tg.train.ema.MainShard`
ranges) and Δ = θ_after − θ_before over one ``optimizer.step()``, counted once per element
of the model (a TP-replicated dense parameter from TP rank 0 only; every rank's DP shard;
expert shards from every expert-parallel rank), with n the number of elements:

    update_norm           = ||Δ||₂
    update_rms_over_lr    = ||Δ||₂ / sqrt(n) / lr
    update_abs_mean_over_lr = (Σ |Δ_i|) / n / lr
    update_changed_frac   = #{i : Δ_i ≠ 0} / n

Why: Adam with β1 = 0 and a clipped gradient moves each weight by about lr · g/sqrt(v);
when v is dominated by the current g² that is lr · sign(g), whatever the loss's scale. Then
``update_abs_mean_over_lr`` is near 1 and the update does not depend on λ (issue 38's H1).
A plain gradient step would give a ratio that scales with the gradient.

The sums are float64 and all-reduced over the whole world on the weights' device (NCCL on
GPU: no host tensors in the collective).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_tg.train.ema import MainShard


def _counted(shard: MainShard, tp_rank: int) -> bool:
    p = shard.param
    if not getattr(p, "allreduce", True):  # expert weights: sharded over EP, never replicated
        return True
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


class UpdateStats:
    """Snapshot the main shards before a step, measure the update after it."""

    def __init__(self, shards: Callable[[], Sequence[MainShard]]) -> None:
        self._shards = shards
        self._before: list[torch.Tensor] | None = None

    @torch.no_grad()
    def before(self) -> None:
        self._before = [s.main.detach().clone() for s in self._shards()]

    @torch.no_grad()
    def after(self, lr: float) -> dict[str, float]:
        if self._before is None:
            raise RuntimeError("UpdateStats.after() without before()")
        from megatron.core import parallel_state as mps

        tp_rank = mps.get_tensor_model_parallel_rank() if mps.model_parallel_is_initialized() else 0
        shards = list(self._shards())
        if len(shards) != len(self._before):
            raise RuntimeError(f"{len(shards)} main shards after the step, {len(self._before)} before")
        device = shards[0].main.device if shards else torch.device("cpu")
        acc = torch.zeros(4, dtype=torch.float64, device=device)  # sq, abs, changed, n
        for s, old in zip(shards, self._before):
            if not _counted(s, tp_rank):
                continue
            d = s.main.detach().double() - old.double()
            acc += torch.stack([d.pow(2).sum(), d.abs().sum(), (d != 0).sum().double(),
                                torch.tensor(float(d.numel()), dtype=torch.float64, device=device)])
        self._before = None
        if dist.is_initialized():
            dist.all_reduce(acc)
        sq, ab, changed, n = (float(x) for x in acc)
        n = max(n, 1.0)
        lr = lr if lr > 0 else float("nan")
        return {"update_norm": sq ** 0.5, "update_rms_over_lr": (sq / n) ** 0.5 / lr,
                "update_abs_mean_over_lr": ab / n / lr, "update_changed_frac": changed / n}
