"""Weight updates for the embedded engine: name mapping, disk / tensor / gloo transports.

Names are **Hugging Face checkpoint names** (what ``save_pretrained`` writes and what
SGLang's ``load_weights`` accepts), e.g. ``model.layers.0.mlp.experts.3.up_proj.weight``.
transformers 5.x keeps MoE experts fused in memory (``experts.gate_up_proj`` [E, 2I, H]
= cat(gate, up) per expert, ``experts.down_proj`` [E, H, I]); per-expert checkpoint
names are written into the matching slice. In-memory names are accepted too.

CPU transport for ``/update_weights_from_distributed``: SGLang broadcasts each tensor
from the trainer (rank 0) over an NCCL group made by ``/init_weights_update_group``.
Here the group is gloo over TCP (a ``TCPStore`` rendezvous at master_address:port,
prefixed by group_name, then ``ProcessGroupGloo``), and the wire protocol is the same:
one broadcast per tensor in request order, or, with ``load_format="flattened_bucket"``,
one uint8 buffer holding the tensors back to back. The group is standalone (no default
process group), so a trainer that already runs torch.distributed can join it too.
Both sides should build it with :func:`create_weight_update_group`.
"""

from __future__ import annotations

import base64
import glob
import io
import os
import re
from datetime import timedelta

import torch

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class WeightLoader:
    """Copies named checkpoint tensors into a live model in place."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # remove_duplicate=False keeps tied names (lm_head.weight) addressable.
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.params.update(dict(model.named_buffers(remove_duplicate=False)))

    def _target(self, name: str) -> torch.Tensor:
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
        raise KeyError(f"no parameter matches weight name {name!r}")

    @torch.no_grad()
    def load(self, named_tensors) -> int:
        """Validate every tensor first, then copy, so a bad batch changes nothing."""
        pairs = []
        for name, tensor in named_tensors:
            target = self._target(name)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {name}: model {tuple(target.shape)}, got {tuple(tensor.shape)}")
            pairs.append((target, tensor))
        for target, tensor in pairs:
            target.copy_(tensor.to(dtype=target.dtype))
        return len(pairs)


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


def _dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def create_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 300.0,
):
    """A standalone gloo process group; rank 0 (the trainer) hosts the TCPStore."""
    import torch.distributed as dist

    if backend != "gloo":
        raise ValueError(f"the embedded CPU engine supports backend='gloo' only, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Bind gloo to the address the master is reached at when it is loopback (tests, one
    # host); otherwise let gloo pick the host's interface (GLOO_SOCKET_IFNAME overrides).
    if master_address in ("127.0.0.1", "localhost") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return WeightUpdateGroup(dist.ProcessGroupGloo(store, rank, world_size, opts), store, rank, world_size)


class WeightUpdateGroup:
    """A gloo group plus the store it was built on (the store must outlive the group)."""

    def __init__(self, pg, store, rank: int, world_size: int):
        self.pg, self.store, self.rank, self.world_size = pg, store, rank, world_size

    def close(self) -> None:
        self.pg = self.store = None


def broadcast_tensor(group: WeightUpdateGroup, tensor: torch.Tensor, src: int = 0) -> None:
    # gloo silently corrupts broadcasts of non-contiguous tensors (see docs/measurements.md).
    assert tensor.is_contiguous()
    group.pg.broadcast(tensor, src).wait()


def receive_broadcast(pg, names, dtypes, shapes, load_format: str | None = None):
    """Engine side of one update: allocate and receive tensors broadcast from rank 0."""
    specs = [(n, _dtype(d), tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)]
    if load_format == "flattened_bucket":
        sizes = [torch.Size(s).numel() * d.itemsize for _, d, s in specs]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        broadcast_tensor(pg, flat)
        out, off = [], 0
        for (n, d, s), size in zip(specs, sizes):
            out.append((n, flat[off:off + size].view(d).view(s)))
            off += size
        return out
    out = []
    for n, d, s in specs:
        t = torch.empty(s, dtype=d)
        broadcast_tensor(pg, t)
        out.append((n, t))
    return out


def send_broadcast(pg, named_tensors, load_format: str | None = None) -> None:
    """Trainer side of one update: the counterpart of :func:`receive_broadcast`."""
    tensors = [t.detach().cpu().contiguous() for _, t in named_tensors]
    if load_format == "flattened_bucket":
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
        broadcast_tensor(pg, flat)
        return
    for t in tensors:
        broadcast_tensor(pg, t)


def describe(named_tensors) -> dict:
    """The request fields (names, dtypes, shapes) describing a list of tensors."""
    return {
        "names": [n for n, _ in named_tensors],
        "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
    }
