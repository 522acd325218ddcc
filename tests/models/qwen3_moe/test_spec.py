"""The layer-spec rewrite: norms on the local spec, the THD-capable core attention on both."""

from __future__ import annotations

import dataclasses

from megatron_tg.models.qwen3_moe.model import RMSNorm, _rewrite_spec


def _walk(spec, seen=None):
    from megatron.core.transformer.spec_utils import ModuleSpec

    seen = set() if seen is None else seen
    if id(spec) in seen:
        return
    seen.add(id(spec))
    if isinstance(spec, ModuleSpec):
        yield spec
        yield from _walk(spec.submodules, seen)
    elif isinstance(spec, (list, tuple)):
        for s in spec:
            yield from _walk(s, seen)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            yield from _walk(getattr(spec, f.name), seen)
    elif spec is not None:
        yield spec


def test_rewrite_swaps_norms_and_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_tg.models.qwen3_moe.attention import PackedDotProductAttention

    # One MoE layer's local spec (the block spec needs initialised parallel state).
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")

    def masks(s):
        return [m.params["attn_mask_type"] for m in _walk(s)
                if hasattr(m, "params") and m.params and "attn_mask_type" in m.params]

    def has(s, cls):
        return any(getattr(m, "module", m) is cls for m in _walk(s))

    assert masks(spec) and set(masks(spec)) == {AttnMaskType.causal}
    assert has(spec, WrappedTorchNorm) and has(spec, DotProductAttention)
    local = _rewrite_spec(spec, swap_norms=True, attention=PackedDotProductAttention)
    # Packed sequences are told apart by PackedSeqParams: the mask type stays causal.
    assert set(masks(local)) == {AttnMaskType.causal} and not has(local, WrappedTorchNorm)
    assert has(local, RMSNorm) and has(local, PackedDotProductAttention)
    assert not has(local, DotProductAttention)
    norms_only = _rewrite_spec(spec, swap_norms=False, attention=None)
    assert has(norms_only, WrappedTorchNorm) and has(norms_only, DotProductAttention)
    assert set(masks(spec)) == {AttnMaskType.causal}  # the input spec is not modified
    assert has(spec, DotProductAttention) and not has(spec, PackedDotProductAttention)
