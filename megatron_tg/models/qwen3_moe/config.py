"""Hugging Face Qwen3 / Qwen3-MoE config.json -> megatron-core TransformerConfig.

The architecture facts this translation encodes (checked against transformers'
``modeling_qwen3_moe.py`` by the parity tests in tests/models):
- pre-norm RMSNorm (eps = ``rms_norm_eps``, computed in fp32), SwiGLU MLPs, no biases;
- GQA with ``num_key_value_heads`` groups and an explicit ``head_dim`` (not hidden/heads);
- QK-norm: an RMSNorm over ``head_dim`` on queries and keys, before RoPE;
- RoPE on the full head, rotate-half layout (megatron's non-interleaved), base ``rope_theta``;
- the router: ``softmax`` over all experts, top-k, and with ``norm_topk_prob`` the top-k
  weights renormalised to sum to one. That equals megatron's top-k-then-softmax
  (``moe_router_pre_softmax=False``); without ``norm_topk_prob`` it is softmax-then-top-k
  (``moe_router_pre_softmax=True``);
- MoE on layer ``i`` iff ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``.

Unsupported fields raise :class:`UnsupportedConfigError` naming the field, rather than
building a model that silently differs from the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_tg.parallel.dims import ParallelDims

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3")


class UnsupportedConfigError(ValueError):
    """The HF config is malformed (a missing or ill-typed field, unreadable JSON) or asks for
    something this builder does not implement; the message names the file and the field."""


@dataclass(frozen=True)
class Qwen3Arch:
    """The subset of an HF Qwen3(-MoE) config that determines the architecture."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def is_moe_layer(self, i: int) -> bool:
        return i in self.moe_layers

    @classmethod
    def from_hf(cls, cfg: Any, *, source: str | None = None) -> "Qwen3Arch":
        """Accept a dict, a path to config.json / a model dir, or a transformers config.
        ``source`` names a dict's file in error messages (a path names itself)."""
        d = load_hf_config_dict(cfg)
        src = source or _source(cfg)
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"model_type={mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        _refuse(d, "rope_scaling", lambda v: v not in (None, {}),
                "RoPE scaling (YaRN etc.) is not implemented")
        _refuse(d, "use_sliding_window", bool, "sliding-window attention is not implemented")
        _refuse(d, "shared_expert_intermediate_size", lambda v: bool(v),
                "shared experts are not part of Qwen3-MoE and not implemented")
        _refuse(d, "hidden_act", lambda v: v != "silu", "only SwiGLU (hidden_act='silu') is supported")
        _refuse(d, "layer_types", lambda v: v and any(t != "full_attention" for t in v),
                "only full-attention layers are supported")
        req = lambda key: _int_field(d, key, src, minimum=1)  # noqa: E731
        heads = req("num_attention_heads")
        hidden = req("hidden_size")
        layers = req("num_hidden_layers")
        common = dict(
            model_type=mt, vocab_size=req("vocab_size"), hidden_size=hidden, num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d.get("intermediate_size") or 0),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(d)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
        )
        # transformers 5 writes ``num_local_experts``; the published configs say ``num_experts``.
        # An explicit value is used as written: ``num_experts: 0`` is not silently replaced.
        if mt == "qwen3":
            return cls(**common)
        keys = [k for k in ("num_experts", "num_local_experts") if d.get(k) is not None]
        if not keys:
            raise UnsupportedConfigError(f"{src}: model_type='qwen3_moe' needs num_experts "
                                         "(or num_local_experts)")
        values = {k: _int_field(d, k, src) for k in keys}
        if len(set(values.values())) > 1:
            raise UnsupportedConfigError(f"{src}: num_experts={values['num_experts']} and "
                                         f"num_local_experts={values['num_local_experts']} differ")
        num_experts = values[keys[0]]
        if num_experts < 1:
            raise UnsupportedConfigError(f"{src}: {keys[0]}={num_experts}: a qwen3_moe model needs "
                                         "at least one expert (use model_type='qwen3' for a dense model)")
        step = int(d.get("decoder_sparse_step", 1) or 1)
        dense = set(d.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(**common, num_experts=num_experts,
                   num_experts_per_tok=_int_field(d, "num_experts_per_tok", src, minimum=1),
                   moe_intermediate_size=_int_field(d, "moe_intermediate_size", src, minimum=1),
                   norm_topk_prob=bool(d.get("norm_topk_prob", True)), moe_layers=moe_layers,
                   router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0) or 0.0))


def _rope_theta(d: dict) -> float:
    if "rope_theta" in d:
        return d["rope_theta"]
    params = d.get("rope_parameters") or {}  # transformers 5 moves it here
    return params.get("rope_theta", 10000.0)


def _refuse(d: dict, key: str, bad, why: str) -> None:
    if key in d and bad(d[key]):
        raise UnsupportedConfigError(f"config field {key}={d[key]!r}: {why}")


def _source(cfg: Any) -> str:
    """How error messages name the config: its file, or "the HF config"."""
    if isinstance(cfg, (str, os.PathLike)):
        path = os.fspath(cfg)
        return os.path.join(path, "config.json") if os.path.isdir(path) else path
    return "the HF config"


def _int_field(d: dict, key: str, src: str, minimum: int = 0) -> int:
    """A required integer field (at least ``minimum``), with an error naming file and field."""
    if key not in d or d[key] is None:
        raise UnsupportedConfigError(f"{src}: required field {key} is missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < minimum:
        raise UnsupportedConfigError(f"{src}: field {key}={v!r} is not an integer >= {minimum}")
    return int(v)


def load_hf_config_dict(cfg: Any) -> dict:
    if isinstance(cfg, dict):
        return dict(cfg)
    if isinstance(cfg, (str, os.PathLike)):
        path = _source(cfg)
        with open(path, "rb") as f:  # FileNotFoundError propagates: callers name the dir
            raw = f.read()
        try:
            d = json.loads(raw)
        except ValueError as exc:  # also bad UTF-8
            raise UnsupportedConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(d, dict):
            raise UnsupportedConfigError(f"{path}: a JSON {type(d).__name__}, not an object")
        return d
    if hasattr(cfg, "to_dict"):
        d = cfg.to_dict()
        d.setdefault("model_type", getattr(cfg, "model_type", None))
        return d
    raise TypeError(f"cannot read an HF config from {type(cfg).__name__}")


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron pads the vocabulary so every TP shard has the same, GEMM-friendly width."""
    step = multiple * tp
    return int(math.ceil(vocab_size / step) * step)


def transformer_config(arch: Qwen3Arch, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                       etp: int | None = None, params_dtype: torch.dtype = torch.float32,
                       sequence_parallel: bool | None = None, on_cpu: bool | None = None,
                       moe_aux_loss_coeff: float = 0.0, recompute: str = "none",
                       perform_initialization: bool = True, routing_replay: bool = False):
    """Build the megatron ``TransformerConfig`` for ``arch`` under a parallel layout.

    ``recompute`` is one of :data:`RECOMPUTE_MODES` (see :func:`recompute_kwargs`).
    ``routing_replay``: give every MoE router a megatron ``RouterReplay`` instance
    (``moe_enable_routing_replay``), so the trainer can impose the engine's expert choice
    (:mod:`megatron_tg.train.routing`). Only the policy is built with it: megatron keeps
    one global list of replay instances, and an expert copy must not add to it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = (not torch.cuda.is_available()) if on_cpu is None else on_cpu
    etp = ParallelDims.resolve_etp(tp, etp)
    if sequence_parallel is None:
        # megatron requires SP for MoE with TP>1; it also saves activation memory for dense.
        sequence_parallel = tp > 1
    if arch.is_moe and tp > 1 and not sequence_parallel:
        raise UnsupportedConfigError("MoE with tensor parallelism requires sequence_parallel=True")
    moe_layer_freq = [1 if arch.is_moe_layer(i) else 0 for i in range(arch.num_layers)]
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim, ffn_hidden_size=arch.intermediate_size or arch.hidden_size * 4,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=arch.attention_bias, hidden_dropout=0.0, attention_dropout=0.0,
        # Fusions are GPU kernels; the unfused paths are numerically the reference.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        # TE's p2p ring is the CP path that accepts THD on every TE release megatron-core 0.16
        # supports (all_gather and a2a+p2p refuse it): docs/context-parallel.md.
        cp_comm_type="p2p" if cp > 1 else None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype, use_cpu_initialization=on_cpu,
        # Micro-batches differ in token count: under PP the stages exchange each one's
        # shape before its activations (megatron allows this with the alltoall dispatcher).
        variable_seq_lengths=pp > 1,
        perform_initialization=perform_initialization,
    )
    grouped_gemm = arch.is_moe and not on_cpu and _have_grouped_gemm()
    kwargs.update(recompute_kwargs(recompute, is_moe=arch.is_moe, grouped_gemm=grouped_gemm))
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts, moe_router_topk=arch.num_experts_per_tok,
            moe_ffn_hidden_size=arch.moe_intermediate_size, moe_layer_freq=moe_layer_freq,
            moe_router_pre_softmax=not arch.norm_topk_prob, moe_router_score_function="softmax",
            moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=grouped_gemm,
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
            moe_permute_fusion=False,
            # The fused top-k kernel bypasses RouterReplay: it must stay off with replay.
            moe_router_fusion=False, moe_enable_routing_replay=routing_replay,
        )
    return TransformerConfig(**kwargs)


RECOMPUTE_MODES = ("none", "selective", "full")


def recompute_kwargs(mode: str, *, is_moe: bool, grouped_gemm: bool) -> dict[str, Any]:
    """megatron-core's recompute settings for ``model.recompute``.

    * ``none``: every activation is kept for backward.
    * ``selective``: granularity "selective" with ``recompute_modules`` = ``core_attn`` (the
      attention kernel; cheap to redo, and with an unfused backend the score matrix), ``mlp``
      (dense layers' MLP) and for MoE models ``moe`` (the whole routed-expert layer keeps only its input: the expert
      activations, top-k copies of every token, are most of an MoE layer's memory; redoing it
      repeats its token all-to-alls). Layer inputs and attention projections stay stored.
    * ``full``: granularity "full", method "uniform", one layer per unit: each transformer
      layer keeps only its input (2 bytes x hidden per token, sharded by sequence
      parallelism) and reruns its forward in backward (one more forward pass of compute).

    ``moe_act`` (output-discarding recompute of the expert activation) needs grouped GEMM
    in megatron; it is added to ``selective`` only where grouped GEMM is on.
    """
    if mode not in RECOMPUTE_MODES:
        raise UnsupportedConfigError(f"recompute={mode!r}: must be one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return {}
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    # "mlp" applies to dense layers only (megatron skips it on MoE layers), "moe" to MoE ones.
    modules = ["core_attn", "mlp"] + (["moe"] if is_moe else [])
    if is_moe and grouped_gemm:
        modules.append("moe_act")
    return dict(recompute_granularity="selective", recompute_modules=modules)


def _have_grouped_gemm() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
