"""The weight-transport pieces both ends of a weight update share, whichever engine serves:
the trainer side (:mod:`megatron_tg.rollout.weight_client`, :mod:`megatron_tg.weight_sync.sync`)
and the embedded CPU engine (:mod:`megatron_tg.rollout.engine.weights`) import them from
here, so the production path does not depend on the engine that stands in for SGLang.

* the body of ``/update_weights_from_tensor`` in SGLang 0.5.23's own format (the section
  "tensor payloads" below): each entry of ``serialized_named_tensors`` is what SGLang's
  ``MultiprocessingSerializer.serialize(obj, output_str=True)`` makes, base64 of a
  ``ForkingPickler`` pickle in which tensors are shared, not copied (CUDA tensors as CUDA IPC
  handles, CPU tensors as shared-memory files); with ``load_format="flattened_bucket"`` the
  object is ``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata]}``
  laid out as SGLang's ``FlattenedTensorBucket`` (:func:`serialize_bucket`,
  :func:`deserialize_payload`, :func:`reconstruct_bucket`);
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
import pickle
import re
import signal
import types
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch


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

    def recycle(self) -> None:
        """After the engine's reply to the request that carried this bucket's handles: on
        CUDA a fresh buffer for the next bucket, since a copy the engine queued may still read
        this one (slime's finding), and the IPC handles the engine closed are collected; on
        the host the same buffer is reused (the engine copied it before replying)."""
        if self.device.type == "cuda":
            self.release()
            torch.cuda.ipc_collect()
        else:
            self.clear()


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


# ---- tensor payloads of /update_weights_from_tensor -------------------------------------------
# SGLang 0.5.23: ``UpdateWeightsFromTensorReqInput.serialized_named_tensors`` holds one entry per
# engine TP rank; rank r deserialises entry r alone (``TpModelWorker.deserialize_own_rank``:
# opening another rank's CUDA IPC handle would break the producer's refcounting) with
# ``MultiprocessingSerializer.deserialize`` (base64, then its ``SafeUnpickler``).
LOAD_FORMAT_BUCKET = "flattened_bucket"

_META_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket, with SGLang's field names: byte offsets
    ``[start_idx, end_idx)`` into the uint8 ``flattened_tensor``, ``numel`` its byte count
    (0.5.23 views every tensor as uint8 before concatenating)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __reduce__(self):
        # Pickled as a SimpleNamespace with the same attributes: SGLang's loader
        # (``_update_weights_from_flattened_bucket``) reads only the attributes, its
        # SafeUnpickler admits ``types.SimpleNamespace``, and the sender needs no sglang
        # import (SGLang's own class pickles as a reference into sglang's modules).
        return (types.SimpleNamespace, (), {k: getattr(self, k) for k in _META_FIELDS})


def bucket_metadata(bucket: "FlatBucket") -> list[FlattenedTensorMetadata]:
    """The metadata of a packed :class:`FlatBucket` (same offsets as :func:`bucket_offsets`)."""
    specs, _ = bucket_offsets(bucket.names, bucket.dtypes, bucket.shapes)
    return [FlattenedTensorMetadata(n, torch.Size(s), d, a, b, b - a) for n, d, s, a, b in specs]


def _share_storage_by_name(storage):
    """A CPU storage shared through a named shared-memory file (torch's ``file_system``
    strategy), whatever this process's sharing strategy is.

    The default ``file_descriptor`` strategy hands the fd over a socket that
    ``multiprocessing.resource_sharer`` serves, which admits only processes holding this
    process's ``authkey``: an engine started as its own program (``subprocess``, Slurm) is
    refused (AuthenticationError, measured). A file name opens in any process on the host.
    Mirrors ``torch.multiprocessing.reductions.reduce_storage``'s file_system branch."""
    from torch.multiprocessing import reductions as R

    if storage.device.type != "cpu":
        return R.reduce_storage(storage)  # raises its own error for CUDA/meta storages
    # Moves the data into a shared-memory file once; the storage stays there afterwards.
    metadata = storage._share_filename_cpu_()
    # The receiver decrements this once it has opened the file; until then the file lives.
    storage._shared_incref()
    R.shared_cache[metadata[1]] = R.StorageWeakRef(storage)
    return (R.rebuild_storage_filename, (type(storage),) + metadata)


_MANAGER_PROBE: list = []
# The signals a Slurm step sends its processes to stop them (the trainer's StopFlag handles them).
_STEP_SIGNALS = {signal.SIGUSR1, signal.SIGTERM}


def start_shm_manager() -> None:
    """Start this process's ``torch_shm_manager`` now, with the stop signals blocked, and
    keep it for the process's life.

    The first CPU storage shared by name starts the manager (libshm: fork and exec of
    ``torch_shm_manager``, which the process then talks to over a socket for every storage
    it shares or frees). It is a child of the trainer, so Slurm's ``scancel --signal=USR1``
    to the trainer's step (slurm/lib.sh forwards the time-limit warning that way) reaches
    it too, and USR1's default action kills it: the trainer's next share or free failed
    with ``Broken pipe`` (in the CPU Slurm job, colocated, 4 of 4 runs; the manager's death
    seen with strace). A signal mask survives fork and exec, so a manager started with
    USR1 and TERM blocked never receives them (it still ends with its last client or with
    SIGKILL); the calling thread's own signals are only delayed until the mask is restored.
    One byte stays shared so the manager, which exits 2 s after its last client leaves,
    stays up with the process."""
    if _MANAGER_PROBE:
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STEP_SIGNALS)
    try:
        probe = torch.empty(1, dtype=torch.uint8).untyped_storage()
        probe._share_filename_cpu_()
        _MANAGER_PROBE.append(probe)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# Where torch's ``reduce_tensor`` puts the device in a CUDA tensor's rebuild arguments (torch
# 2.13 and 2.14; SGLang 0.5.23's ``patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX`` is the same 6).
_CUDA_DEVICE_ARG = 6


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as this process numbers it (SGLang's ``_device_to_uuid``)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _reduce_tensor_by_uuid(tensor):
    """torch's ``reduce_tensor``, with a CUDA tensor's device written as its UUID.

    What SGLang's own senders do (``monkey_patch_torch_reductions``, as slime applies it before
    serialising): the device index in a CUDA IPC handle is the sender's numbering, which names
    another GPU in an engine process whose ``CUDA_VISIBLE_DEVICES`` differs. SGLang patches its
    reader the same way before every ``update_weights_from_tensor`` (the patched
    ``rebuild_cuda_tensor`` maps a UUID string back to its own index and passes an int through),
    so the pickle names torch's ``rebuild_cuda_tensor``, which resolves to the patched one
    there. CPU tensors are left to torch (their storages are shared by name, below)."""
    from torch.multiprocessing import reductions as R

    fn, args = R.reduce_tensor(tensor)
    if fn is R.rebuild_cuda_tensor and isinstance(args[_CUDA_DEVICE_ARG], int):
        args = (*args[:_CUDA_DEVICE_ARG], device_uuid(args[_CUDA_DEVICE_ARG]), *args[_CUDA_DEVICE_ARG + 1:])
    return fn, args


def _forking_pickler():
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions)

    class _Pickler(ForkingPickler):
        def __init__(self, file):
            super().__init__(file)
            self.dispatch_table[torch.UntypedStorage] = _share_storage_by_name
            for cls in (torch.Tensor, torch.nn.Parameter):
                self.dispatch_table[cls] = _reduce_tensor_by_uuid

    return _Pickler


def serialize(obj) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: base64 (UTF-8
    text) of a ForkingPickler pickle. Tensors travel as handles, never as data: CUDA tensors
    as CUDA IPC handles (torch's ``reduce_tensor``), CPU tensors as shared-memory file names.
    The tensors must stay alive, unchanged, until the engine has answered the request that
    carries them (it opens the handles and copies while the request runs)."""
    buf = io.BytesIO()
    _forking_pickler()(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def serialize_bucket(bucket: "FlatBucket") -> str:
    """One ``serialized_named_tensors`` entry for ``load_format="flattened_bucket"``."""
    if not bucket.names:
        raise ValueError("Cannot create empty tensor bucket")
    return serialize({"flattened_tensor": bucket.flat(), "metadata": bucket_metadata(bucket)})


def _allowed_global(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED_GLOBALS:
        return True
    if module == "torch":  # dtypes and storage classes, not torch's functions
        obj = getattr(torch, name, None)
        return isinstance(obj, torch.dtype) or obj in getattr(torch, "_storage_classes", ())
    return False


# What a payload of tensors, dicts, lists and metadata needs: a subset of SGLang 0.5.23's
# ``SafeUnpickler.ALLOWED_GLOBALS``, so that nothing but data can be rebuilt. CUDA handles
# (``rebuild_cuda_tensor``) are left out: a CPU process cannot open them.
_ALLOWED_GLOBALS = frozenset({
    ("builtins", "list"), ("builtins", "dict"), ("builtins", "tuple"), ("builtins", "int"),
    ("builtins", "str"), ("builtins", "bool"), ("builtins", "float"), ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("types", "SimpleNamespace"), ("torch", "Size"), ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("multiprocessing.resource_sharer", "DupFd"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
})
# SGLang's own metadata class (what slime sends) is read as ours: same fields.
_SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, file, opened: list[str] | None = None):
        super().__init__(file)
        self.opened = opened

    def find_class(self, module, name):
        if (module, name) == _SGLANG_METADATA:
            return FlattenedTensorMetadata
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename") and \
                self.opened is not None:
            return self._recording_rebuild
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") or \
                (module, name) == ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"):
            raise ValueError("the payload holds CUDA IPC handles, which only a process on that GPU can open")
        if _allowed_global(module, name):
            return super().find_class(module, name)
        raise ValueError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


    def _recording_rebuild(self, cls, manager, handle, size, dtype=None):
        from torch.multiprocessing import reductions as R

        self.opened.append(handle.decode() if isinstance(handle, bytes) else str(handle))
        return R.rebuild_storage_filename(cls, manager, handle, size, dtype)


def deserialize_payload(payload: str | bytes, opened: list[str] | None = None):
    """SGLang's ``MultiprocessingSerializer.deserialize``: base64 text (validated) or raw
    pickle bytes, read by an unpickler that rebuilds only tensors and plain data.

    ``opened``: the name of every shared-memory file the payload's tensors open is appended
    there (:func:`shm_owner_pid` reads which process made it)."""
    import torch.multiprocessing  # noqa: F401  (the rebuild functions live there)

    data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    return _SafeUnpickler(io.BytesIO(data), opened).load()


_SHM_NAME = re.compile(r"^/torch_(\d+)_")


def shm_owner_pid(name: str) -> int | None:
    """The process that made a shared-memory file of torch's ``file_system`` strategy: torch
    names them ``/torch_<pid>_<random>_<counter>`` (``at::NewProcessWideShmHandle``), the pid
    being the creator's; None for another name."""
    m = _SHM_NAME.match(name)
    return int(m.group(1)) if m else None


def reconstruct_bucket(obj) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a ``flattened_bucket`` payload, as SGLang's
    ``FlattenedTensorBucket.reconstruct_tensors`` makes them, after the checks its
    ``FlattenedTensorBucket.empty`` makes of a received bucket (no negative dimension,
    each tensor at a multiple of its element size, offsets matching shapes and inside the
    buffer)."""
    if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
        raise ValueError("a flattened_bucket payload is a dict with 'flattened_tensor' and 'metadata'")
    flat, out = obj["flattened_tensor"], []
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
    for m in obj["metadata"]:
        name, d, s = str(m.name), as_dtype(m.dtype), torch.Size(m.shape)
        size = s.numel() * d.itemsize
        if any(x < 0 for x in s):
            raise ValueError(f"Negative dimension in received tensor {name}: {tuple(s)}")
        if m.start_idx % d.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {m.start_idx}, dtype {d}")
        if m.end_idx - m.start_idx != size or not 0 <= m.start_idx <= m.end_idx <= flat.numel():
            raise ValueError(f"tensor {name}: bytes [{m.start_idx}, {m.end_idx}) do not hold {tuple(s)} {d} "
                             f"inside a {flat.numel()}-byte bucket")
        out.append((name, flat[m.start_idx:m.end_idx].view(d).reshape(s)))
    return out
