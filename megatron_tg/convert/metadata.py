"""``tg_convert.json``: what a converted megatron checkpoint is, written next to megatron's files.

Fields (format version 1):
- ``format``, ``format_version``: see :mod:`megatron_tg.convert.common`;
- ``source``: ``{"dir", "name"}`` of the HF model converted (``name`` from config.json's
  ``_name_or_path`` when present, else the directory name);
- ``architecture``: the :class:`Qwen3Arch` fields, so export can refuse a mismatched config;
- ``hf_dtype``: dtype of the HF tensors (export writes this dtype back);
  ``megatron_dtype``: dtype of the megatron parameters (the same, unless forced);
- ``writer_layout``: ``{"tp", "ep", "pp", "etp", "world_size", "vocab_pad_multiple"}`` the
  checkpoint was written at (informational: torch_dist reshards on load);
- ``tensor_count``: ``{"hf", "megatron"}``; ``bytes``: HF tensor bytes;
- ``hf_files``: config/tokenizer files copied into ``hf_config/``;
- ``versions``: megatron-core, torch, transformers (if importable), megatron-tg.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from megatron_tg.convert.common import FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, ConversionError
from megatron_tg.models.qwen3_moe.config import Qwen3Arch


def arch_dict(arch: Qwen3Arch) -> dict[str, Any]:
    d = dataclasses.asdict(arch)
    d["moe_layers"] = list(d["moe_layers"])
    return d


# Fields that change neither the weights nor the forward pass: a config may differ in them.
_NOT_ARCHITECTURE = ("router_aux_loss_coef", "max_position_embeddings")


def arch_mismatch(arch: Qwen3Arch, recorded: dict[str, Any]) -> list[str]:
    """Fields where ``arch`` differs from an ``architecture`` record (empty: they agree)."""
    mine = arch_dict(arch)
    return [f"{k}: config {mine.get(k)!r}, checkpoint {v!r}" for k, v in recorded.items()
            if k not in _NOT_ARCHITECTURE and mine.get(k) != v]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("megatron-core", "torch", "transformers", "safetensors", "megatron-tg"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def write_metadata(ckpt_dir: str | os.PathLike, meta: dict[str, Any]) -> None:
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **meta,
            "versions": versions()}
    Path(ckpt_dir, METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_metadata(ckpt_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The converter's metadata, or None for a checkpoint it did not write (e.g. training)."""
    path = Path(ckpt_dir, METADATA_FILE)
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT_NAME:
        raise ConversionError(f"{path}: unknown format {meta.get('format')!r}")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise ConversionError(f"{path}: format version {meta['format_version']} is newer than "
                              f"this tool's ({FORMAT_VERSION}); update megatron-tg")
    return meta
