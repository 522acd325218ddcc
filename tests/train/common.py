"""Tiny policy + judged multi-turn rollouts for the trainer tests."""

from __future__ import annotations

import numpy as np
import torch

from megatron_tg.chat import get_tiny_tokenizer
from megatron_tg.chat.builder import simulate_rollout
from megatron_tg.models.qwen3_moe import Qwen3Arch
from megatron_tg.rollout.routed_experts import RoutedExperts
from megatron_tg.sampling.train_sample import TrainSample
from tests.chat.convos import SEARCH_TOOL, conversation
from tests.models.qwen3_moe.common import tiny_hf_model


def tiny_policy(**model_kw):
    tok = get_tiny_tokenizer()
    cfg, model, state = tiny_hf_model(vocab_size=len(tok), **model_kw)
    return tok, cfg.to_dict(), state


def _hf_logprobs(state, cfg, ids):
    return _hf_forward(state, cfg, ids)[0]


def _hf_forward(state, cfg, ids):
    """(per-token log-probs, routed experts [T - 1, moe_layers, k]) of the HF model: what
    the embedded engine reports for these tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()
    # load checkpoint-named tensors into transformers 5's fused-expert modules
    sd = model.state_dict()
    for name in list(sd):
        if name.endswith("experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            sd[name] = torch.stack([torch.cat([state[f"{p}{e}.gate_proj.weight"],
                                               state[f"{p}{e}.up_proj.weight"]]) for e in
                                    range(sd[name].shape[0])])
        elif name.endswith("experts.down_proj"):
            p = name[: -len("down_proj")]
            sd[name] = torch.stack([state[f"{p}{e}.down_proj.weight"]
                                    for e in range(sd[name].shape[0])])
        else:
            sd[name] = state[name]
    model.load_state_dict(sd)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    lp = torch.log_softmax(out.logits[0].float(), -1)
    k = cfg["num_experts_per_tok"]
    routed = torch.stack([torch.topk(g.float().softmax(-1), k).indices for g in out.router_logits],
                         dim=1)[:-1]  # the last token is never fed to an engine
    return [0.0] + [lp[i - 1, t].item() for i, t in enumerate(ids) if i > 0], routed


def make_samples(tok, cfg, state, n: int = 4, seed: int = 0) -> list[TrainSample]:
    """n rollouts (2 per group) of the 4-turn fixture conversation, with varied lengths and
    failing turns; behaviour log-probs = the HF model's + noise (exercises TIS), routed
    experts = the HF model's (what the embedded engine returns; exercises routing replay)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(n):
        msgs = conversation()
        if k % 2:  # a shorter variant: drop the last two exchanges
            msgs = msgs[:6]
        ro = simulate_rollout(tok, msgs, tools=[SEARCH_TOOL], group_id=f"g{k // 2}",
                              rollout_id=f"r{k}")
        lps, routed = _hf_forward(state, cfg, ro.token_ids)
        arch = Qwen3Arch.from_hf(cfg)
        ro.routed_experts = RoutedExperts(routed.numpy().astype(np.uint8), arch.moe_layers,
                                          arch.num_experts)
        for seg in ro.assistant_turns():
            seg.logprobs = [lps[i] + 0.3 * float(torch.randn((), generator=g))
                            for i in range(seg.start, seg.end)]
        turns = ro.num_turns
        feedback = {0: "Use the lines= argument of the search tool."} if k != 1 else {}
        if k == 2 and turns > 2:
            feedback[turns - 1] = "End with a markdown table of what you changed."
        samples.append(TrainSample(ro, advantage=float(torch.randn((), generator=g)),
                                   feedback_by_turn=feedback))
    return samples


def step_rank_fn(rank, world, layouts, state, hf_cfg, samples, obj_cfgs, tok_dir, micro=1,
                 policy_kw=None):
    """For each layout ``(tp, ep, etp[, pp])`` and each objective config: one TG step of
    ``micro`` micro-batches per DP rank through megatron's schedule and DDP; returns loss
    (summed over the micro-batches) and HF-named grads (results[layout][config]).
    ``policy_kw``: extra ``build_model`` arguments of the policy (e.g. recompute, routing
    replay; with ``routing_replay`` the micro-batches carry the samples' routed experts)."""
    from megatron.core import parallel_state as mps
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from transformers import AutoTokenizer

    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import (current_layout, load_hf_weights,
                                                      merge_tp_shards, param_info, to_hf)
    from megatron_tg.objectives import TGObjective
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.batching import build_micro_batch
    from megatron_tg.train.pass_plan import build_pass_plan
    from megatron_tg.train.step import ops_reduce_hidden_grad, run_step

    tok = AutoTokenizer.from_pretrained(tok_dir)
    results = []
    for tp, ep, etp, *rest in layouts:
        pp = rest[0] if rest else 1
        ctx = init_parallel(tp=tp, ep=ep, etp=etp, pp=pp)
        arch = Qwen3Arch.from_hf(hf_cfg)
        policy_kw = policy_kw or {}
        model = build_model(arch, tp=tp, ep=ep, etp=etp, pp=pp, **policy_kw)
        layout = current_layout(model=model)
        load_hf_weights(model, state, arch, layout)
        ddp = DistributedDataParallel(config=model.config,
                                      ddp_config=DistributedDataParallelConfig(
                                          grad_reduce_in_fp32=True), module=model)
        dp, dp_rank = mps.get_data_parallel_world_size(), mps.get_data_parallel_rank()
        local = samples[dp_rank::dp]
        per_cfg = []
        for obj_cfg in obj_cfgs:
            ddp.zero_grad_buffer()
            row = 2 * max(len(s.rollout.token_ids) for s in samples)
            groups = [g for g in (local[k::micro] for k in range(micro)) if g]
            mbs = [build_micro_batch(g, tok, obj_cfg, row_tokens=row, pad_multiple=tp,
                                     routing_replay=bool(policy_kw.get("routing_replay")))
                   for g in groups]
            objective = TGObjective(obj_cfg, group=ctx.group(Axis.TP),
                                    reduce_hidden_grad=ops_reduce_hidden_grad(ddp))
            expert = None
            if obj_cfg.expert != "shared":  # a separate expert with its own (different) weights
                expert = build_model(arch, tp=tp, ep=ep, etp=etp, pp=pp)
                load_hf_weights(expert, {k: v * 1.1 for k, v in state.items()}, arch, layout)
            totals = dict(num_rollouts=len(local),
                          num_assistant_tokens=float(sum(int(m.policy.loss_mask.sum()) for m in mbs)),
                          num_gated_tokens=float(sum(float(m.policy.gate.sum()) for m in mbs)))
            outs = run_step(ddp, objective, mbs, build_pass_plan(mbs, ep=ep),
                            vocab_size=arch.vocab_size, expert_model=expert, **totals)
            loss = sum(o.loss for o in outs if o is not None)
            from megatron_tg.train.routing import clear_replay

            clear_replay(ddp)
            finalize_model_grads([ddp])
            grads = {}
            for name, p in model.named_parameters():
                info = param_info(name, arch, layout)
                group = ctx.group(Axis.ETP if info.is_expert else Axis.TP)
                g = p.main_grad.detach().float().contiguous()
                shards = [torch.empty_like(g) for _ in range(torch.distributed.get_world_size(group))]
                torch.distributed.all_gather(shards, g, group=group)
                for hf_name, t in to_hf(name, merge_tp_shards(name, shards, arch, layout), arch,
                                        layout):
                    grads[hf_name] = t
            per_cfg.append(dict(loss=loss, grads=grads, tp_rank=ctx.rank_in(Axis.TP),
                                pp_rank=ctx.rank_in(Axis.PP),
                                n_gated=int(sum(float(m.policy.gate.sum()) for m in mbs))))
        results.append(per_cfg)
    return results


def compare_step(per_rank, ref, dp, what):
    """Asserts equality within float32 tolerance; returns the max |difference| (loss, grads)."""
    loss = sum(r["loss"] for r in per_rank if r["tp_rank"] == 0 and r["pp_rank"] == 0) / dp
    torch.testing.assert_close(loss, ref["loss"], atol=1e-5, rtol=1e-4, msg=f"{what}: loss")
    # Every stage reports the last stage's loss (broadcast over the pipeline).
    assert len({float(r["loss"]) for r in per_rank if r["tp_rank"] == 0}) <= dp
    grads = {}
    for r in per_rank:
        grads.update(r["grads"])
    assert grads.keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(grads[name], g, atol=2e-5, rtol=2e-3, msg=f"{what}: {name}")
    return (float((loss - ref["loss"]).abs()),
            max(float((grads[k] - g).abs().max()) for k, g in ref["grads"].items()))
