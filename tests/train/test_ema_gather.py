"""The gathered EMA expert (:mod:`megatron_tg.train.ema_gather`) against the replicated one.

Per layout (DP 2 with the CPU AdamW's shards, DP 2 with megatron's distributed optimizer in
bf16, DP 4 x EP 2 (experts gathered over expert-DP 2), TP 2 x DP 2, PP 2 x DP 2; both gather
scopes): one policy, one optimizer, two experts built from the same fp32 EMA shards (moved
off the policy so that the expert differs from it): a replicated copy and a gathered one.
One TG step of each through ``run_step`` (megatron's schedule and DDP): the loss and every
gradient are bit-identical, and so are the expert's log-probs of the student tokens. DP
rank 0 runs two micro-batches and the others one, so under the "layer" scope the other
ranks join rank 0's extra gathers with gather-only sweeps. The memory the expert's weights
take during its pass, measured at every gather and layer hook (the distinct storage its
parameters hold, plus the live gather buffer), equals what the unit sizes plan: the held
output weight plus the largest other unit (embedding or layer) plus its gather buffer
("layer"). The tiny model's vocabulary outweighs its layers, so here that is not far below
the full copy; at the recipes' sizes it is (``megatron-tg memory``, README).
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.train.common import make_samples
from tests.train.test_trainer import checkpoint  # noqa: F401  (the fixture)

# Every test here under NCCL's rules (tests/conftest.py: comm_rules; plain gloo on request).
pytestmark = pytest.mark.usefixtures("comm_rules")

# (name, tp, ep, pp, distributed optimizer, params dtype, gather scope)
WORLD2 = [("dp2", 1, 1, 1, False, "float32", "layer"),
          ("dp2_distopt_bf16", 1, 1, 1, True, "bfloat16", "layer"),
          ("dp2_step", 1, 1, 1, False, "float32", "step")]
WORLD4 = [("tp2xdp2", 2, 1, 1, True, "float32", "layer"),
          ("dp4xep2", 1, 2, 1, True, "float32", "layer"),
          ("pp2xdp2", 1, 1, 2, False, "float32", "layer")]


def _grads(model):
    return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}


def _compare_fn(rank, world, state, hf_cfg, samples, tok_dir, layouts):
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from transformers import AutoTokenizer

    from megatron_tg.config.objective import ObjectiveConfig
    from megatron_tg.config.train import OptimizerConfig
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.objectives import TGObjective, select_rows
    from megatron_tg.ops.vocab_parallel import fused_vocab_parallel_logprob
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.batching import build_micro_batch
    from megatron_tg.train.ema import ShardedEMA
    from megatron_tg.train.ema_gather import GatheredEMA
    from megatron_tg.train.optim import build_optimizer
    from megatron_tg.train.pass_plan import build_pass_plan
    from megatron_tg.train.step import ops_reduce_hidden_grad, run_forward, run_step

    tok = AutoTokenizer.from_pretrained(tok_dir)
    arch = Qwen3Arch.from_hf(hf_cfg)
    obj_cfg = ObjectiveConfig(mode="tg", kl_direction="forward", kl_coef=0.5, expert="ema")
    row = 2 * max(len(s.rollout.token_ids) for s in samples)
    out = {}
    for name, tp, ep, pp, distributed, dtype, scope in layouts:
        ctx = init_parallel(tp=tp, ep=ep, etp=1 if ep > 1 else tp, pp=pp, seed=3)
        dp, dp_rank = ctx.dims.dp, ctx.rank_in(Axis.DP)
        params_dtype = getattr(torch, dtype)
        build = lambda: build_model(arch, tp=tp, ep=ep, etp=1 if ep > 1 else tp, pp=pp,  # noqa: E731
                                    params_dtype=params_dtype)
        model = build()
        load_hf_weights(model, state, arch, current_layout(model=model))
        ddp = DistributedDataParallel(config=model.config, module=model,
                                      ddp_config=DistributedDataParallelConfig(
                                          grad_reduce_in_fp32=True,
                                          use_distributed_optimizer=distributed))
        optimizer = build_optimizer(ddp, OptimizerConfig(lr=1e-3), distributed=distributed,
                                    bf16=params_dtype == torch.bfloat16)
        experts, emas = [], []
        for replicated in (True, False):
            expert = build()
            expert.load_state_dict(model.state_dict())
            for p in expert.parameters():
                p.requires_grad_(False)
            ema = ShardedEMA(optimizer, expert.eval(), model, 0.9, replicated=replicated)
            for e, s in zip(ema.ema, ema.shards):  # an average that is not the policy
                e.add_(0.02 * torch.cos(torch.arange(s.start, s.start + e.numel(),
                                                     dtype=torch.float32)))
            experts.append(expert)
            emas.append(ema)
        emas[0].copy_to_expert()
        full_bytes = sum(p.numel() * p.element_size() for p in experts[0].parameters())
        gathered = GatheredEMA(emas[1], experts[1], scope)
        assert all(p.numel() == 0 for p in experts[1].parameters())  # no copy outside a pass

        local = samples[dp_rank::dp]
        groups = [local[:1], local[1:]] if dp_rank == 0 else [local]  # uneven micro-batches
        mbs = [build_micro_batch(g, tok, obj_cfg, row_tokens=row, pad_multiple=tp)
               for g in groups if g]
        objective = TGObjective(obj_cfg, group=ctx.group(Axis.TP),
                                reduce_hidden_grad=ops_reduce_hidden_grad(ddp))
        totals = dict(num_rollouts=float(len(local)),
                      num_assistant_tokens=float(sum(int(m.policy.loss_mask.sum()) for m in mbs)),
                      num_gated_tokens=float(sum(float(m.policy.gate.sum()) for m in mbs)))
        tp_group = ctx.group(Axis.TP)

        def logprobs(o, mb=mbs[0]):
            return fused_vocab_parallel_logprob(select_rows(o.hidden, mb.rows), o.output_weight,
                                                mb.policy.target_ids, tp_group,
                                                vocab_size=arch.vocab_size).clone()

        plan = build_pass_plan(mbs, ep=ep)
        runs = []
        for expert, weights in ((experts[0], None), (experts[1], gathered)):
            ddp.zero_grad_buffer()
            gathered.peak_bytes = 0
            results = run_step(ddp, objective, mbs, plan,
                               vocab_size=arch.vocab_size, expert_model=expert,
                               expert_weights=weights, **totals)
            finalize_model_grads([ddp])
            peak = gathered.peak_bytes
            with torch.no_grad(), (weights.expert_pass(1) if weights else _null()):
                lp = run_forward(expert, mbs[0].student, logprobs)
            runs.append(dict(loss=[r.loss for r in results if r is not None],
                             grads=_grads(model), logprobs=lp, peak=peak))
        # The largest unit gathered at a hook, sized on the replicated expert's modules.
        layer = max(sum(p.numel() * p.element_size()
                        for p in experts[0].get_submodule(u.name).parameters())
                    for u in gathered.units if not u.held)
        head = (experts[0].output_layer.weight if experts[0].post_process
                and experts[0].output_layer.weight is not None else None)
        out[name] = dict(runs=runs, full_bytes=full_bytes, layer_bytes=layer,
                         head_bytes=0 if head is None else head.numel() * head.element_size(),
                         planned=gathered.planned_peak_bytes(),
                         buffer=max(gathered.buffer_bytes(u) for u in gathered.units),
                         gathers=gathered.gathers, units=len(gathered.units),
                         held=sum(u.held for u in gathered.units), passes=len(plan.expert_passes),
                         last=experts[0].post_process)
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def setup():
    from megatron_tg.chat import get_tiny_tokenizer
    from tests.models.qwen3_moe.common import tiny_hf_model

    tok = get_tiny_tokenizer()
    cfg, _, state = tiny_hf_model(vocab_size=len(tok), num_hidden_layers=4)
    cfg = cfg.to_dict()
    return tok, cfg, state, make_samples(tok, cfg, state, n=8)


@pytest.mark.parametrize("world,layouts", [(2, WORLD2), (4, WORLD4)],
                         ids=["dp2+distopt+step", "tp2xdp2+dp4xep2+pp2xdp2"])
def test_gathered_ema_expert_equals_replicated_bitwise(setup, world, layouts):
    tok, cfg, state, samples = setup
    out = run_distributed(_compare_fn, world, state, cfg, samples, tok.name_or_path, layouts,
                          timeout=1200)
    for name, *_ , scope in layouts:
        for rank, per_rank in enumerate(out):
            r = per_rank[name]
            rep, gat = r["runs"]
            assert rep["loss"] and len(rep["loss"]) == len(gat["loss"]), name
            for a, b in zip(rep["loss"], gat["loss"]):
                assert torch.equal(a, b), f"{name} rank {rank}: loss {a} != {b}"
            assert rep["grads"].keys() == gat["grads"].keys()
            for k, g in rep["grads"].items():
                assert torch.equal(g, gat["grads"][k]), f"{name} rank {rank}: grad {k}"
            assert any(g.abs().sum() > 0 for g in rep["grads"].values())
            assert torch.equal(rep["logprobs"], gat["logprobs"]), f"{name} rank {rank}: logprobs"
            # Memory: measured == planned from the sizes; per layer: head + one layer + buffer.
            assert gat["peak"] == r["planned"], (name, rank, gat["peak"], r["planned"])
            if scope == "layer":
                assert gat["peak"] <= r["head_bytes"] + r["layer_bytes"] + r["buffer"], name
                assert gat["peak"] >= r["head_bytes"] + r["layer_bytes"], name
                # The extra micro-batch's gathers on rank 0 are joined by every other rank.
                most = max(p[name]["passes"] for p in out)
                # Two passes (run_step's, then the log-probs'); the held head once per pass.
                assert r["gathers"] == 2 * r["held"] + (most + 1) * (r["units"] - r["held"]), name
            else:
                assert r["gathers"] == 2 * r["units"], name  # once per step, two steps
            print(f"{name} rank {rank}: loss, {len(rep['grads'])} grads and {rep['logprobs'].numel()}"
                  f" log-probs bit-equal; expert weights during the pass: peak "
                  f"{gat['peak']:,} B (head {r['head_bytes']:,} + largest unit "
                  f"{r['layer_bytes']:,} + buffer <= {r['buffer']:,}) vs the replicated copy "
                  f"{r['full_bytes']:,} B")


def _trainer_fn(rank, world, overrides, root, samples):
    from megatron_tg.config import load_config
    from megatron_tg.train.trainer import Trainer

    out = {}
    for weights in ("replicated", "gathered"):
        cfg = load_config("recipes/tiny_cpu.yaml", overrides + [
            f"objective.ema_weights={weights}", f"checkpoint.dir={root}/{weights}/ckpt",
            f"logging.run_dir={root}/{weights}/run"])
        trainer = Trainer(cfg)
        dp = trainer.ctx.dims.dp
        local = samples[rank % dp::dp]
        metrics = [trainer.train_step(local) for _ in range(2)]
        trainer.save({})
        trainer.checkpointer.finalize(blocking=True)
        again = Trainer(cfg)
        again.resume()
        out[weights] = dict(metrics=metrics, ema=trainer.ema.full_state(),
                            resumed=again.ema.full_state(), after=again.train_step(local),
                            expert_numel=sum(p.numel() for p in trainer.expert_model.parameters()))
    return out


def test_trainer_with_the_gathered_ema_expert_equals_the_replicated_and_resumes(checkpoint,  # noqa: F811
                                                                               tmp_path):
    """Two trainer steps at DP 2 (CPU recipe, EMA expert, several micro-batches) with
    ema_weights=gathered: the step metrics and the fp32 average equal the replicated expert's
    bit for bit; its checkpoint (the same entries: the fp32 average in model space) resumes
    exactly, and the step after the resume matches too."""
    d, tok, cfg, state = checkpoint
    samples = make_samples(tok, cfg, state)
    over = [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "optimizer.lr=1e-3",
            "optimizer.micro_batch_tokens=1024", "objective.expert=ema", "objective.ema_decay=0.5",
            "objective.kl_direction=forward", "objective.kl_coef=0.5"]
    out = run_distributed(_trainer_fn, 2, over, str(tmp_path), samples, timeout=1200)
    for rank, r in enumerate(out):
        rep, gat = r["replicated"], r["gathered"]
        assert gat["expert_numel"] == 0 and rep["expert_numel"] > 0
        assert rep["metrics"][0]["train/micro_batches"] > 1
        for a, b in zip(rep["metrics"] + [rep["after"]], gat["metrics"] + [gat["after"]]):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), (rank, k, a[k], b[k])
        assert rep["metrics"][1]["kl/frac_gated"] > 0
        for n, t in rep["ema"].items():
            assert torch.equal(t, gat["ema"][n]), n
            assert torch.equal(gat["resumed"][n], gat["ema"][n]), n
        print(f"rank {rank}: 3 steps' metrics and {len(rep['ema'])} EMA tensors bit-equal; "
              f"loss {[m['loss'] for m in gat['metrics']]}, after resume {gat['after']['loss']}")
