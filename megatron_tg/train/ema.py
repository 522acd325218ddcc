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

Two ways to hold the expert's weights (``objective.ema_weights``): "replicated" (this
module alone) copies the whole gathered average into a persistent expert model after every
update, a full copy of the rank's shard in the model dtype; "gathered"
(:mod:`megatron_tg.train.ema_gather`) keeps no copy and gathers each layer from these shards
just before the expert pass runs it. ``placement="host"`` (``objective.ema_placement``) keeps
the fp32 shards in pinned host memory: the update and each gather copy them up first.
"""

from __future__ import annotations

import contextlib
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
                 policy: torch.nn.Module, decay: float, placement: str = "device",
                 replicated: bool = True) -> None:
        if placement not in ("device", "host"):
            raise ValueError(f"EMA placement must be 'device' or 'host', got {placement!r}")
        self.decay = decay
        self.placement = placement
        self.replicated = replicated
        """Whether ``update`` refreshes a persistent expert copy (False: the expert's weights
        are gathered per pass by :class:`~megatron_tg.train.ema_gather.GatheredEMA`)."""
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
        # Recorded now: a gathered expert frees its parameters' storage after this.
        self.shapes = [t.shape for t in self.targets]
        self.dtypes = [t.dtype for t in self.targets]
        self.devices = [t.device for t in self.targets]
        self.ema = [self._place(s.main.detach().to(torch.float32).clone()) for s in self.shards]

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        if self.placement == "device":
            return t
        # Pinned so that the copies up (update, gathers) can be asynchronous; no pinning
        # without an accelerator (plain host memory is what "host" means there).
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                           pin_memory=torch.cuda.is_available())
        host.copy_(t)
        return host

    def device_shard(self, i: int) -> torch.Tensor:
        """Shard ``i`` of the fp32 average on its parameter's device (a copy up under host
        placement, else the shard itself)."""
        e = self.ema[i]
        return e if e.device == self.devices[i] else e.to(self.devices[i], non_blocking=True)

    @property
    def shard_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.ema)

    @torch.no_grad()
    def update(self) -> None:
        """After each optimizer step: average this rank's shards, then refresh the expert."""
        for i, (e, s) in enumerate(zip(self.ema, self.shards)):
            d = self.device_shard(i)  # the same fp32 lerp on the device under either placement
            d.lerp_(s.main.to(torch.float32), 1.0 - self.decay)
            if d is not e:
                e.copy_(d)
        if self.replicated:
            self.copy_to_expert()

    @torch.no_grad()
    def copy_to_expert(self) -> None:
        for target, full in self._gathered(dtype=None):
            target.copy_(full.view_as(target))

    def _gathered(self, dtype: torch.dtype | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(expert parameter, the whole EMA of it as one flat tensor) per parameter."""
        for i, (e, s, target) in enumerate(zip(self.ema, self.shards, self.targets)):
            buf = torch.zeros(self.shapes[i].numel(), dtype=dtype or self.dtypes[i],
                              device=self.devices[i])
            buf[s.start:s.start + e.numel()] = self.device_shard(i).to(buf.dtype)
            if s.group is not None and dist.get_world_size(s.group) > 1:
                dist.all_reduce(buf, group=s.group)  # one owner per element: the sum is exact
            yield target, buf

    # ---- checkpoint: the EMA in model space (fp32), so it reshards like the model ---------
    @contextlib.contextmanager
    def shaped_targets(self) -> Iterator[None]:
        """The expert's parameters shaped as in the model while the checkpoint's sharded
        state is described (a gathered expert's hold no storage): one element expanded to
        each shape (a parameter's data must stay on its device, so not a meta tensor), whose
        data the checkpoint replaces with :meth:`full_state`'s, so a save or load needs no
        copy of the weights and the format stays the replicated expert's."""
        empty = [t.data for t in self.targets]
        try:
            for t, shape, dtype, device in zip(self.targets, self.shapes, self.dtypes,
                                               self.devices):
                if t.numel() != shape.numel():
                    t.data = torch.zeros(1, dtype=dtype, device=device).expand(shape)
            yield
        finally:
            for t, e in zip(self.targets, empty):
                t.data = e

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """name -> this rank's model-shaped fp32 EMA of each parameter, on the CPU (a save
        holds one fp32 copy of the rank's model shard in host memory, never on the device)."""
        return {name: full.view(shape).cpu() for name, shape, (_, full)
                in zip(self.names, self.shapes, self._gathered(torch.float32))}

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise KeyError(f"EMA checkpoint lacks {len(missing)} parameters, e.g. {missing[0]!r}")
        for name, e, s in zip(self.names, self.ema, self.shards):
            flat = state[name].reshape(-1)
            e.copy_(flat[s.start:s.start + e.numel()].to(e.device, torch.float32))
        if self.replicated:
            self.copy_to_expert()

