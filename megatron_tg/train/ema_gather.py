"""The EMA expert without a persistent copy: each layer's weights are gathered from the
DP-sharded fp32 average just before the expert pass runs that layer, and freed after it.

Why: a replicated expert holds the rank's whole parameter shard once more in the model dtype
for the whole run (docs/memory-plan.md: per recipe), although only the expert pass reads it. Here
the expert model's parameters hold no storage outside the expert pass; what the GPU holds
for the expert is the fp32 shard of :class:`~megatron_tg.train.ema.ShardedEMA` (4 B / param
/ DP, or nothing on the device with ``placement="host"``) plus, during the pass, one unit's
weights and its gather buffer: FSDP's schedule, on a model that is never trained.

Units, in forward order: the embedding, each decoder layer, the final norm (forward hooks
gather and free them), and the *head*: the output weight, which the loss reads after the
pass (the expert's hidden states meet it in the student's loss; ``run_step`` keeps a
reference), so it is gathered once when the pass starts and held for the step. With tied
embeddings the embedding is the head. Parameters of no other unit are held likewise.

Gather of one unit: per process group of its shards (the DP group for dense weights, the
expert-DP group for experts) one collective into one storage for the group's parameters of
the unit. Where the ranks' pieces are near equal (the CPU AdamW's equal ranges), every rank
packs its ranges, cast to the model dtype, into a buffer padded to the group's longest and
an all-gather fills a ``[group, longest]`` buffer, unpacked by every rank's ranges (exchanged
once at set-up). Megatron's distributed optimizer cuts each bucket, not each layer, into DP
parts, so one rank may own most of a layer; there the unit is all-reduced in place from
zeros, with no buffer (at most twice an all-gather's traffic; :attr:`_GroupPlan.collective`).
Either way the values are those the replicated copy gets from its zero-padded all-reduce
(one owner per element): the expert's log-probs, the loss and the gradients are
bit-identical (tests/train/test_ema_gather.py).

Scope (``objective.ema_gather_scope``): "layer" gathers each unit at each micro-batch's
expert pass: the peak is one unit + its buffer (+ the head), the gather traffic one model
per micro-batch. "step" gathers every unit once when the step's expert pass begins and
frees them when it ends: one model's traffic per step, but a full copy on the device for the
length of the expert pass. Both are decided by the memory plan (``megatron-tg memory``
prints the two), not at run time: the plan knows the other terms of the step, the trainer
does not. Reordering the expert pass layer-major (every micro-batch through layer ``l``
before layer ``l + 1``, which would gather once per step at one layer's memory) would hold
every micro-batch's hidden states at once, the step's ``host_expert_states`` (``megatron-tg
memory`` prints them), on the device, and would not be megatron's schedule (PP): not done.

Lock-step: the gathers are collectives of the DP / expert-DP groups, so under "layer" every
rank of them runs as many gathers as the rank with the most expert passes; a rank with fewer
joins the rest with gather-only sweeps (no forward) after its own passes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_tg.train.ema import ShardedEMA

SCOPES = ("layer", "step")


@dataclass
class _GroupPlan:
    """One unit's shards of one process group, and every rank's ranges of them."""

    group: dist.ProcessGroup | None
    shards: list[int]
    """Indices into the EMA's shard list, in packing order."""
    ranges: list[list[tuple[int, int]]]
    """Per rank of ``group``: (start, numel) of each of ``shards``."""

    @property
    def longest(self) -> int:
        return max(sum(n for _, n in r) for r in self.ranges)

    @property
    def collective(self) -> str:
        """"all_gather" when the ranks' pieces are near equal (CPU AdamW's equal ranges):
        (n − 1) x longest elements per rank, under the 2 (n − 1) / n x total of a ring
        all-reduce; else "all_reduce" of the zero-padded unit in place (megatron's
        distributed optimizer cuts a bucket, not each layer, in DP equal parts, so one rank
        may own most of a layer: an all-gather would pad every rank to that). "local" for
        an unsharded group."""
        n = len(self.ranges)
        if n == 1:
            return "local"
        total = sum(nn for r in self.ranges for _, nn in r)
        return "all_gather" if self.longest * n < 2 * total else "all_reduce"

    def total_numel(self, ema: ShardedEMA) -> int:
        return sum(ema.shapes[i].numel() for i in self.shards)

    def offsets(self, ema: ShardedEMA) -> dict[int, int]:
        out, off = {}, 0
        for i in self.shards:
            out[i] = off
            off += ema.shapes[i].numel()
        return out

    def buffer_numel(self) -> int:
        """All-gather: this rank's padded piece + the ``[group, longest]`` result; the
        all-reduce runs in the unit's own storage."""
        return self.longest * (len(self.ranges) + 1) if self.collective == "all_gather" else 0


@dataclass
class Unit:
    name: str
    module: torch.nn.Module | None
    params: list[int]
    """Indices into the EMA's shard list."""
    held: bool
    """Gathered at the start of the pass and held until its end (the head)."""
    groups: list[_GroupPlan] = field(default_factory=list)


class GatheredEMA:
    """Materialises the expert model's weights from ``ema`` during the expert pass only."""

    def __init__(self, ema: ShardedEMA, expert: torch.nn.Module, scope: str = "layer") -> None:
        if scope not in SCOPES:
            raise ValueError(f"EMA gather scope must be one of {SCOPES}, got {scope!r}")
        from megatron_tg.train.policy import unwrap

        self.ema, self.scope = ema, scope
        self.gpt = unwrap(expert)
        self.units = self._units(self.gpt)
        self._plan_ranges()
        self._empty = [torch.empty(0, dtype=d, device=dev)
                       for d, dev in zip(ema.dtypes, ema.devices)]
        for i in range(len(ema.targets)):
            self._free_param(i)
        self._resident: set[int] = set()  # unit indices materialised now
        self._active = False
        self.gathers = 0
        """Unit gathers run so far (each unit counts once per gather)."""
        self.peak_bytes = 0
        """The most expert-parameter storage + gather buffers measured at once (hooks)."""
        self._buffer_bytes = 0
        for k, u in enumerate(self.units):
            if u.module is not None and not u.held:
                u.module.register_forward_pre_hook(lambda m, a, k=k: self._pre(k))
                u.module.register_forward_hook(lambda m, a, o, k=k: self._post(k))

    # ---- set-up ----------------------------------------------------------------------
    def _units(self, gpt) -> list[Unit]:
        index = {id(t): i for i, t in enumerate(self.ema.targets)}
        taken: set[int] = set()

        def unit(name, module, held=False):
            ids = [index[id(p)] for p in module.parameters() if id(p) in index
                   and index[id(p)] not in taken]
            taken.update(ids)
            return Unit(name, module, ids, held)

        tied = gpt.share_embeddings_and_output_weights
        units = []
        # The head first: with tied weights the output weight is the embedding's.
        if gpt.post_process and not tied:
            units.append(unit("output_layer", gpt.output_layer, held=True))
        if gpt.pre_process:
            units.append(unit("embedding", gpt.embedding, held=tied and gpt.post_process))
        for i, layer in enumerate(gpt.decoder.layers):
            units.append(unit(f"decoder.layers.{i}", layer))
        norm = getattr(gpt.decoder, "final_layernorm", None)
        if norm is not None:
            units.append(unit("decoder.final_layernorm", norm))
        rest = [i for i in range(len(self.ema.targets)) if i not in taken]
        if rest:  # nothing known runs them as a module: hold them for the pass
            units.append(Unit("rest", None, rest, held=True))
        return [u for u in units if u.params]

    def _plan_ranges(self) -> None:
        """Every rank's (start, numel) of every shard, per group: one exchange, at set-up."""
        by_group: dict[int, tuple[dist.ProcessGroup | None, list[int]]] = {}
        for i, s in enumerate(self.ema.shards):
            g = s.group if s.group is not None and dist.get_world_size(s.group) > 1 else None
            by_group.setdefault(id(g), (g, []))[1].append(i)
        ranges: dict[int, list[tuple[int, int]]] = {}  # shard -> per rank (start, numel)
        for g, idx in by_group.values():
            mine = [(self.ema.shards[i].start, self.ema.ema[i].numel()) for i in idx]
            if g is None:
                every = [mine]
            else:
                every = [None] * dist.get_world_size(g)
                dist.all_gather_object(every, mine, group=g)
            for j, i in enumerate(idx):
                ranges[i] = [r[j] for r in every]
        for u in self.units:
            for g, idx in by_group.values():
                mine = [i for i in u.params if i in set(idx)]
                if mine:
                    world = len(ranges[mine[0]])
                    u.groups.append(_GroupPlan(g, mine, [[ranges[i][r] for i in mine]
                                                          for r in range(world)]))

    # ---- sizes (the memory plan's terms, measured) ------------------------------------
    def unit_bytes(self, u: Unit) -> int:
        return sum(self.ema.shapes[i].numel() * self.ema.dtypes[i].itemsize for i in u.params)

    def buffer_bytes(self, u: Unit) -> int:
        """The largest gather buffer of the unit (its groups gather one after another)."""
        return max((g.buffer_numel() * self.ema.dtypes[g.shards[0]].itemsize for g in u.groups),
                   default=0)

    def unit_peak_bytes(self, u: Unit) -> int:
        """The unit's weights gathered so far + the buffer of the group being gathered, at
        its largest: at most :meth:`unit_bytes` + :meth:`buffer_bytes`."""
        done, peak = 0, 0
        for g in u.groups:
            done += sum(self.ema.shapes[i].numel() * self.ema.dtypes[i].itemsize for i in g.shards)
            peak = max(peak, done + g.buffer_numel() * self.ema.dtypes[g.shards[0]].itemsize)
        return peak

    def planned_peak_bytes(self) -> int:
        """What :attr:`peak_bytes` must measure over a pass, from the sizes alone: the units
        gathered when the pass starts (the held ones; under "step" all), one after another,
        then under "layer" each other unit on top of the held ones, one at a time."""
        first = [u for u in self.units if u.held or self.scope == "step"]
        taken = {id(u) for u in first}
        peak = resident = 0
        for u in first:
            peak = max(peak, resident + self.unit_peak_bytes(u))
            resident += self.unit_bytes(u)
        for u in self.units:
            if id(u) not in taken:
                peak = max(peak, resident + self.unit_peak_bytes(u))
        return peak

    def full_bytes(self) -> int:
        return sum(self.unit_bytes(u) for u in self.units)

    def live_bytes(self) -> int:
        """Bytes of distinct storage the expert's parameters hold now, plus a gather buffer."""
        seen, total = set(), 0
        for t in self.ema.targets:
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total + self._buffer_bytes

    def _measure(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    # ---- gather / free ---------------------------------------------------------------
    def _free_param(self, i: int) -> None:
        self.ema.targets[i].data = self._empty[i]

    @torch.no_grad()
    def _materialise(self, k: int) -> None:
        if k in self._resident:
            return
        ema = self.ema
        for gp in self.units[k].groups:
            dtype, device = ema.dtypes[gp.shards[0]], ema.devices[gp.shards[0]]
            offsets = gp.offsets(ema)
            # One storage per group: the collective fills it in place or from one buffer.
            fill = torch.zeros if gp.collective == "all_reduce" else torch.empty
            flat = fill(gp.total_numel(ema), dtype=dtype, device=device)
            send = recv = None
            if gp.collective == "all_gather":
                world, longest = len(gp.ranges), gp.longest
                send = torch.zeros(longest, dtype=dtype, device=device)
                off = 0
                for i in gp.shards:  # this rank's pieces, cast on the device
                    n = ema.ema[i].numel()
                    send[off:off + n] = ema.device_shard(i).to(dtype)
                    off += n
                recv = torch.empty(world * longest, dtype=dtype, device=device)
                self._buffer_bytes = (send.numel() + recv.numel()) * dtype.itemsize
                dist.all_gather_single(recv, send, group=gp.group)
                for r in range(world):
                    off = r * longest
                    for i, (start, n) in zip(gp.shards, gp.ranges[r]):
                        flat[offsets[i] + start:offsets[i] + start + n] = recv[off:off + n]
                        off += n
            else:  # this rank's ranges in place; all_reduce: one owner per element, exact
                rank = 0 if gp.group is None else dist.get_rank(gp.group)
                for i, (start, n) in zip(gp.shards, gp.ranges[rank]):
                    flat[offsets[i] + start:offsets[i] + start + n] = ema.device_shard(i).to(dtype)
                if gp.collective == "all_reduce":
                    dist.all_reduce(flat, group=gp.group)
            for i in gp.shards:
                ema.targets[i].data = flat[offsets[i]:offsets[i] + ema.shapes[i].numel()].view(
                    ema.shapes[i])
            self._measure()  # the unit's weights and the buffer both alive
            self._buffer_bytes = 0
            del flat, send, recv
        self._resident.add(k)
        self.gathers += 1

    def _free(self, k: int) -> None:
        for i in self.units[k].params:
            self._free_param(i)
        self._resident.discard(k)

    def _pre(self, k: int) -> None:
        if not self._active:
            raise RuntimeError(f"the gathered EMA expert ran {self.units[k].name} outside "
                               "expert_pass(): its weights exist only inside it")
        self._materialise(k)

    def _post(self, k: int) -> None:
        self._measure()
        if self.scope == "layer":
            self._free(k)

    # ---- the pass --------------------------------------------------------------------
    def _max_passes(self, passes: int) -> int:
        """The most expert passes any rank of this rank's gather groups runs this step."""
        groups = {id(gp.group): gp.group for u in self.units for gp in u.groups
                  if gp.group is not None}
        if not groups:
            return passes
        n = torch.tensor([passes], dtype=torch.int64, device=self.ema.devices[0])
        for g in groups.values():
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=g)
        return int(n.item())

    @contextlib.contextmanager
    def expert_pass(self, passes: int) -> Iterator[None]:
        """The expert model's weights exist inside this block, for ``passes`` forward passes
        of this rank (collective over the DP / expert-DP groups: every rank enters, with
        its own count, even 0)."""
        most = self._max_passes(passes) if self.scope == "layer" else passes
        self._active = True
        try:
            for k, u in enumerate(self.units):
                if u.held or self.scope == "step":
                    self._materialise(k)
            yield
            # Join the other ranks' remaining gathers (their extra micro-batches' passes).
            for _ in range(most - passes):
                for k, u in enumerate(self.units):
                    if not u.held:
                        self._materialise(k)
                        self._free(k)
        finally:
            self._active = False
            for k in list(self._resident):
                self._free(k)
