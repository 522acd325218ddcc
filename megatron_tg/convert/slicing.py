"""This rank's shard of a megatron parameter, copied straight from HF safetensors slices.

``mapping.to_megatron`` takes whole HF tensors and chunks them; on a TP rank that means
reading (say) the whole 0.6 GB embedding to keep 1/tp of it, then concatenating pieces
into a new tensor. Here each parameter kind asks ``safe_open(...).get_slice`` for exactly
the rows (or columns) it keeps, and copies those memory-mapped views directly into the
destination parameter's sub-blocks: one pass over the bytes, no intermediate tensor, so a
worker's memory is its shard and nothing else. ``tests/convert/test_units.py`` checks the
result equals ``to_megatron`` for every parameter kind and layout.
"""

from __future__ import annotations

import torch

from megatron_tg.convert.common import ST_DTYPES
from megatron_tg.convert.hf_io import LazyReader
from megatron_tg.models.qwen3_moe.config import Qwen3Arch, padded_vocab_size
from megatron_tg.models.qwen3_moe.mapping import (
    FC1,
    QKV,
    REPLICATED,
    ROW_IN,
    VOCAB,
    MappingError,
    ShardLayout,
    param_info,
)

def hf_source_name(hf_name: str, arch: Qwen3Arch) -> str:
    # With tied embeddings HF stores no lm_head; megatron's last pipeline stage still holds
    # an output-layer copy of the embedding (pp > 1), read from the embedding.
    if hf_name == "lm_head.weight" and arch.tie_word_embeddings:
        return "model.embed_tokens.weight"
    return hf_name


def _plan(name: str, reader: LazyReader, arch: Qwen3Arch, layout: ShardLayout):
    info = param_info(name, arch, layout)
    srcs = [hf_source_name(n, arch) for n in info.hf_names]
    for n in srcs:
        if n not in reader.entries:
            raise MappingError(f"megatron parameter {info.name!r} needs HF tensor {n!r}, "
                               "which the checkpoint does not contain")
    tp, rank = (layout.etp, layout.etp_rank) if info.is_expert else (layout.tp, layout.tp_rank)
    return info, srcs, tp, rank, tuple(reader.entries[srcs[0]][2])


def shard_shape(name: str, reader: LazyReader, arch: Qwen3Arch,
                layout: ShardLayout) -> tuple[int, ...]:
    """Shape of this rank's shard of ``name`` as built from the HF tensors."""
    info, srcs, tp, _, shape = _plan(name, reader, arch, layout)
    if info.kind == REPLICATED:
        return shape
    if info.kind == VOCAB:
        return (padded_vocab_size(arch.vocab_size, layout.tp, layout.vocab_pad_multiple) // tp,
                *shape[1:])
    if info.kind == QKV:
        rows = sum(reader.entries[s][2][0] for s in srcs)
        return (rows // tp, *shape[1:])
    if info.kind == ROW_IN:
        return (shape[0], shape[1] // tp)
    if info.kind == FC1:
        return (2 * (shape[0] // tp), *shape[1:])
    raise AssertionError(info.kind)


@torch.no_grad()
def read_shard_into(dst: torch.Tensor, name: str, reader: LazyReader, arch: Qwen3Arch,
                    layout: ShardLayout) -> None:
    """Fill ``dst`` (this rank's shard of megatron parameter ``name``; under PP the stage's
    ``layout.layer_offset`` globalises the layer number) from the HF checkpoint, reading
    only the slices it keeps."""
    info, srcs, tp, rank, shape = _plan(name, reader, arch, layout)
    want = shard_shape(name, reader, arch, layout)
    if tuple(dst.shape) != want:
        raise MappingError(f"{info.name}: HF tensors {srcs} give a shard of shape {want}, "
                           f"the megatron parameter is {tuple(dst.shape)}")

    def rows(n: str, lo: int, hi: int) -> torch.Tensor:
        return reader.view(n, slice(lo, hi))

    if info.kind == REPLICATED or (tp == 1 and info.kind == ROW_IN):
        dst.copy_(reader.view(srcs[0]))
    elif info.kind == VOCAB:
        if shape[0] != arch.vocab_size:
            raise MappingError(f"{srcs[0]} has {shape[0]} rows, config vocab_size is "
                               f"{arch.vocab_size}")
        per = dst.shape[0]
        lo, hi = rank * per, min((rank + 1) * per, arch.vocab_size)
        n = max(0, hi - lo)
        if n:
            dst[:n].copy_(rows(srcs[0], lo, hi))
        dst[n:].zero_()  # megatron's padding rows past the real vocabulary
    elif info.kind == QKV:
        # Megatron groups rows by KV group: [q heads of g | k_g | v_g]; TP splits groups.
        g, hd = arch.num_key_value_heads, arch.head_dim
        per_g, q_rows = g // tp, (arch.num_attention_heads // g) * hd
        g0 = rank * per_g
        grouped = dst.view(per_g, q_rows + 2 * hd, *dst.shape[1:])
        grouped[:, :q_rows].copy_(rows(srcs[0], g0 * q_rows, (g0 + per_g) * q_rows)
                                  .view(per_g, q_rows, *dst.shape[1:]))
        for j, src in enumerate(srcs[1:]):
            part = rows(src, g0 * hd, (g0 + per_g) * hd).view(per_g, hd, *dst.shape[1:])
            grouped[:, q_rows + j * hd: q_rows + (j + 1) * hd].copy_(part)
    elif info.kind == ROW_IN:
        per = dst.shape[1]
        dst.copy_(reader.view(srcs[0], slice(None), slice(rank * per, (rank + 1) * per)))
    elif info.kind == FC1:
        per = dst.shape[0] // 2  # [gate_r ; up_r]
        dst[:per].copy_(rows(srcs[0], rank * per, (rank + 1) * per))
        dst[per:].copy_(rows(srcs[1], rank * per, (rank + 1) * per))
    else:  # pragma: no cover
        raise AssertionError(info.kind)
    reader.release()


def read_shard(name: str, reader: LazyReader, arch: Qwen3Arch,
               layout: ShardLayout) -> torch.Tensor:
    """This rank's shard of ``name`` as a new tensor (in the HF dtype)."""
    dtype = ST_DTYPES[reader.entries[_plan(name, reader, arch, layout)[1][0]][1]]
    out = torch.empty(shard_shape(name, reader, arch, layout), dtype=dtype)
    read_shard_into(out, name, reader, arch, layout)
    return out
