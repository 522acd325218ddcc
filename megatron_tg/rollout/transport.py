"""The weight-transport pieces both ends of a weight update share, whichever engine serves:
the trainer side (:mod:`megatron_tg.rollout.weight_client`, :mod:`megatron_tg.weight_sync.sync`)
and the embedded CPU engine (:mod:`megatron_tg.rollout.engine.weights`) import them from
here, so the production path does not depend on the engine that stands in for SGLang.

* the body format of ``/update_weights_from_tensor`` (:func:`encode_named_tensors`,
  :func:`decode_named_tensors`);
* the weight-update group (trainer rank 0 plus every engine GPU), formed by
  :func:`init_weight_update_group` exactly the way SGLang's ``init_custom_process_group``
  forms it on each engine GPU, so the two sides find each other's store keys; rank 0's store
  sits behind :mod:`megatron_tg.rollout.store_gate`;
* what a ``/update_weights_from_distributed`` request sends: tensors broadcast from rank 0
  one by one in request order (:func:`send_tensors`, fields from :func:`describe`), or, with
  ``load_format="flattened_bucket"``, one uint8 buffer holding the tensors back to back with
  no padding, each starting at a byte offset that is a multiple of its element size (SGLang
  0.5.23 refuses anything else; :class:`FlatBucket` packs that way, :func:`bucket_offsets`
  reads it back).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch


def encode_named_tensors(named_tensors) -> str:
    """Body format of our /update_weights_from_tensor: base64 of torch.save([(name, tensor)]).

    (SGLang's field carries MultiprocessingSerializer bytes with CUDA IPC handles, which
    cannot cross hosts; an HTTP-only CPU engine needs the data itself.)
    """
    buf = io.BytesIO()
    torch.save([(n, t.detach().cpu().contiguous()) for n, t in named_tensors], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_named_tensors(payload: str):
    data = torch.load(io.BytesIO(base64.b64decode(payload)), weights_only=True)
    return [(str(n), t) for n, t in data]


def as_dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


# ---- the weight-update group ---------------------------------------------------------------
@dataclass
class WeightUpdateGroup:
    """One member's handle of the trainer-engines group."""

    pg: object  # torch.distributed.ProcessGroup
    rank: int
    world_size: int
    group_name: str
    backend: str
    gate: object = None  # rank 0: the StoreGate in front of its store (store_gate.py)

    @property
    def device(self) -> torch.device:
        """Where broadcast tensors must live: NCCL moves GPU memory only."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        # gloo silently corrupts broadcasts of non-contiguous tensors (docs/measurements.md).
        if not tensor.is_contiguous():
            raise ValueError("weight-update broadcasts need contiguous tensors")
        self.pg.broadcast(tensor, 0).wait()

    def close(self) -> None:
        if self.pg is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.pg)
            self.pg = None
        if self.gate is not None:
            self.gate.close()
            self.gate = None


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "gloo",
                             timeout_s: float = 300.0, engine_hosts: Sequence[str] | None = None
                             ) -> WeightUpdateGroup:
    """Join the weight-update group as ``rank`` (0 = the trainer, which hosts the store).

    Formed as SGLang's ``init_custom_process_group`` forms it on each engine GPU, because
    the members only meet if every one reads and writes the same store keys: torch's
    ``tcp://`` rendezvous (a TCPStore at master_address:master_port, served by rank 0), a
    ``PrefixStore(group_name)`` over it, then torch's own group constructor, which adds
    ``group_name/`` and the device prefix and registers the group under ``group_name``.
    Blocks until all ``world_size`` members have joined (or ``timeout_s``).

    ``engine_hosts`` (rank 0): the store then listens on loopback only, behind a
    :class:`~megatron_tg.rollout.store_gate.StoreGate` on ``master_port`` that admits
    connections from those hosts' addresses alone (TCPStore has no authentication)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not group_name:
        raise ValueError("the weight-update group needs a non-empty group_name")
    if backend == "nccl" and dist.is_initialized() and getattr(c10d._get_default_group(), "bound_device_id", None):
        # torch would then build this communicator by splitting the default one, whose
        # members are not this group's: it would hang.
        raise RuntimeError("the weight-update group cannot use NCCL in a process whose default process group "
                           "is bound to a device (init_process_group(device_id=...)); initialise it without "
                           "device_id")
    timeout = timedelta(seconds=timeout_s)
    # The store torch's ``tcp://`` rendezvous would build (multi-tenant, rank 0 serves it),
    # built here so that rank 0 serves it whatever launched this process: under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=True) the rendezvous starts no server on rank 0, and the
    # engines, which are not torchrun workers, would wait as clients until the timeout.
    gate = None
    if rank == 0 and engine_hosts is not None:
        from .store_gate import StoreGate, loopback_listener, resolve_addresses

        inner = loopback_listener()
        inner_port = inner.getsockname()[1]
        gate = StoreGate(int(master_port), inner_port, resolve_addresses(engine_hosts))
    try:
        if gate is not None:  # the store's server owns the loopback socket (detach: Python won't close it)
            store = dist.TCPStore("127.0.0.1", inner_port, world_size, is_master=True, timeout=timeout,
                                  multi_tenant=True, master_listen_fd=inner.detach())
        else:
            store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                                  timeout=timeout, multi_tenant=True)
        store = dist.PrefixStore(group_name, store)
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                               group_name=group_name, backend_options=None, timeout=timeout)
    except Exception as exc:
        if gate is not None:
            gate.close()
            if gate.refused:
                raise RuntimeError(f"{exc}; the weight-update store refused connections from "
                                   f"{sorted(set(gate.refused))}, which are not engine hosts "
                                   f"{sorted(set(engine_hosts))}") from exc
        raise
    # Collectives address members by group rank == their rank in this group.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightUpdateGroup(pg, rank, world_size, group_name, backend, gate)


# ---- flattened buckets -----------------------------------------------------------------------
def bucket_offsets(names, dtypes, shapes) -> tuple[list[tuple[str, torch.dtype, tuple, int, int]], int]:
    """(name, dtype, shape, start, end) per tensor of a flattened bucket, and its size.

    A tensor must start at a multiple of its element size (SGLang 0.5.23's rule; a
    ``view(dtype)`` at any other offset fails anyway)."""
    out, off = [], 0
    for name, d, s in zip(names, dtypes, shapes, strict=True):
        d, s = as_dtype(d), tuple(int(x) for x in s)
        if any(x < 0 for x in s):
            raise ValueError(f"Negative dimension in received tensor {name}: {s}")
        if off % d.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {off}, dtype {d}")
        size = torch.Size(s).numel() * d.itemsize
        out.append((name, d, s, off, off + size))
        off += size
    return out, off


class FlatBucket:
    """Sender side of a ``flattened_bucket`` update: tensors are copied into one
    preallocated buffer as they come, so a sync holds one bucket, not a list of tensors
    plus their concatenation. A tensor that would start at a misaligned offset (a wider
    dtype after a narrower one) or overflow the buffer does not fit: send, then clear."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = int(capacity)
        self.device = device
        self.buf: torch.Tensor | None = None  # allocated on first use, reused after clear()
        self.names: list[str] = []
        self.dtypes: list[str] = []
        self.shapes: list[list[int]] = []
        self.size = 0

    def fits(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        d = dtype or t.dtype
        return self.size % d.itemsize == 0 and self.size + t.numel() * d.itemsize <= self.capacity

    def add(self, name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        d = dtype or t.dtype
        if not self.fits(t, d):
            raise ValueError(f"{name} does not fit the bucket (at byte {self.size} of {self.capacity})")
        if self.buf is None:
            self.buf = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        n = t.numel() * d.itemsize
        self.buf[self.size:self.size + n].view(d).view(t.shape).copy_(t)
        self.names.append(name)
        self.dtypes.append(str(d).replace("torch.", ""))
        self.shapes.append(list(t.shape))
        self.size += n

    def flat(self) -> torch.Tensor:
        return self.buf[:self.size]

    def clear(self) -> None:
        self.names, self.dtypes, self.shapes, self.size = [], [], [], 0

    def release(self) -> None:
        self.clear()
        self.buf = None


def send_tensors(group: WeightUpdateGroup, named_tensors) -> None:
    """Trainer side of a per-tensor update (no load_format): one broadcast per tensor."""
    for _, t in named_tensors:
        group.broadcast(t.detach().to(group.device).contiguous())


def describe(named_tensors) -> dict:
    """The request fields (names, dtypes, shapes) describing a list of tensors."""
    return {
        "names": [n for n, _ in named_tensors],
        "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
    }
