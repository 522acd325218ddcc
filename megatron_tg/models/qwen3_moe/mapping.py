"""Qwen3(-MoE) weight mapping: Hugging Face names <-> megatron-core names, one tensor at a time.

Used by the checkpoint converters (tools/), the trainer's weight sync to inference engines,
and the tests. Everything works per parameter so callers can stream: a converter loads
only the HF tensors one megatron shard needs; the weight sync gathers one parameter over
TP, maps it, and pushes it.

Layouts (megatron side, per TP rank r of ``tp``):
- ``linear_qkv``: rows grouped by KV group g: ``[q heads of g | k_g | v_g] * head_dim``;
  TP splits whole groups, so rank r holds groups ``[r*G/tp, (r+1)*G/tp)``.
- ``linear_fc1`` (dense MLP and each expert): rank r holds ``[gate_r ; up_r]`` where
  ``gate_r``/``up_r`` are the r-th row chunks; the full TP=1 weight is ``[gate ; up]``.
- ``linear_proj`` / ``linear_fc2``: split on the input (column) dimension.
- ``word_embeddings`` / ``output_layer``: split on the (padded) vocabulary rows; rows past
  the real vocabulary are zero on import and dropped on export.
- norms and the router: replicated.
- experts: EP rank e holds global experts ``[e*E/ep, (e+1)*E/ep)`` as ``local_experts.j``
  (SequentialMLP, CPU) or ``experts.linear_fc{1,2}.weight{j}`` (TEGroupedMLP, GPU); expert
  tensor parallelism (``etp``) splits each expert like a dense MLP.
- Transformer-Engine specs fuse the pre-attention norm into ``linear_qkv.layer_norm_weight``
  and (dense layers) the pre-MLP norm into ``linear_fc1.layer_norm_weight``; both
  spellings map to the same HF tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from megatron_tg.models.qwen3_moe.config import Qwen3Arch, padded_vocab_size


class MappingError(KeyError):
    """A parameter name that this mapping does not know, or a missing source tensor."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's shard sits on each axis that splits weights."""

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    vocab_pad_multiple: int = 128
    layer_offset: int = 0
    """Global index of this pipeline stage's first layer (megatron numbers layers per stage)."""


# Parameter kinds decide how a tensor is split and merged.
REPLICATED, VOCAB, QKV, ROW_IN, FC1 = "replicated", "vocab", "qkv", "row_in", "fc1"

_LAYER = r"decoder\.layers\.(\d+)\."
_RULES: list[tuple[re.Pattern, str, Callable[..., list[str]]]] = []


def _rule(pattern: str, kind: str):
    def deco(fn):
        _RULES.append((re.compile(pattern + "$"), kind, fn))
        return fn
    return deco


@_rule(r"embedding\.word_embeddings\.weight", VOCAB)
def _embed(m, arch):
    return ["model.embed_tokens.weight"]


@_rule(r"output_layer\.weight", VOCAB)
def _lm_head(m, arch):
    return ["lm_head.weight"]


@_rule(r"decoder\.final_layernorm\.weight", REPLICATED)
def _final_norm(m, arch):
    return ["model.norm.weight"]


@_rule(_LAYER + r"(?:input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)", REPLICATED)
def _in_norm(m, arch):
    return [f"model.layers.{m[1]}.input_layernorm.weight"]


@_rule(_LAYER + r"(?:pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)", REPLICATED)
def _post_norm(m, arch):
    return [f"model.layers.{m[1]}.post_attention_layernorm.weight"]


@_rule(_LAYER + r"self_attention\.linear_qkv\.weight", QKV)
def _qkv(m, arch):
    p = f"model.layers.{m[1]}.self_attn."
    return [p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"]


@_rule(_LAYER + r"self_attention\.linear_qkv\.bias", QKV)
def _qkv_bias(m, arch):
    p = f"model.layers.{m[1]}.self_attn."
    return [p + "q_proj.bias", p + "k_proj.bias", p + "v_proj.bias"]


@_rule(_LAYER + r"self_attention\.(q|k)_layernorm\.weight", REPLICATED)
def _qk_norm(m, arch):
    return [f"model.layers.{m[1]}.self_attn.{m[2]}_norm.weight"]


@_rule(_LAYER + r"self_attention\.linear_proj\.weight", ROW_IN)
def _o_proj(m, arch):
    return [f"model.layers.{m[1]}.self_attn.o_proj.weight"]


@_rule(_LAYER + r"mlp\.linear_fc1\.weight", FC1)
def _dense_fc1(m, arch):
    p = f"model.layers.{m[1]}.mlp."
    return [p + "gate_proj.weight", p + "up_proj.weight"]


@_rule(_LAYER + r"mlp\.linear_fc2\.weight", ROW_IN)
def _dense_fc2(m, arch):
    return [f"model.layers.{m[1]}.mlp.down_proj.weight"]


@_rule(_LAYER + r"mlp\.router\.weight", REPLICATED)
def _router(m, arch):
    return [f"model.layers.{m[1]}.mlp.gate.weight"]


# Expert names carry a *local* index; the caller's layout turns it into a global one.
@_rule(_LAYER + r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc1\.weight|linear_fc1\.weight(\d+))", FC1)
def _expert_fc1(m, arch, expert):
    p = f"model.layers.{m[1]}.mlp.experts.{expert}."
    return [p + "gate_proj.weight", p + "up_proj.weight"]


@_rule(_LAYER + r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc2\.weight|linear_fc2\.weight(\d+))", ROW_IN)
def _expert_fc2(m, arch, expert):
    return [f"model.layers.{m[1]}.mlp.experts.{expert}.down_proj.weight"]


class _Shifted:
    """A regex match whose first group (the layer index) is shifted to the global index."""

    def __init__(self, m: re.Match, offset: int) -> None:
        self.m, self.offset = m, offset

    def __getitem__(self, i: int):
        return str(int(self.m[1]) + self.offset) if i == 1 else self.m[i]


@dataclass(frozen=True)
class ParamInfo:
    """What one megatron parameter is made of."""

    name: str
    kind: str
    hf_names: list[str]
    is_expert: bool


def param_info(name: str, arch: Qwen3Arch, layout: ShardLayout) -> ParamInfo:
    """Resolve a megatron parameter name (``module.`` prefixes allowed) to its HF sources."""
    clean = re.sub(r"^(module\.)+", "", name)
    for pattern, kind, fn in _RULES:
        m = pattern.match(clean)
        if not m:
            continue
        if layout.layer_offset and clean.startswith("decoder.layers."):
            m = _Shifted(m, layout.layer_offset)
        if fn in (_expert_fc1, _expert_fc2):
            local = int(m[2] if m[2] is not None else m[3])
            per_rank = arch.num_experts // layout.ep
            return ParamInfo(clean, kind, fn(m, arch, layout.ep_rank * per_rank + local), True)
        return ParamInfo(clean, kind, fn(m, arch), False)
    raise MappingError(f"no HF mapping for megatron parameter {name!r}")


def _tp_of(info: ParamInfo, layout: ShardLayout) -> tuple[int, int]:
    return (layout.etp, layout.etp_rank) if info.is_expert else (layout.tp, layout.tp_rank)


def _qkv_full(arch: Qwen3Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v -> megatron's grouped ``[G, (q_per_g + 2) * hd, ...]`` layout, flattened."""
    g, hd = arch.num_key_value_heads, arch.head_dim
    tail = q.shape[1:]
    q = q.reshape(g, -1, *tail)
    k = k.reshape(g, hd, *tail)
    v = v.reshape(g, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def to_megatron(name: str, get_hf: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
                arch: Qwen3Arch, layout: ShardLayout) -> torch.Tensor:
    """This rank's shard of megatron parameter ``name``, built from HF tensors."""
    info = param_info(name, arch, layout)
    getter = get_hf.__getitem__ if isinstance(get_hf, Mapping) else get_hf
    try:
        src = [getter(n) for n in info.hf_names]
    except KeyError as exc:
        raise MappingError(f"megatron parameter {info.name!r} needs HF tensor {exc.args[0]!r}, "
                           f"which the checkpoint does not contain") from None
    tp, rank = _tp_of(info, layout)
    if info.kind == REPLICATED:
        return src[0]
    if info.kind == VOCAB:
        w = src[0]
        rows = padded_vocab_size(arch.vocab_size, layout.tp, layout.vocab_pad_multiple)
        if w.shape[0] != arch.vocab_size:
            raise MappingError(f"{info.hf_names[0]} has {w.shape[0]} rows, config vocab_size "
                               f"is {arch.vocab_size}")
        padded = torch.zeros(rows, *w.shape[1:], dtype=w.dtype)
        padded[: w.shape[0]] = w
        return padded.chunk(tp, dim=0)[rank].clone()
    if info.kind == QKV:
        full = _qkv_full(arch, *src)
        return full.chunk(tp, dim=0)[rank].clone()
    if info.kind == ROW_IN:
        return src[0].chunk(tp, dim=1)[rank].clone()
    if info.kind == FC1:
        gate, up = src
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    raise AssertionError(info.kind)


def merge_tp_shards(name: str, shards: list[torch.Tensor], arch: Qwen3Arch,
                    layout: ShardLayout) -> torch.Tensor:
    """Undo TP (or expert-TP) sharding: the TP=1 megatron tensor from every rank's shard."""
    info = param_info(name, arch, layout)
    if info.kind == REPLICATED or len(shards) == 1 and info.kind != FC1:
        return shards[0]
    if info.kind in (VOCAB, QKV):
        return torch.cat(shards, dim=0)
    if info.kind == ROW_IN:
        return torch.cat(shards, dim=1)
    if info.kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise AssertionError(info.kind)


def to_hf(name: str, full: torch.Tensor, arch: Qwen3Arch,
          layout: ShardLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs from a TP-merged megatron tensor (see :func:`merge_tp_shards`).

    ``layout.ep_rank`` must be the EP rank that owns ``name`` when it is an expert weight.
    """
    info = param_info(name, arch, layout)
    if info.kind in (REPLICATED, ROW_IN):
        yield info.hf_names[0], full
    elif info.kind == VOCAB:
        yield info.hf_names[0], full[: arch.vocab_size]
    elif info.kind == QKV:
        g, hd = arch.num_key_value_heads, arch.head_dim
        grouped = full.reshape(g, -1, *full.shape[1:])
        qpg = grouped.shape[1] - 2 * hd
        q, k, v = grouped.split([qpg, hd, hd], dim=1)
        for hf_name, t in zip(info.hf_names, (q, k, v)):
            yield hf_name, t.reshape(-1, *full.shape[1:]).contiguous()
    elif info.kind == FC1:
        gate, up = full.chunk(2, dim=0)
        yield info.hf_names[0], gate.contiguous()
        yield info.hf_names[1], up.contiguous()
    else:  # pragma: no cover
        raise AssertionError(info.kind)


def expected_hf_names(arch: Qwen3Arch) -> list[str]:
    """Every tensor name an HF checkpoint of ``arch`` must contain (for completeness checks)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                        "q_norm", "k_norm")]
        if arch.attention_bias:
            names += [p + f"self_attn.{x}.bias" for x in ("q_proj", "k_proj", "v_proj")]
        if arch.is_moe_layer(i):
            names.append(p + "mlp.gate.weight")
            names += [p + f"mlp.experts.{e}.{x}.weight" for e in range(arch.num_experts)
                      for x in ("gate_proj", "up_proj", "down_proj")]
        else:
            names += [p + f"mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")]
    return names


def current_layout(vocab_pad_multiple: int = 128, model: torch.nn.Module | None = None
                   ) -> ShardLayout:
    """The :class:`ShardLayout` of this process, read from megatron's parallel state (and,
    under pipeline parallelism, the layer offset of ``model``'s stage)."""
    from megatron.core import parallel_state as mps

    offset = 0
    if model is not None:
        while hasattr(model, "module"):
            model = model.module
        layers = getattr(getattr(model, "decoder", None), "layers", None)
        if layers is not None and len(layers):
            offset = int(layers[0].layer_number) - 1  # megatron's layer_number is global, 1-based
    elif mps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("current_layout() needs the model under pipeline parallelism "
                         "(its stage's layer offset)")
    return ShardLayout(layer_offset=offset,
        tp=mps.get_tensor_model_parallel_world_size(), tp_rank=mps.get_tensor_model_parallel_rank(),
        ep=mps.get_expert_model_parallel_world_size(), ep_rank=mps.get_expert_model_parallel_rank(),
        etp=mps.get_expert_tensor_parallel_world_size(),
        etp_rank=mps.get_expert_tensor_parallel_rank(), vocab_pad_multiple=vocab_pad_multiple)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, get_hf: Callable[[str], torch.Tensor] | Mapping,
                    arch: Qwen3Arch, layout: ShardLayout) -> list[str]:
    """Copy HF tensors into this rank's megatron parameters; returns the HF names used."""
    used: list[str] = []
    for name, param in model.named_parameters():
        shard = to_megatron(name, get_hf, arch, layout)
        if shard.shape != param.shape:
            raise MappingError(f"{name}: mapped shard has shape {tuple(shard.shape)}, "
                               f"model expects {tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))
        used += param_info(name, arch, layout).hf_names
    return used
