"""Small shared pieces of the converters: the error type, dtypes, sizes, memory and summaries."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import threading
import warnings
from dataclasses import dataclass, field

import torch

# Bumped whenever the on-disk layout of a converted megatron checkpoint changes in a way a
# reader must know about (file names, metadata fields, key layout).
FORMAT_NAME = "megatron-tg/qwen3-moe/torch_dist"
FORMAT_VERSION = 1
METADATA_FILE = "tg_convert.json"   # not metadata.json: megatron writes that one itself
HF_CONFIG_SUBDIR = "hf_config"      # copies of config.json, tokenizer files, ...


class ConversionError(RuntimeError):
    """The input cannot be converted; the message names the file, field or tensors at fault."""


# safetensors dtype codes <-> torch dtypes (the ones a Qwen3 checkpoint can plausibly hold).
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
ST_CODES = {v: k for k, v in ST_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConversionError(f"unknown dtype {name!r}")
    return dtype


def config_dtype(cfg: dict) -> torch.dtype | None:
    """The dtype an HF config declares (``torch_dtype``; transformers 5 writes ``dtype``)."""
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return dtype_from_name(name) if isinstance(name, str) else None


def nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5e9 bytes (decimal units like transformers' ``max_shard_size``; GiB binary)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    unit = m[2].upper() if m else None
    if unit is not None and unit and not unit.endswith("B"):
        unit += "B"
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot parse size {text!r} (examples: 5GB, 500MB, 2GiB, 1048576)")
    return int(float(m[1]) * _UNITS[unit])


def human_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def name_list(names, limit: int = 12) -> str:
    """A readable, bounded listing of tensor names for error messages."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    return shown + (f", ... and {more} more" if more > 0 else "")


def _proc_status_kb(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class MemoryTracker:
    """Peak memory of this process.

    ``peak_rss`` is the kernel's high-water mark (VmHWM). It includes file-backed pages of
    the safetensors memory maps, which the kernel can drop at any time, so we also sample
    ``RssAnon`` (heap: model shard, copies, buffers) at every tensor: that is the memory
    the process really needs. ``baseline_anon`` is RssAnon after imports and process-group
    setup, before any weights exist (~0.3 GB of torch + megatron on CPU).
    """

    peak_anon_kb: int = 0
    baseline_anon_kb: int = 0
    phases: dict = field(default_factory=dict)

    def mark_baseline(self) -> None:
        self.baseline_anon_kb = _proc_status_kb("RssAnon")
        self.sample()

    def sample(self) -> None:
        self.peak_anon_kb = max(self.peak_anon_kb, _proc_status_kb("RssAnon"))

    def end_phase(self, name: str) -> None:
        """Remember the peak so far under ``name`` (e.g. the load before the export)."""
        self.sample()
        self.phases[name] = self.peak_anon_kb * 1024

    @contextlib.contextmanager
    def watch(self, interval_s: float = 0.01):
        """Sample from a background thread during a call we cannot instrument (megatron's
        save / load, whose transient copies are freed before it returns)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                self.sample()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.sample()

    def report(self) -> dict[str, int]:
        self.sample()
        hwm = _proc_status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"peak_rss": hwm * 1024, "peak_anon": self.peak_anon_kb * 1024,
                "baseline_anon": self.baseline_anon_kb * 1024,
                **{f"peak_anon_{k}": v for k, v in self.phases.items()}}


def build_shard(config: dict, layout, dtype: str, vocab_pad_multiple: int):
    """One conversion rank's start, the same for both directions: this rank's parallel state
    at ``layout``, its memory baseline taken before any weight exists, and its model shard
    (uninitialised: the weights come from the file being converted). Returns
    ``(tracker, arch, model)``."""
    from megatron_tg.models.qwen3_moe import build_model
    from megatron_tg.models.qwen3_moe.config import Qwen3Arch
    from megatron_tg.parallel.state import init_parallel

    mem = MemoryTracker()
    init_parallel(layout)
    mem.mark_baseline()
    arch = Qwen3Arch.from_hf(config)
    model = build_model(arch, tp=layout.tp, ep=layout.ep, pp=layout.pp, etp=layout.etp,
                        params_dtype=dtype_from_name(dtype), perform_initialization=False,
                        vocab_pad_multiple=vocab_pad_multiple)
    return mem, arch, model


def summary_line(verb: str, tensors: int, nbytes_: int, seconds: float, out_dir: str,
                 ranks: list[dict] | None = None) -> str:
    rate = nbytes_ / 1e6 / seconds if seconds > 0 else float("inf")
    line = (f"{verb}: {tensors} tensors, {human_bytes(nbytes_)} in {seconds:.1f} s "
            f"({rate:.1f} MB/s) -> {out_dir}")
    if ranks:
        peak = max(r["memory"]["peak_rss"] for r in ranks)
        anon = max(r["memory"]["peak_anon"] for r in ranks)
        line += (f"; {len(ranks)} ranks, peak RSS per rank {human_bytes(peak)} "
                 f"(anon {human_bytes(anon)})")
    return line


def worker_threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, world))


def silence_known_warnings() -> None:
    """megatron-core warns (at import and per model build) that apex / Transformer Engine
    are absent and about options the converters do not use; torch warns that megatron's
    checkpoint code uses its deprecated ShardedTensor. Noise on the CLI, once per rank."""
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")


@contextlib.contextmanager
def quiet_megatron():
    """:func:`silence_known_warnings` for the duration of a block (the parent process)."""
    with warnings.catch_warnings():
        silence_known_warnings()
        yield


# ------------------------------------------------------------------------------- CLI pieces
def add_layout_arguments(parser, role: str) -> None:
    """``--tp/--ep/--pp/--etp``: the parallel layout a converter writes (or reads) at."""
    for flag, axis in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline")):
        parser.add_argument(f"--{flag}", type=int, default=1, help=f"{axis}-parallel size {role}")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert tensor-parallel size (default: --tp)")


def run_reporting(convert) -> int:
    """Run ``convert()``; print its result's summary (exit 0), or a named input error to
    stderr (exit 2). ``convert`` may return None when it printed its own output."""
    import sys

    from megatron_tg.models.qwen3_moe.config import UnsupportedConfigError
    from megatron_tg.models.qwen3_moe.mapping import MappingError
    from megatron_tg.parallel.dims import LayoutError

    try:
        result = convert()
    except (ConversionError, UnsupportedConfigError, MappingError, LayoutError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        print(result.summary)
    return 0
