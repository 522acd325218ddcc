"""The layer-spec rewrite: norms on the local spec, attention mask types on the TE spec."""

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


def test_rewrite_swaps_norms_and_mask_types():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # One MoE layer's local spec (the block spec needs initialised parallel state).
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")

    def masks(s):
        return [m.params["attn_mask_type"] for m in _walk(s)
                if hasattr(m, "params") and m.params and "attn_mask_type" in m.params]

    def has_torch_norm(s):
        return any(getattr(m, "module", m) is WrappedTorchNorm for m in _walk(s))

    assert masks(spec) and set(masks(spec)) == {AttnMaskType.causal} and has_torch_norm(spec)
    local = _rewrite_spec(spec, swap_norms=True, arbitrary_masks=False)
    assert set(masks(local)) == {AttnMaskType.causal} and not has_torch_norm(local)
    assert any(getattr(m, "module", m) is RMSNorm for m in _walk(local))
    te_like = _rewrite_spec(spec, swap_norms=False, arbitrary_masks=True)
    assert set(masks(te_like)) == {AttnMaskType.arbitrary} and has_torch_norm(te_like)
    assert set(masks(spec)) == {AttnMaskType.causal}  # the input spec is not modified
