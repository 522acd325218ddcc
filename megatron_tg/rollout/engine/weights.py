"""Weight updates in the embedded engine: name mapping, loading, checksums, and receiving.

Names are **Hugging Face checkpoint names** (what ``save_pretrained`` writes and what
SGLang's ``load_weights`` accepts), e.g. ``model.layers.0.mlp.experts.3.up_proj.weight``.
transformers 5.x keeps MoE experts fused in memory (``experts.gate_up_proj`` [E, 2I, H]
= cat(gate, up) per expert, ``experts.down_proj`` [E, H, I]); per-expert checkpoint
names are written into the matching slice. In-memory names are accepted too. Like
SGLang's Qwen3-MoE loader, a name that matches no parameter is skipped, not an error
(so a naming bug serves stale weights there too; :class:`WeightChecker` and the sync's
log-prob probe are what catch it).

The engine's end of ``/update_weights_from_distributed`` is :func:`receive_broadcast`; the
group it receives on and the bucket layout are in :mod:`megatron_tg.rollout.transport`, which
the trainer side uses too.
"""

from __future__ import annotations

import glob
import logging
import os
import re

import torch

from megatron_tg.rollout.transport import WeightUpdateGroup, as_dtype, bucket_offsets

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


def first_difference(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> str | None:
    """None if two payloads' tensors are bit-identical (names, dtypes, shapes, bytes; NaNs
    compare by their bits), else the first difference."""
    if [n for n, _ in a] != [n for n, _ in b]:
        return f"tensor names {[n for n, _ in b][:8]} instead of {[n for n, _ in a][:8]}"
    for (name, x), (_, y) in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"tensor {name} is {y.dtype} {tuple(y.shape)} instead of {x.dtype} {tuple(x.shape)}"
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return f"tensor {name} holds other bytes"
    return None


class PayloadAccounting:
    """What ``/update_weights_from_tensor`` opened, for ``/server_info`` (not an SGLang key):
    requests, payloads opened, and which processes made the shared memory of each TP rank's
    payload (torch's shared-memory file names carry the creator's pid), so a test can tell
    that N payloads came from N trainer processes."""

    def __init__(self) -> None:
        self.requests = 0
        self.payloads_opened = 0
        self.last_senders: list[list[int]] = []  # per TP rank of the last request: creator pids
        self.sender_pids: set[int] = set()

    def record(self, opened: list[list[str]]) -> None:
        from megatron_tg.rollout.transport import shm_owner_pid

        self.requests += 1
        self.payloads_opened += len(opened)
        self.last_senders = [sorted({p for p in map(shm_owner_pid, names) if p is not None})
                             for names in opened]
        for pids in self.last_senders:
            self.sender_pids.update(pids)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "payloads_opened": self.payloads_opened,
                "last_senders": self.last_senders, "sender_pids": sorted(self.sender_pids)}


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
