"""Hugging Face Qwen3(-MoE) safetensors -> megatron-core torch_dist checkpoint.

Design:
- The parent process reads only config.json and the safetensors *headers*, and refuses
  bad input (unsupported config field, truncated file, missing/unexpected/misshapen
  tensors, occupied output dir) before any worker starts or anything is written.
- ``ParallelDims.smallest_world`` (``pp * lcm(tp, ep * etp)``) gloo workers (spawned, loopback) each build only their
  megatron shard (``perform_initialization=False``: no random init), fill it from the HF
  tensors it needs (sliced reads copied from the file's memory map straight into the
  parameters, one at a time, :mod:`.slicing`), and call
  ``dist_checkpointing.save(model.sharded_state_dict(), dir)`` together. Peak memory per
  worker is its shard plus megatron's save-time copies (a fraction of the shard, measured
  in benchmarks/README.md), not the model.
- torch_dist stores every tensor with its *global* shape and offsets, so megatron reshards
  on load: the checkpoint loads at any TP/EP/PP, whatever layout wrote it.
- Output goes to a temporary sibling dir renamed into place at the end (:mod:`.outdir`),
  with ``tg_convert.json`` (:mod:`.metadata`) and copies of config/tokenizer files in
  ``hf_config/`` so that export can restore a complete HF directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_tg.convert.common import (
    HF_CONFIG_SUBDIR,
    ConversionError,
    add_layout_arguments,
    build_shard,
    dtype_from_name,
    dtype_name,
    quiet_megatron,
    run_reporting,
    summary_line,
)
from megatron_tg.convert.hf_io import HFCheckpoint, LazyReader, copy_side_files
from megatron_tg.convert.launch import launch
from megatron_tg.convert.metadata import arch_dict, write_metadata
from megatron_tg.convert.outdir import check_output_dir, staged_output
from megatron_tg.models.qwen3_moe.config import Qwen3Arch, load_hf_config_dict
from megatron_tg.parallel.dims import ParallelDims


@dataclass(frozen=True)
class WriteJob:
    hf_dir: str
    entries: dict            # LazyReader catalogue: name -> (file, dtype code, shape)
    config: dict
    layout: ParallelDims
    dtype: str               # megatron params dtype
    out_dir: str             # the temporary dir
    vocab_pad_multiple: int = 128
    progress: bool = True


@dataclass
class ConversionResult:
    out_dir: str
    tensors: int
    bytes: int
    seconds: float
    ranks: list[dict[str, Any]] = field(default_factory=list)
    summary: str = ""


def _write_worker(rank: int, world: int, job: WriteJob) -> dict[str, Any]:
    """One rank: build this shard, fill it from the HF files, save collectively."""
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from megatron_tg.convert.slicing import read_shard_into
    from megatron_tg.models.qwen3_moe.mapping import current_layout
    from megatron_tg.parallel.state import destroy_parallel

    t0 = time.perf_counter()
    mem, arch, model = build_shard(job.config, job.layout, job.dtype, job.vocab_pad_multiple)
    layout = current_layout(job.vocab_pad_multiple, model=model)  # with the PP layer offset
    params = list(model.named_parameters())
    shard_bytes = sum(p.numel() * p.element_size() for _, p in params)
    t_build = time.perf_counter()
    reader = LazyReader(job.hf_dir, job.entries)
    bar = tqdm(total=shard_bytes, unit="B", unit_scale=True, dynamic_ncols=True,
               desc=f"rank 0/{world} read", disable=rank != 0 or not job.progress)
    for name, p in params:
        read_shard_into(p.data, name, reader, arch, layout)  # straight from the file map
        mem.sample()
        bar.update(p.numel() * p.element_size())
    reader.close()
    mem.end_phase("read")
    bar.set_description(f"rank 0/{world} save")
    t_read = time.perf_counter()
    with mem.watch():
        dist_checkpointing.save(model.sharded_state_dict(), job.out_dir)
    bar.close()
    t_save = time.perf_counter()
    destroy_parallel()
    return {"rank": rank, "params": len(params), "shard_bytes": shard_bytes,
            "hf_tensors_read": reader.tensors_read, "hf_bytes_read": reader.bytes_read,
            "memory": mem.report(),
            "seconds": {"build": t_build - t0, "read": t_read - t_build, "save": t_save - t_read}}


def _load_config(hf_dir: Path) -> dict:
    try:
        return load_hf_config_dict(hf_dir)
    except FileNotFoundError:
        raise ConversionError(f"{hf_dir}: no config.json") from None


def convert_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, ep: int = 1,
                           pp: int = 1, etp: int | None = None, overwrite: bool = False,
                           progress: bool = True, vocab_pad_multiple: int = 128,
                           timeout_s: float | None = None) -> ConversionResult:
    """Convert an HF model dir into a megatron torch_dist checkpoint written at tp/ep/pp."""
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    cfg = _load_config(hf_dir)
    arch = Qwen3Arch.from_hf(cfg, source=str(hf_dir / "config.json"))  # names file + field
    layout = ParallelDims.smallest(tp=tp, ep=ep, pp=pp, etp=etp)
    layout.check_arch(arch)                       # LayoutError names the sizes
    check_output_dir(out_dir, overwrite)          # before reading any tensor data
    ckpt = HFCheckpoint(hf_dir)                   # truncation / index checks
    ckpt.validate(arch)                           # missing / unexpected / shapes
    dtype = ckpt.dtype()
    mixed = sorted({dtype_name(e.dtype) for e in ckpt.entries.values()} - {dtype_name(dtype)})
    if mixed:
        print(f"warning: the checkpoint mixes dtypes; tensors in {', '.join(mixed)} are cast "
              f"to {dtype_name(dtype)} (the round trip is exact only for those in "
              f"{dtype_name(dtype)})", file=sys.stderr)
    job_kwargs = dict(hf_dir=str(hf_dir.absolute()), entries=ckpt.reader_entries(), config=cfg,
                      layout=layout, dtype=dtype_name(dtype),
                      vocab_pad_multiple=vocab_pad_multiple, progress=progress)
    with staged_output(out_dir, overwrite) as tmp:
        ranks = launch(_write_worker, layout.world_size, WriteJob(out_dir=str(tmp), **job_kwargs),
                       timeout_s=timeout_s)
        with quiet_megatron():
            from megatron.core import dist_checkpointing
        n_megatron = len(dist_checkpointing.load_tensors_metadata(str(tmp)))
        copied = copy_side_files(hf_dir, tmp / HF_CONFIG_SUBDIR)
        write_metadata(tmp, {
            "source": {"dir": str(hf_dir.resolve()),
                       "name": cfg.get("_name_or_path") or hf_dir.resolve().name},
            "architecture": arch_dict(arch),
            "hf_dtype": dtype_name(dtype), "megatron_dtype": dtype_name(dtype),
            "writer_layout": {**layout.sizes(), "vocab_pad_multiple": vocab_pad_multiple},
            "tensor_count": {"hf": len(ckpt.entries), "megatron": n_megatron},
            "bytes": ckpt.total_bytes,
            "hf_files": copied,
        })
    seconds = time.perf_counter() - start
    summary = summary_line("hf -> megatron", len(ckpt.entries), ckpt.total_bytes, seconds,
                           str(out_dir), ranks)
    return ConversionResult(str(out_dir), len(ckpt.entries), ckpt.total_bytes, seconds, ranks,
                            summary)


# ------------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-dir", required=True,
                        help="HF model dir: config.json + model.safetensors or a sharded "
                             "model.safetensors.index.json (with --dry-run: config.json only)")
    parser.add_argument("--out-dir", help="megatron checkpoint dir to create")
    add_layout_arguments(parser, "of the writer")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an output dir that already holds files")
    parser.add_argument("--dry-run", action="store_true",
                        help="read config.json only and print the per-rank shard plan")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    def convert():
        if args.dry_run:
            from megatron_tg.convert.plan import print_plan

            print_plan(args.hf_dir, tp=args.tp, ep=args.ep, pp=args.pp, etp=args.etp)
            return None
        if not args.out_dir:
            raise ConversionError("--out-dir is required (unless --dry-run)")
        return convert_hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, ep=args.ep,
                                      pp=args.pp, etp=args.etp, overwrite=args.overwrite,
                                      progress=not args.no_progress)

    return run_reporting(convert)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_hf_to_megatron",
        description="Convert a Hugging Face Qwen3(-MoE) checkpoint into a megatron-core "
                    "torch_dist checkpoint (loads at any TP/EP/PP).")
    add_arguments(parser)
    return run(parser.parse_args(argv))
