"""Weight updates: name mapping and loading for the embedded engine, and the weight-update
group transport both sides of ``/update_weights_from_distributed`` use.

Names are **Hugging Face checkpoint names** (what ``save_pretrained`` writes and what
SGLang's ``load_weights`` accepts), e.g. ``model.layers.0.mlp.experts.3.up_proj.weight``.
transformers 5.x keeps MoE experts fused in memory (``experts.gate_up_proj`` [E, 2I, H]
= cat(gate, up) per expert, ``experts.down_proj`` [E, H, I]); per-expert checkpoint
names are written into the matching slice. In-memory names are accepted too. Like
SGLang's Qwen3-MoE loader, a name that matches no parameter is skipped, not an error
(so a naming bug serves stale weights there too; :class:`WeightChecker` and the sync's
log-prob probe are what catch it).

The weight-update group (trainer rank 0 plus every engine GPU) is formed by
:func:`init_weight_update_group` exactly the way SGLang's ``init_custom_process_group``
forms it on each engine GPU, so the two sides find each other's store keys. Tensors
are broadcast from rank 0 one by one in request order, or, with
``load_format="flattened_bucket"``, as one uint8 buffer holding the tensors back to back
with no padding, each starting at a byte offset that is a multiple of its element size
(SGLang 0.5.23 refuses anything else; :class:`FlatBucket` packs that way).
"""

from __future__ import annotations

import base64
import glob
import io
import logging
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch

log = logging.getLogger(__name__)

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class WeightLoader:
    """Copies named checkpoint tensors into a live model in place."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # remove_duplicate=False keeps tied names (lm_head.weight) addressable.
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.params.update(dict(model.named_buffers(remove_duplicate=False)))

    def target(self, name: str) -> torch.Tensor | None:
        """The parameter (or expert slice of one) a checkpoint name addresses; None if none."""
        if name in self.params:
            return self.params[name]
        m = _EXPERT_RE.match(name)
        if m:
            prefix, e, proj = m["prefix"], int(m["e"]), m["proj"]
            if proj == "down_proj" and f"{prefix}.down_proj" in self.params:
                return self.params[f"{prefix}.down_proj"][e]
            fused = self.params.get(f"{prefix}.gate_up_proj")
            if fused is not None:
                half = fused.shape[1] // 2
                return fused[e, :half] if proj == "gate_proj" else fused[e, half:]
        return None

    @torch.no_grad()
    def load(self, named_tensors) -> tuple[int, list[str]]:
        """Copy every known name; returns (tensors loaded, names skipped).

        Shapes are checked for the whole batch before anything is copied, so a bad batch
        changes nothing. Unknown names are skipped as SGLang's loader skips them."""
        pairs, skipped = [], []
        for name, tensor in named_tensors:
            target = self.target(name)
            if target is None:
                skipped.append(name)
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {name}: model {tuple(target.shape)}, got {tuple(tensor.shape)}")
            pairs.append((target, tensor))
        for target, tensor in pairs:
            target.copy_(tensor.to(dtype=target.dtype))
        if skipped:
            log.warning("skipped %d weight names that match no parameter: %s", len(skipped), skipped[:8])
        return len(pairs), skipped


# Buffers SGLang's weight checker leaves out (derived from shapes, not loaded weights).
_CHECKER_SKIP = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")


def tensor_checksum(t: torch.Tensor) -> str:
    """SGLang 0.5.23's per-tensor checksum on CPU (``mm_utils.tensor_hash``, formatted as
    ``weight_checker._hash_tensor``): the first 8 bytes of the SHA-256 of its bytes, hex."""
    import hashlib

    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], 'big'):016x}"


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's ``weight_checker.overall_checksum`` (sorted names, each name then its hash)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


class WeightChecker:
    """SGLang's ``/weights_checker`` actions on the embedded model: ``snapshot`` copies every
    parameter and buffer, ``reset_tensors`` overwrites them with random values, ``compare``
    raises naming each tensor that differs from the snapshot, ``checksum`` returns a hash per
    tensor in SGLang's reply shape (one rank: this process). snapshot -> reset -> sync ->
    compare, or checksum -> reset -> sync -> checksum, name every weight a sync did not write."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.snapshot_tensors: dict[str, torch.Tensor] | None = None

    def _state(self, skip: list[str] | None):
        pats = _CHECKER_SKIP + tuple(skip or ())
        for name, t in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            if not any(p in name for p in pats):
                yield name, t

    @torch.no_grad()
    def handle(self, action: str, skip_tensor_list: list[str] | None = None) -> list[dict] | None:
        """None, or for ``checksum`` the ``ranks`` list of SGLang's reply (ChecksumInfo per rank)."""
        if action == "checksum":
            sums = {n: tensor_checksum(t) for n, t in self._state(skip_tensor_list)}
            placement = dict(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)
            return [{"checksums": sums, "per_gpu_checksum": overall_checksum(sums),
                     "parallelism_info": [{"role": "target", **placement}]}]
        if action == "snapshot":
            self.snapshot_tensors = {n: t.detach().clone() for n, t in self._state(skip_tensor_list)}
        elif action == "reset_tensors":
            for _, t in self._state(skip_tensor_list):
                t.copy_(torch.rand(t.shape).to(t.dtype) if t.dtype.is_floating_point
                        else torch.randint(0, 2, t.shape).to(t.dtype))
        elif action == "compare":
            if self.snapshot_tensors is None:
                raise ValueError("compare needs a snapshot first")
            bad = [n for n, t in self._state(skip_tensor_list) if not torch.equal(t, self.snapshot_tensors[n])]
            self.snapshot_tensors = None
            if bad:
                raise ValueError("check tensor equality failed: " + ", ".join(f"name={n}" for n in bad))
        else:
            raise ValueError(f"Unsupported action={action!r}")


def iter_checkpoint(model_path: str):
    """(name, tensor) pairs from a directory of safetensors files."""
    from safetensors.torch import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


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
    :class:`~megatron_tg.rollout.engine.store_gate.StoreGate` on ``master_port`` that admits
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


def receive_broadcast(group: WeightUpdateGroup, names, dtypes, shapes, load_format: str | None = None):
    """Engine side of one update: allocate and receive tensors broadcast from rank 0."""
    if load_format == "flattened_bucket":
        specs, total = bucket_offsets(names, dtypes, shapes)
        if not specs:
            raise ValueError("Cannot create empty tensor bucket")
        flat = torch.empty(total, dtype=torch.uint8, device=group.device)
        group.broadcast(flat)
        return [(n, flat[a:b].view(d).view(s)) for n, d, s, a, b in specs]
    out = []
    for n, d, s in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(tuple(int(x) for x in s), dtype=as_dtype(d), device=group.device)
        group.broadcast(t)
        out.append((n, t))
    return out


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
