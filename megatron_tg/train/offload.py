"""The trainer's device state put aside between phases, and brought back bit-exact
(``rollout.placement="colocated"``, docs/colocated.md).

Three kinds of state, each a set of tensor storages found from the trainer's objects:

* ``params``: every parameter and buffer of the policy (and of a separate expert model). With
  the distributed optimizer they are views of megatron DDP's ``_ParamAndGradBuffer.param_data``,
  so that buffer's one storage is what is put aside;
* ``grads``: DDP's gradient buffers (``DistributedDataParallel.buffers`` and
  ``expert_parallel_buffers``, ``grad_data``; every ``param.main_grad`` is a view of one).
  Scratch between steps: freed without a copy and zeroed when brought back, as megatron's own
  ``_ParamAndGradBuffer.offload_to_cpu`` / ``reload_from_cpu`` do;
* ``optimizer``: the torch optimizers' parameters (fp32 main copies or their shards) and
  state tensors (Adam's moments), and the EMA expert's average.

A storage is freed with ``untyped_storage().resize_(0)``, the call megatron's buffers use: every
tensor viewing it stays the same Python object (optimizer param groups, ``main_grad``, the
model's module tree), so nothing has to be re-pointed, and ``resize_`` back to its size gives
the views their memory again. The bytes are copied to a host backup first (pinned on CUDA,
allocated once and reused), and back after the resize. A storage two kinds share (a main
parameter that is a view of an fp32 model parameter) is handled once, by the first kind.

On CPU the "device" is host memory: the mechanism (storages freed, views intact, bytes back)
is the same, and that is what the tests check; the bytes a GPU gets back are measured on
GPU only (docs/colocated.md, what needs a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

KINDS = ("params", "grads", "optimizer")


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    nbytes: int
    keep: bool
    """Copy the bytes to the backup (False: scratch, zeroed on onload)."""
    backup: torch.Tensor | None = None


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """All of ``storage``'s bytes as one uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside ours: ``CPUAdamW.opt``; ``MegatronOptimizer.opt``, which is
    megatron's optimizer (``.optimizer``) or a ``ChainedOptimizer`` of them."""
    inner = getattr(optimizer, "opt", optimizer)
    for opt in getattr(inner, "chained_optimizers", None) or [inner]:
        opt = getattr(opt, "optimizer", opt)
        if isinstance(opt, torch.optim.Optimizer):
            yield opt


def _tensors(trainer, kind: str) -> Iterator[torch.Tensor]:
    if kind == "params":
        for module in (trainer.model, trainer.expert_model):
            if module is not None:
                yield from module.parameters()
                yield from torch.nn.Module.buffers(module)  # DDP shadows it with its grad buffers
    elif kind == "grads":
        for buf in list(trainer.model.buffers) + list(getattr(trainer.model, "expert_parallel_buffers", [])):
            if buf.grad_data is not None:
                yield buf.grad_data
    else:
        for opt in _torch_optimizers(trainer.optimizer):
            for group in opt.param_groups:
                yield from group["params"]
            for state in opt.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        if trainer.ema is not None:
            yield from trainer.ema.ema


class TrainerOffload:
    """Frees and restores the storages of the trainer's state, kind by kind.

    Which storages belong to a kind is read when it is offloaded (the optimizer's state exists
    only after its first step). A storage is known by its ``StorageImpl`` (``_cdata``), which
    ``resize_`` keeps, so its backup is allocated once and reused every step."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.saved: dict[str, list[_Saved]] = {k: [] for k in KINDS}
        self.offloaded: set[str] = set()
        self._backups: dict[int, torch.Tensor] = {}

    def _collect(self) -> dict[str, list[_Saved]]:
        """Every storage on the trainer's device holding memory now, under the first kind
        that has it (state kept in host memory on a GPU run, e.g. a CPU-placed EMA or Adam's
        step counters, stays where it is)."""
        device = self.trainer.ctx.device.type
        seen: set[int] = set()
        out: dict[str, list[_Saved]] = {}
        for kind in KINDS:
            out[kind] = []
            for t in _tensors(self.trainer, kind):
                s = t.untyped_storage()
                if s.nbytes() == 0 or s._cdata in seen or s.device.type != device:
                    continue
                seen.add(s._cdata)
                out[kind].append(_Saved(s, s.nbytes(), keep=kind != "grads"))
        return out

    def device_bytes(self, kinds: Iterable[str] = KINDS) -> int:
        """Bytes the storages of ``kinds`` hold on their device now (as last collected)."""
        return sum(x.storage.nbytes() for k in kinds for x in self.saved[k])

    @torch.no_grad()
    def offload(self, kinds: Iterable[str] = KINDS) -> int:
        """Copy the storages of ``kinds`` to host backups and free them; returns bytes freed."""
        kinds = [k for k in KINDS if k in set(kinds) - self.offloaded]
        live = self._collect()
        for k in kinds:
            self.saved[k] = live[k]
        todo = [x for k in kinds for x in self.saved[k]]
        cuda = any(x.storage.device.type == "cuda" for x in todo)
        for x in todo:
            if x.keep:
                x.backup = self._backups.get(x.storage._cdata)
                if x.backup is None or x.backup.numel() != x.nbytes:
                    x.backup = torch.empty(x.nbytes, dtype=torch.uint8, device="cpu",
                                           pin_memory=x.storage.device.type == "cuda")
                    self._backups[x.storage._cdata] = x.backup
                x.backup.copy_(_bytes_view(x.storage), non_blocking=True)
        if cuda:
            torch.cuda.synchronize()  # the copies have read the storages before they are freed
        freed = 0
        for x in todo:
            freed += x.storage.nbytes()
            x.storage.resize_(0)
        self.offloaded.update(kinds)
        if cuda:
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver (the engines)
        return freed

    @torch.no_grad()
    def onload(self, kinds: Iterable[str] = KINDS) -> int:
        """Give the storages of ``kinds`` their memory back, with their bytes (gradients:
        zeros); returns bytes restored."""
        kinds = [k for k in KINDS if k in set(kinds) & self.offloaded]
        restored = 0
        cuda = False
        for k in kinds:
            for x in self.saved[k]:
                x.storage.resize_(x.nbytes)
                view = _bytes_view(x.storage)
                if x.keep:
                    view.copy_(x.backup, non_blocking=True)
                else:
                    view.zero_()
                restored += x.nbytes
                cuda = cuda or x.storage.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()  # the pinned backups are read before anything reuses them
        self.offloaded.difference_update(kinds)
        return restored
