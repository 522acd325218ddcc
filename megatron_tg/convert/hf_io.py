"""Hugging Face safetensors checkpoints: validation, lazy reading, and streaming writing.

Reading. :class:`HFCheckpoint` parses only the safetensors *headers* (a few KB per file),
so the parent process can refuse a bad checkpoint before any worker starts: a truncated
file (header offsets past the end of the file), an index naming tensors a file lacks,
missing or unexpected tensor names, wrong shapes. :class:`LazyReader` then gives workers
one tensor (or one slice) at a time through ``safetensors.safe_open``.

Writing. The safetensors format puts every tensor's offsets in a header *before* the data,
which is why libraries buffer a whole shard in memory. The exporter knows every tensor's
name, dtype and shape in advance (it derives them from the model's parameter shapes), so
:class:`StreamingSafetensorsWriter` writes the header first and then appends tensors as
they are produced: memory is one tensor, whatever the shard size.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from megatron_tg.convert.common import ST_CODES, ST_DTYPES, ConversionError, name_list, nbytes
from megatron_tg.models.qwen3_moe.config import Qwen3Arch
from megatron_tg.models.qwen3_moe.mapping import expected_hf_names

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER = 100 * 2**20  # safetensors' own limit

# Files copied next to a converted checkpoint so that export can restore a complete HF dir.
MODEL_FILES = ("config.json", "generation_config.json")  # the model's, not the tokenizer's
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer*", "vocab*", "merges.txt",
              "special_tokens_map.json", "added_tokens.json", "chat_template*",
              "preprocessor_config.json")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str          # file name relative to the checkpoint dir
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def read_header(path: Path) -> dict:
    """Parse and validate one safetensors header against the file's real size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path.name}: truncated safetensors file ({size} bytes, "
                                  "no header)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > _MAX_HEADER or 8 + hlen > size:
            raise ConversionError(f"{path.name}: truncated or corrupt safetensors file (header "
                                  f"of {hlen} bytes, file has {size} bytes)")
        try:
            header = json.loads(f.read(hlen))
        except ValueError as exc:
            raise ConversionError(f"{path.name}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path.name}: safetensors header is a JSON "
                              f"{type(header).__name__}, not an object of tensor entries")
    header.pop("__metadata__", None)
    data = size - 8 - hlen
    spans: list[tuple[int, int, str]] = []
    for name, v in header.items():
        lo, hi = _entry_span(path.name, name, v)
        if v["dtype"] not in ST_DTYPES:
            raise ConversionError(f"{path.name}: tensor {name} has unsupported dtype {v['dtype']}")
        if hi - lo != nbytes(v["shape"], ST_DTYPES[v["dtype"]]):
            raise ConversionError(f"{path.name}: tensor {name} has inconsistent offsets "
                                  f"({lo}, {hi}) for shape {v['shape']} {v['dtype']}")
        spans.append((lo, hi, name))
    end = max((hi for _, hi, _ in spans), default=0)
    if end > data:
        raise ConversionError(
            f"{path.name}: truncated safetensors file: its header describes {end} bytes of "
            f"tensor data but the file holds {data} ({size} bytes on disk, "
            f"{end - data} missing)")
    # safetensors' own loader refuses overlapping tensors; refuse them here too, in the
    # parent, rather than in a worker half-way through a conversion.
    spans.sort()
    for (lo0, hi0, a), (lo1, hi1, b) in zip(spans, spans[1:]):
        if lo1 < hi0 and hi1 > lo1:
            raise ConversionError(f"{path.name}: tensors {a} [{lo0}, {hi0}) and {b} "
                                  f"[{lo1}, {hi1}) overlap")
    return header


def _entry_span(fname: str, name: str, v) -> tuple[int, int]:
    """A header entry's ``data_offsets``, after checking the entry has the fields safetensors
    defines (``dtype``, ``shape``, ``data_offsets``) with the right types."""
    if not isinstance(v, dict):
        raise ConversionError(f"{fname}: header entry {name!r} is a JSON "
                              f"{type(v).__name__}, not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in v]
    if missing:
        raise ConversionError(f"{fname}: header entry {name!r} lacks {', '.join(missing)}")
    shape, offs = v["shape"], v["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)):
        raise ConversionError(f"{fname}: tensor {name} has a bad shape {shape!r}")
    if not (isinstance(offs, list) and len(offs) == 2
            and all(isinstance(x, int) and x >= 0 for x in offs) and offs[0] <= offs[1]):
        raise ConversionError(f"{fname}: tensor {name} has bad data_offsets {offs!r}")
    return offs[0], offs[1]


class HFCheckpoint:
    """The tensor catalogue of an HF model directory (single file or sharded with an index)."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise ConversionError(f"{index}: not a safetensors index ({exc})") from None
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_FILE).exists():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise ConversionError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE} "
                                  "(only safetensors checkpoints are supported)")
        self.entries: dict[str, TensorEntry] = {}
        for fname in files:
            path = self.dir / fname
            if not path.exists():
                raise ConversionError(f"{INDEX_FILE} names {fname}, which does not exist")
            for name, v in read_header(path).items():
                if weight_map is not None and weight_map.get(name) != fname:
                    continue  # the index is authoritative about which copy counts
                self.entries[name] = TensorEntry(name, fname, ST_DTYPES[v["dtype"]],
                                                 tuple(v["shape"]))
        if weight_map is not None:
            lost = [n for n in weight_map if n not in self.entries]
            if lost:
                raise ConversionError(f"{INDEX_FILE} lists tensors that its files do not hold: "
                                      f"{name_list(lost)}")
        self.files = files

    def reader_entries(self) -> dict[str, tuple[str, str, tuple[int, ...]]]:
        """The catalogue in the plain form :class:`LazyReader` takes (sent to workers)."""
        return {n: (e.file, ST_CODES[e.dtype], e.shape) for n, e in self.entries.items()}

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def dtype(self) -> torch.dtype:
        """The checkpoint's dtype: the one most bytes are stored in."""
        by: dict[torch.dtype, int] = {}
        for e in self.entries.values():
            by[e.dtype] = by.get(e.dtype, 0) + e.nbytes
        return max(by, key=by.get)

    def validate(self, arch: Qwen3Arch) -> None:
        """Refuse missing or unexpected tensors and wrong shapes, naming them."""
        expected = expected_hf_shapes(arch)
        missing = [n for n in expected if n not in self.entries]
        unexpected = [n for n in self.entries if n not in expected]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing tensor(s): {name_list(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected tensor(s): {name_list(unexpected)}")
        wrong = [f"{n} {self.entries[n].shape} (expected {s})" for n, s in expected.items()
                 if n in self.entries and self.entries[n].shape != s]
        if wrong:
            problems.append(f"{len(wrong)} tensor(s) with the wrong shape: {name_list(wrong)}")
        if problems:
            raise ConversionError(f"{self.dir} does not match its config.json "
                                  f"({arch.model_type}, {arch.num_layers} layers, "
                                  f"{arch.num_experts} experts): " + "; ".join(problems))


def expected_hf_shapes(arch: Qwen3Arch) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor an HF checkpoint of ``arch`` holds (same keys as the mapping's)."""
    h, v, hd = arch.hidden_size, arch.vocab_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    shapes = {}
    for name in expected_hf_names(arch):
        leaf = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            s = (v, h)
        elif leaf in ("q_proj.weight", "q_proj.bias"):
            s = (q, h) if leaf.endswith("weight") else (q,)
        elif leaf in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
            s = (kv, h) if leaf.endswith("weight") else (kv,)
        elif leaf == "o_proj.weight":
            s = (h, q)
        elif leaf in ("q_norm.weight", "k_norm.weight"):
            s = (hd,)
        elif leaf == "gate.weight":
            s = (arch.num_experts, h)
        elif leaf in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            inter = arch.moe_intermediate_size if ".experts." in name else arch.intermediate_size
            s = (h, inter) if leaf == "down_proj.weight" else (inter, h)
        else:  # the norms
            s = (h,)
        shapes[name] = s
    return shapes


class LazyReader:
    """One tensor (or one slice) at a time from the files of an :class:`HFCheckpoint`.

    ``view`` returns a tensor backed by ``safe_open``'s memory map: no copy is made until
    the caller copies it into its destination, and only the pages of the requested rows
    are touched. Touched pages stay mapped (and count in RSS) while the handle lives; they
    are page cache, not heap, but to keep RSS a faithful picture of what a worker needs,
    :meth:`release` (called between tensors) drops every handle after ``reopen_bytes``
    (256 MB) of reads.
    """

    def __init__(self, model_dir: str | os.PathLike,
                 entries: dict[str, tuple[str, str, tuple[int, ...]]],
                 reopen_bytes: int = 256 << 20):
        self.dir = Path(model_dir)
        self.entries = entries  # name -> (file, safetensors dtype code, shape): picklable
        self.reopen_bytes = reopen_bytes
        self._handles: dict[str, object] = {}
        self._since_reopen = 0
        self.bytes_read = 0
        self.tensors_read = 0

    def _handle(self, name: str):
        from safetensors import safe_open

        try:
            fname = self.entries[name][0]
        except KeyError:
            raise KeyError(name) from None
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.dir / fname, framework="pt")
        return self._handles[fname]

    def view(self, name: str, *index) -> torch.Tensor:
        """``tensor[index]`` (whole tensor without an index), valid until :meth:`release`."""
        h = self._handle(name)
        t = h.get_slice(name)[index] if index else h.get_tensor(name)
        n = t.numel() * t.element_size()
        self.bytes_read += n
        self.tensors_read += 1
        self._since_reopen += n
        return t

    def get(self, name: str, *index) -> torch.Tensor:
        """Like :meth:`view`, but an owned copy."""
        t = self.view(name, *index).clone(memory_format=torch.contiguous_format)
        self.release()
        return t

    def release(self) -> None:
        """The caller holds no more views: unmap the files if enough has been read."""
        if self._since_reopen >= self.reopen_bytes:
            self.close()

    def close(self) -> None:
        self._handles.clear()
        self._since_reopen = 0


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike,
                    skip: tuple[str, ...] = ()) -> list[str]:
    """Copy config/tokenizer files (see :data:`SIDE_FILES`) from ``src`` to ``dst``, except
    the names in ``skip``."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(src.iterdir()):
        if path.name in skip:
            continue
        if path.is_file() and any(fnmatch.fnmatch(path.name, p) for p in SIDE_FILES):
            shutil.copy2(path, dst / path.name)
            copied.append(path.name)
    return copied


# ------------------------------------------------------------------------------- writing

@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def pack_files(tensors: Iterable[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Split an ordered tensor list into consecutive runs of at most ``max_bytes`` each
    (a single larger tensor gets a file of its own), like transformers' sharding."""
    files: list[list[PlannedTensor]] = []
    size = 0
    for t in tensors:
        if not files or (size + t.nbytes > max_bytes and files[-1]):
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


class StreamingSafetensorsWriter:
    """Write one safetensors file whose tensors arrive one by one, in the planned order."""

    def __init__(self, path: str | os.PathLike, plan: list[PlannedTensor],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.plan = plan
        self._next = 0
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for t in plan:
            header[t.name] = {"dtype": ST_CODES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    @property
    def done(self) -> bool:
        return self._next == len(self.plan)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.done:
            raise RuntimeError(f"{self.path.name}: no more tensors planned, got {name}")
        want = self.plan[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want.name, want.dtype, want.shape):
            raise RuntimeError(f"{self.path.name}: expected {want}, got {name} "
                               f"{tensor.dtype} {tuple(tensor.shape)}")
        if tensor.numel():
            self._f.write(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
        self._next += 1

    def close(self) -> None:
        self._f.close()
        if not self.done:
            raise RuntimeError(f"{self.path.name}: closed after {self._next} of "
                               f"{len(self.plan)} tensors")
