"""Shared pieces of the Qwen3-MoE model tests: a tiny HF model and a megatron rank function."""

from __future__ import annotations

import os
import tempfile

import torch

VOCAB = 301  # deliberately not a multiple of anything: exercises vocabulary padding
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, intermediate_size=48,
            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], rope_theta=10000.0,
            rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False)


def tiny_hf_model(seed: int = 0, **overrides):
    """A random tiny ``Qwen3MoeForCausalLM`` and its checkpoint tensors (HF checkpoint names).

    Weights are drawn with a larger std than HF's init so that differences show up in the
    logits, and router rows are biased so that expert 0 takes most tokens (uneven routing).
    """
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**{**TINY, **overrides})
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
            if name.endswith("mlp.gate.weight"):
                p[0] += 0.3 * p[0].sign()  # expert 0 wins for most tokens
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        state = load_file(os.path.join(d, "model.safetensors"))
    return cfg, model, state


def _checkpoint_named_grads(model) -> dict[str, torch.Tensor]:
    """HF grads under checkpoint names: transformers 5 fuses experts in memory
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) but saves per expert."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                gate, up = g[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}{e}.up_proj.weight"] = up.clone()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = g[e].clone()
        else:
            out[name] = g.clone()
    return out


def hf_reference(model, batches, loss_w):
    """Logits per batch and the grads of ``mean_d sum(logits_d * loss_w)`` under HF names."""
    model.zero_grad(set_to_none=True)
    logits = []
    total = 0.0
    for b in batches:
        out = model(b).logits
        logits.append(out.detach())
        total = total + (out * loss_w).sum()
    (total / len(batches)).backward()
    grads = _checkpoint_named_grads(model)
    model.zero_grad(set_to_none=True)
    return logits, grads


def megatron_rank_fn(rank, world, layouts, state, hf_cfg, batches, loss_w):
    """For each (tp, ep): build the megatron model, load ``state``, run forward/backward
    through megatron DDP + finalize_model_grads, return logits and HF-named grads."""
    from megatron.core import parallel_state as mps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import (
        current_layout,
        load_hf_weights,
        merge_tp_shards,
        param_info,
        to_hf,
    )
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel

    results = []
    for tp, ep, etp in layouts:
        ctx = init_parallel(tp=tp, ep=ep, etp=etp)
        arch = Qwen3Arch.from_hf(hf_cfg)
        model = build_model(arch, tp=tp, ep=ep, etp=etp)
        layout = current_layout()
        load_hf_weights(model, state, arch, layout)
        ddp = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            module=model)
        ddp.zero_grad_buffer()
        dp_rank = mps.get_data_parallel_rank()
        tokens = batches[dp_rank]
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        logits = ddp(tokens, pos, attention_mask=None)  # [b, s, V_pad / tp]
        vshard = logits.shape[-1]
        w = torch.zeros(*loss_w.shape[:2], vshard * tp)
        w[..., : loss_w.shape[-1]] = loss_w
        w_local = w[..., ctx.rank_in(Axis.TP) * vshard:(ctx.rank_in(Axis.TP) + 1) * vshard]
        (logits * w_local).sum().backward()
        finalize_model_grads([ddp])

        grads = {}
        for name, p in model.named_parameters():
            info = param_info(name, arch, layout)
            group = ctx.group(Axis.ETP if info.is_expert else Axis.TP)
            size = torch.distributed.get_world_size(group)
            g = p.main_grad.detach().float().contiguous()
            shards = [torch.empty_like(g) for _ in range(size)]
            torch.distributed.all_gather(shards, g, group=group)
            full = merge_tp_shards(name, shards, arch, layout)
            for hf_name, t in to_hf(name, full, arch, layout):
                grads[hf_name] = t
        results.append(dict(logits=logits.detach(), grads=grads, dp_rank=dp_rank,
                            tp_rank=ctx.rank_in(Axis.TP)))
    return results
