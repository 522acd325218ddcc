"""The EMA expert's weights: an fp32 moving average of the optimizer's fp32 main parameters,
sharded over data-parallel ranks like them, gathered and cast into the expert model.

Why fp32: the average moves by (1 − d)·(θ − θ_ema) per step. In bf16, at a weight near 0.02
(spacing 1.2e-4) with d = 0.99, an update survives rounding only if |θ − θ_ema| > ~6e-3, while
Adam at lr 3e-6 moves a weight by at most ~6e-4 over 200 steps: a bf16 average would stay
frozen. Why from the main parameters: the bf16 model weights are themselves rounded copies of
them, so averaging those would average the rounding.

Sharding contract (:class:`MainShard`): each DP rank owns a contiguous range ``[start,
start + n)`` of every flattened parameter, and the ranges of the ranks of ``group`` partition
it. That is exactly how megatron's ``DistributedOptimizer`` holds its fp32 main parameters
(``_get_model_param_range_map(p)["param"]``, over its ``data_parallel_group``: the DP group
for dense weights, the expert-DP group for experts), so on GPU the EMA costs 4 bytes per
parameter / DP size and reads the optimizer's own shard, with no copy. On CPU,
:class:`~megatron_tg.train.optim.CPUAdamW` keeps whole fp32 masters on every rank (like
megatron's non-distributed ``Float16OptimizerWithFloat16Params``) and hands out equal
contiguous ranges of them, so the EMA is sharded the same way on both devices.

Gathering: every rank writes its range into a zeroed buffer of the expert's dtype and the
buffers are summed over ``group``: exact (x + 0 = x), and it allows the optimizer's unequal
ranges. Memory: the shard (4 B / param / DP) plus one parameter-sized buffer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.distributed as dist


@dataclass
class MainShard:
    """This rank's range of one parameter's fp32 main copy."""

    param: torch.nn.Parameter
    """The model parameter (any dtype) the range belongs to."""
    main: torch.Tensor
    """[n] fp32: the optimizer's main values of ``param.view(-1)[start:start + n]`` (a view)."""
    start: int
    """Offset of the range in the flattened parameter."""
    group: dist.ProcessGroup | None
    """The ranks whose ranges partition the parameter (None: this rank holds all of it)."""


class HasMainShards(Protocol):
    """An optimizer that exposes its fp32 main parameters, sharded."""

    def main_shards(self) -> list[MainShard]: ...


def equal_ranges(numel: int, rank: int, size: int) -> tuple[int, int]:
    """The contiguous range rank ``rank`` of ``size`` owns of ``numel`` elements."""
    return numel * rank // size, numel * (rank + 1) // size


class ShardedEMA:
    """θ_ema ← d·θ_ema + (1 − d)·θ_main on this rank's shards, in fp32."""

    def __init__(self, optimizer: HasMainShards, expert: torch.nn.Module,
                 policy: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.shards = optimizer.main_shards()
        by_param = {id(p): name for name, p in policy.named_parameters()}
        targets = dict(expert.named_parameters())
        self.names: list[str] = []
        for s in self.shards:
            name = by_param.get(id(s.param))
            if name is None or name not in targets:
                raise ValueError(f"EMA: the optimizer's parameter {name!r} has no counterpart "
                                 f"in the expert model")
            self.names.append(name)
        self.targets = [targets[n] for n in self.names]
        self.ema = [s.main.detach().to(torch.float32).clone() for s in self.shards]

    @property
    def shard_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.ema)

    @torch.no_grad()
    def update(self) -> None:
        """After each optimizer step: average this rank's shards, then refresh the expert."""
        for e, s in zip(self.ema, self.shards):
            e.lerp_(s.main.to(torch.float32), 1.0 - self.decay)
        self.copy_to_expert()

    @torch.no_grad()
    def copy_to_expert(self) -> None:
        for target, full in self._gathered(dtype=None):
            target.copy_(full.view_as(target))

    def _gathered(self, dtype: torch.dtype | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(expert parameter, the whole EMA of it as one flat tensor) per parameter."""
        for e, s, target in zip(self.ema, self.shards, self.targets):
            buf = torch.zeros(target.numel(), dtype=dtype or target.dtype, device=target.device)
            buf[s.start:s.start + e.numel()] = e.to(buf.dtype)
            if s.group is not None and dist.get_world_size(s.group) > 1:
                dist.all_reduce(buf, group=s.group)  # one owner per element: the sum is exact
            yield target, buf

    # ---- checkpoint: the EMA in model space (fp32), so it reshards like the model ---------
    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """name -> this rank's model-shaped fp32 EMA of each parameter, on the CPU (a save
        holds one fp32 copy of the rank's model shard in host memory, never on the device)."""
        return {name: full.view(target.shape).cpu()
                for name, (target, full) in zip(self.names, self._gathered(torch.float32))}

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise KeyError(f"EMA checkpoint lacks {len(missing)} parameters, e.g. {missing[0]!r}")
        for name, e, s in zip(self.names, self.ema, self.shards):
            flat = state[name].reshape(-1)
            e.copy_(flat[s.start:s.start + e.numel()].to(e.device, torch.float32))
        self.copy_to_expert()

