"""Build the Qwen3(-MoE) policy as a megatron-core ``GPTModel``.

On GPU the Transformer-Engine layer spec is used; on CPU the local spec. Both get a core
attention that honours megatron's THD ``PackedSeqParams`` (the trainer's packed sequences,
:mod:`megatron_tg.models.qwen3_moe.attention`). On CPU one more substitution: megatron's
``WrappedTorchNorm`` refuses ``sequence_parallel`` (which MoE + TP requires), so every norm
becomes :class:`RMSNorm`, the same math as HF's ``Qwen3MoeRMSNorm`` (fp32 statistics) with
its weight tagged ``sequence_parallel`` so that ``finalize_model_grads`` all-reduces its
partial gradients over TP.

The output layer is megatron's vocab-parallel ``ColumnParallelLinear`` with
``parallel_output=True``: logits stay sharded ``[s, b, V_pad / TP]`` for the vocab-parallel
loss ops. ``V_pad`` (:func:`padded_vocab_size`) rows beyond the real vocabulary exist only
to make shards equal; the ops mask them by ``vocab_size``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_tg.models.qwen3_moe.config import (
    Qwen3Arch,
    padded_vocab_size,
    transformer_config,
)
from megatron_tg.parallel.dims import ParallelDims


class RMSNorm(torch.nn.Module):
    """RMSNorm with HF Qwen3's numerics and megatron's sequence-parallel tagging."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Under SP each TP rank normalises different tokens: the gradient is partial.
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rewrite_spec(spec: Any, *, swap_norms: bool, attention: type | None = None,
                  memo: dict[int, Any] | None = None) -> Any:
    """Walk a megatron ModuleSpec tree and

    * (``swap_norms``, the local spec) swap the torch-norm wrapper for :class:`RMSNorm`;
    * (``attention``) put that class in place of megatron's core attention (the local
      ``DotProductAttention`` or ``TEDotProductAttention``): the THD-capable classes of
      :mod:`megatron_tg.models.qwen3_moe.attention`. Mask types stay ``causal``: packed
      sequences are separated by ``PackedSeqParams``, not by a mask.

    Layer specs are shared between layers, so results are memoised by identity.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    memo = {} if memo is None else memo
    if swap_norms and spec is WrappedTorchNorm:
        return RMSNorm
    if attention is not None and isinstance(spec, type) and spec is not attention and (
            spec is DotProductAttention or spec.__name__ == "TEDotProductAttention"):
        return attention
    if id(spec) in memo:
        return memo[id(spec)]
    rec = lambda x: _rewrite_spec(x, swap_norms=swap_norms, attention=attention,  # noqa: E731
                                  memo=memo)
    if isinstance(spec, ModuleSpec):
        module = rec(spec.module) if isinstance(spec.module, type) else spec.module
        out = dataclasses.replace(spec, module=module, params=dict(spec.params or {}),
                                  submodules=rec(spec.submodules))
    elif isinstance(spec, (list, tuple)):
        out = type(spec)(rec(s) for s in spec)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        out = dataclasses.replace(spec, **{f.name: rec(getattr(spec, f.name))
                                           for f in dataclasses.fields(spec)})
    else:
        return spec
    memo[id(spec)] = out
    return out


def layer_spec(config, *, use_te: bool | None = None):
    """The decoder block spec: TE on GPU, local spec with :class:`RMSNorm` on CPU; both with
    the THD-capable core attention (see :func:`_rewrite_spec`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_tg.models.qwen3_moe.attention import PackedDotProductAttention, te_core_attention

    use_te = torch.cuda.is_available() if use_te is None else use_te
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    return _rewrite_spec(spec, swap_norms=not use_te,
                         attention=te_core_attention() if use_te else PackedDotProductAttention)


def build_model(hf_config: Any, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                etp: int | None = None, params_dtype: torch.dtype = torch.float32,
                vocab_pad_multiple: int = 128, pre_process: bool | None = None,
                post_process: bool | None = None, use_te: bool | None = None,
                seq_length: int | None = None, dims: ParallelDims | None = None,
                **config_overrides: Any):
    """Build this rank's shard of the policy. Parallel state must already be initialised.
    ``dims`` (the layout the parallel state was built from) wins over the loose sizes."""
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel

    if dims is not None:
        tp, pp, cp, ep, etp = dims.tp, dims.pp, dims.cp, dims.ep, dims.etp

    arch = hf_config if isinstance(hf_config, Qwen3Arch) else Qwen3Arch.from_hf(hf_config)
    config = transformer_config(arch, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                                params_dtype=params_dtype, **config_overrides)
    if pre_process is None:
        pre_process = mps.is_pipeline_first_stage()
    if post_process is None:
        post_process = mps.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, use_te=use_te),
        vocab_size=padded_vocab_size(arch.vocab_size, tp, vocab_pad_multiple),
        max_sequence_length=seq_length or arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # keep logits vocab-sharded: the loss ops never gather V
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(arch.rope_theta),
    )
    model.tg_arch = arch  # the HF-side facts travel with the model (vocab size, mapping)
    return model
