"""megatron-core torch_dist checkpoint -> Hugging Face safetensors (``from_pretrained``-ready).

Design:
- ``ParallelDims.smallest_world`` (``pp * lcm(tp, ep * etp)``) gloo workers load the checkpoint at the requested
  reading layout (megatron reshards on load). Before loading, every rank compares the
  tensor keys it will request with the checkpoint's and all ranks agree on one error
  naming missing / unexpected / misshapen tensors.
- Writers: dense tensors by TP rank 0 of data-parallel replica 0 of each pipeline stage
  (global rank 0 when pp = 1); experts by expert-TP rank 0 of every EP rank. For each
  parameter a writer gathers the TP (or expert-TP) shards (``dist.gather``, so only the
  writer holds them), merges them (``merge_tp_shards``), maps them (``to_hf``) and writes.
- Streaming: every HF tensor's name/dtype/shape is known before any data moves (derived on
  the meta device from the parameter shapes), so files are planned up front (size-capped,
  ``--max-shard-size``) and each is written header-first and then tensor by tensor: a
  writer holds one merged parameter at a time, never a shard or the model.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_tg.convert.common import (
    HF_CONFIG_SUBDIR,
    ConversionError,
    add_layout_arguments,
    build_shard,
    config_dtype,
    dtype_from_name,
    dtype_name,
    name_list,
    parse_size,
    quiet_megatron,
    run_reporting,
    summary_line,
)
from megatron_tg.convert.hf_io import (
    INDEX_FILE,
    PlannedTensor,
    StreamingSafetensorsWriter,
    copy_side_files,
    pack_files,
)
from megatron_tg.convert.hf_to_megatron import ConversionResult
from megatron_tg.convert.launch import launch
from megatron_tg.convert.metadata import arch_mismatch, read_metadata
from megatron_tg.convert.outdir import check_output_dir, staged_output
from megatron_tg.models.qwen3_moe.config import Qwen3Arch, load_hf_config_dict
from megatron_tg.parallel.dims import ParallelDims

# Checkpoint keys that belong to the model (a training checkpoint also holds optimizer.*,
# rng_state, ... which export ignores).
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")

# Which weights of a trainer checkpoint to export: the trained policy, or the frozen/EMA
# expert the trainer saves under this key prefix (train/checkpoint.py, objective.expert).
WEIGHTS = {"policy": "", "expert": "expert."}


@dataclass(frozen=True)
class ExportJob:
    megatron_dir: str
    out_dir: str
    config: dict
    layout: ParallelDims
    dtype: str        # megatron params dtype
    hf_dtype: str     # dtype written to safetensors
    max_shard_bytes: int
    vocab_pad_multiple: int = 128
    progress: bool = True
    key_prefix: str = ""  # WEIGHTS[...]: "" for the policy, "expert." for the expert


def _all_gather_object(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def load_megatron_checkpoint(model, ckpt_dir: str, prefix: str = "") -> None:
    """Load a torch_dist checkpoint into ``model`` (this rank's shard), refusing mismatches.

    ``prefix``: the key prefix of the weights to read ("" = the model a converter or the
    trainer wrote; "expert." = a trainer checkpoint's frozen/EMA expert). Only the model's
    tensors are requested, so a trainer checkpoint's optimizer state (moments, main
    parameters: ~3x the model in fp32) is never read.

    Collective: every rank must call it. Raises the same :class:`ConversionError` on all.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    sharded = model.sharded_state_dict(prefix=prefix)
    mine = {v.key: v for v in sharded.values()
            if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    stored = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    missing = [k for k in mine if k not in stored]
    # allow_shape_mismatch marks the vocab-padded tensors, whose padding depends on TP.
    wrong = [f"{k} {tuple(stored[k].global_shape)} (model: {tuple(v.global_shape)})"
             for k, v in mine.items() if isinstance(v, ShardedTensor) and k in stored
             and not v.allow_shape_mismatch
             and tuple(v.global_shape) != tuple(stored[k].global_shape)]
    everyone = _all_gather_object((sorted(mine), missing, wrong))
    requested = set().union(*(set(e[0]) for e in everyone))
    missing = sorted(set().union(*(e[1] for e in everyone)))
    wrong = sorted(set().union(*(e[2] for e in everyone)))
    ours = tuple(prefix + p for p in MODEL_KEY_PREFIXES)
    unexpected = [k for k in stored if k.startswith(ours) and k not in requested]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {name_list(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {name_list(unexpected)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) with the wrong shape: {name_list(wrong)}")
    if problems:
        raise ConversionError(f"megatron checkpoint {ckpt_dir} does not match the model of its "
                              "config.json: " + "; ".join(problems))
    state = dist_checkpointing.load(sharded, ckpt_dir)
    # megatron merges the checkpoint's common (non-tensor) state into the result: in a
    # trainer checkpoint that holds "optimizer" (param groups, step), which is not ours.
    model.load_state_dict({k.removeprefix(prefix): state[k] for k in sharded}, strict=True)


def _gather(t: torch.Tensor, group, size: int, is_dst: bool) -> list[torch.Tensor] | None:
    import torch.distributed as dist

    if size == 1:
        return [t]
    t = t.detach().contiguous()  # gloo returns wrong data for non-contiguous tensors
    out = [torch.empty_like(t) for _ in range(size)] if is_dst else None
    dist.gather(t, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def _export_worker(rank: int, world: int, job: ExportJob) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from tqdm import tqdm

    from megatron_tg.models.qwen3_moe.mapping import (
        current_layout,
        merge_tp_shards,
        param_info,
        to_hf,
    )
    from megatron_tg.parallel.state import destroy_parallel

    t0 = time.perf_counter()
    mem, arch, model = build_shard(job.config, job.layout, job.dtype, job.vocab_pad_multiple)
    with mem.watch():
        load_megatron_checkpoint(model, job.megatron_dir, prefix=job.key_prefix)
    mem.end_phase("load")
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t_load = time.perf_counter()
    layout = current_layout(job.vocab_pad_multiple, model=model)  # with the PP layer offset
    hf_dtype = dtype_from_name(job.hf_dtype)

    groups = {
        False: (mps.get_tensor_model_parallel_group(), mps.get_tensor_model_parallel_world_size(),
                mps.get_data_parallel_rank(with_context_parallel=True) == 0,
                mps.get_tensor_model_parallel_rank() == 0),
        True: (mps.get_expert_tensor_parallel_group(), mps.get_expert_tensor_parallel_world_size(),
               mps.get_expert_data_parallel_rank() == 0,
               mps.get_expert_tensor_parallel_rank() == 0),
    }
    # (name, param, is_expert) this rank takes part in, and what it will write, in order.
    items, plan = [], []
    for name, p in model.named_parameters():
        if name.endswith("output_layer.weight") and arch.tie_word_embeddings:
            continue  # HF ties lm_head to embed_tokens: nothing to write
        info = param_info(name, arch, layout)
        group, size, active, writer = groups[info.is_expert]
        if not active:
            continue  # a data-parallel replica: another rank exports this copy
        items.append((name, p, info.is_expert))
        if writer:
            meta = [torch.empty(p.shape, dtype=p.dtype, device="meta")] * size
            for hf_name, t in to_hf(name, merge_tp_shards(name, meta, arch, layout), arch, layout):
                plan.append(PlannedTensor(hf_name, hf_dtype, tuple(t.shape)))

    # Every rank derives the same file assignment from everyone's plan.
    plans = _all_gather_object(plan)
    files = [(r, run) for r, pl in enumerate(plans) for run in pack_files(pl, job.max_shard_bytes)]
    n_files = len(files)
    names = [f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)]
    weight_map = {t.name: names[i] for i, (_, run) in enumerate(files) for t in run}
    mine = [(names[i], run) for i, (r, run) in enumerate(files) if r == rank]

    bar = tqdm(total=len(items), unit="tensor", dynamic_ncols=True, desc=f"rank 0/{world} export",
               disable=rank != 0 or not job.progress)
    current, written, nbytes_ = None, 0, 0
    with torch.no_grad():
        for name, p, is_expert in items:
            group, size, _, writer = groups[is_expert]
            shards = _gather(p, group, size, writer)
            if writer:
                full = merge_tp_shards(name, shards, arch, layout)
                for hf_name, t in to_hf(name, full, arch, layout):
                    if current is None or current.done:
                        if current is not None:
                            current.close()
                        fname, run = mine.pop(0)
                        current = StreamingSafetensorsWriter(Path(job.out_dir) / fname, run)
                    t = t.to(hf_dtype)
                    current.write(hf_name, t)
                    written += 1
                    nbytes_ += t.numel() * t.element_size()
                del full, shards
            mem.sample()
            bar.update(1)
    if current is not None:
        current.close()
    assert not mine, f"planned files never written: {[f for f, _ in mine]}"
    bar.close()
    dist.barrier()
    destroy_parallel()
    return {"rank": rank, "tensors_written": written, "bytes_written": nbytes_,
            "shard_bytes": shard_bytes,
            "weight_map": weight_map if rank == 0 else None, "memory": mem.report(),
            "seconds": {"load": t_load - t0, "export": time.perf_counter() - t_load}}


def _is_torch_dist(path: Path) -> bool:
    try:
        meta = json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("sharded_backend") == "torch_dist"


def check_storage_files(dist_dir: Path) -> None:
    """Refuse a torch_dist checkpoint whose ``.distcp`` files are shorter than its metadata
    says (a truncated copy or an interrupted save), here in the parent, before any worker
    reads a byte: otherwise the failure is an ``EOFError`` deep inside a worker."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(dist_dir)).read_metadata().storage_data or {}
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same problem
        raise ConversionError(f"{dist_dir}: unreadable checkpoint metadata (.metadata): "
                              f"{type(exc).__name__}: {exc}") from None
    need: dict[str, int] = {}
    for info in storage.values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel, end in sorted(need.items()):
        path = dist_dir / rel
        if not path.exists():
            raise ConversionError(f"{path}: missing (the checkpoint's metadata names it)")
        size = path.stat().st_size
        if size < end:
            raise ConversionError(f"{path}: truncated: the checkpoint's metadata needs {end} "
                                  f"bytes, the file has {size} ({end - size} missing)")


def convert_megatron_to_hf(megatron_dir: str | Path, out_dir: str | Path, *,
                           hf_config_dir: str | Path | None = None, tp: int = 1, ep: int = 1,
                           pp: int = 1, etp: int | None = None, max_shard_size: str | int = "5GB",
                           overwrite: bool = False, progress: bool = True,
                           weights: str = "policy",
                           timeout_s: float | None = None) -> ConversionResult:
    """Export a megatron torch_dist checkpoint to an HF dir, reading it at tp/ep/pp.

    ``megatron_dir``: a converted checkpoint, or a trainer step dir (``step_N/``, its
    tensors in ``dist/``, its config and tokenizer files in ``hf_config/``), or that
    ``dist/`` itself. ``weights``: "policy" (the trained model), or "expert" (a trainer
    checkpoint's frozen/EMA expert; the EMA's fp32 average, cast to the HF dtype).
    """
    start = time.perf_counter()
    if weights not in WEIGHTS:
        raise ConversionError(f"weights={weights!r}: choose one of {', '.join(WEIGHTS)}")
    prefix = WEIGHTS[weights]
    mdir = Path(megatron_dir)
    # A converted checkpoint holds megatron's files directly; a trainer checkpoint
    # (step_N/) holds them in dist/ next to its own state: accept both (and dist/ itself).
    dist_dir = next((d for d in (mdir, mdir / "dist") if _is_torch_dist(d)), None)
    if dist_dir is None:
        raise ConversionError(f"{mdir} is not a megatron torch_dist checkpoint (no metadata.json "
                              "with sharded_backend=torch_dist, here or in dist/)")
    step_dir = dist_dir.parent if dist_dir.name == "dist" else dist_dir
    meta = read_metadata(step_dir)
    cfg_dir = Path(hf_config_dir) if hf_config_dir else step_dir / HF_CONFIG_SUBDIR
    if not (cfg_dir / "config.json").exists():
        raise ConversionError(f"no config.json in {cfg_dir}" + ("" if hf_config_dir else
                              "; this checkpoint carries no HF config (a trainer checkpoint "
                              "written before checkpoints stored hf_config/): pass "
                              "--hf-config-dir"))
    cfg = load_hf_config_dict(cfg_dir)
    arch = Qwen3Arch.from_hf(cfg, source=str(cfg_dir / "config.json"))
    if meta is not None:
        diff = arch_mismatch(arch, meta["architecture"])
        if diff:
            raise ConversionError(f"{cfg_dir / 'config.json'} describes a different model than "
                                  f"the checkpoint: {'; '.join(diff)}")
    layout = ParallelDims.smallest(tp=tp, ep=ep, pp=pp, etp=etp)
    layout.check_arch(arch)
    check_output_dir(out_dir, overwrite)
    with quiet_megatron():
        from megatron.core import dist_checkpointing

    check_storage_files(dist_dir)
    stored = dist_checkpointing.load_tensors_metadata(str(dist_dir))
    ours = tuple(prefix + k for k in MODEL_KEY_PREFIXES)
    model_dtypes = [v.dtype for k, v in stored.items() if k.startswith(ours)]
    if not model_dtypes:
        raise ConversionError(
            f"{dist_dir} holds no {weights} weights (no tensor named {ours[0]}...)" +
            (": a trainer checkpoint has an expert only when trained with objective.expert="
             "ema or frozen (shared, the default, uses the live policy)" if prefix else ""))
    # The expert's dtype is its own: the EMA is saved in fp32 whatever the policy's dtype.
    dtype = dtype_from_name(meta["megatron_dtype"]) if meta and not prefix else model_dtypes[0]
    hf_dtype = dtype_from_name(meta["hf_dtype"]) if meta else (config_dtype(cfg) or dtype)
    pad = (meta or {}).get("writer_layout", {}).get("vocab_pad_multiple", 128)
    job_kwargs = dict(megatron_dir=str(dist_dir.absolute()), config=cfg, layout=layout,
                      dtype=dtype_name(dtype), hf_dtype=dtype_name(hf_dtype),
                      max_shard_bytes=parse_size(max_shard_size), vocab_pad_multiple=pad,
                      progress=progress, key_prefix=prefix)
    with staged_output(out_dir, overwrite) as tmp:
        ranks = launch(_export_worker, layout.world_size, ExportJob(out_dir=str(tmp), **job_kwargs),
                       timeout_s=timeout_s)
        weight_map = ranks[0]["weight_map"]
        total = sum(r["bytes_written"] for r in ranks)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        copy_side_files(cfg_dir, tmp)
    tensors = sum(r["tensors_written"] for r in ranks)
    seconds = time.perf_counter() - start
    summary = summary_line(f"megatron -> hf ({weights})", tensors, total, seconds, str(out_dir),
                           ranks)
    return ConversionResult(str(out_dir), tensors, total, seconds, ranks, summary)


# ------------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--megatron-dir", required=True,
                        help="megatron torch_dist checkpoint dir: a converted checkpoint, or a "
                             "trainer step dir (RUN/checkpoints/step_N, or its dist/)")
    parser.add_argument("--out-dir", required=True, help="HF model dir to create")
    parser.add_argument("--hf-config-dir", default=None,
                        help="take config.json / tokenizer files from here (default: the copy "
                             "the converter or the trainer stored in the checkpoint's "
                             "hf_config/)")
    parser.add_argument("--weights", choices=sorted(WEIGHTS), default="policy",
                        help="policy (default): the trained model; expert: a trainer "
                             "checkpoint's frozen/EMA expert (objective.expert=ema|frozen)")
    add_layout_arguments(parser, "to read at")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="cap per safetensors file, e.g. 5GB, 500MB (default 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an output dir that already holds files")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    return run_reporting(lambda: convert_megatron_to_hf(
        args.megatron_dir, args.out_dir, hf_config_dir=args.hf_config_dir, tp=args.tp,
        ep=args.ep, pp=args.pp, etp=args.etp, max_shard_size=args.max_shard_size,
        overwrite=args.overwrite, progress=not args.no_progress, weights=args.weights))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_megatron_to_hf",
        description="Export a megatron-core torch_dist Qwen3(-MoE) checkpoint to Hugging Face "
                    "safetensors (sharded, with model.safetensors.index.json).")
    add_arguments(parser)
    return run(parser.parse_args(argv))
