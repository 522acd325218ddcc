"""The trainer's step under context parallelism equals CP 1's on the same samples.

``Trainer.train_step`` at ``parallel.cp=2`` (alone, with EP 2, with TP 2 and sequence
parallelism) against one rank at CP 1: the same loss and metrics, and the same accumulated
gradient by HF name after megatron's DDP has reduced it over DP x CP. The micro-batches carry
the judged rollouts' feedback (the gated KL runs, with the expert pass over whole expert
sequences: prefix reuse turns itself off under CP), routing replay and TIS. A forward pre-hook
on the decoder records how many tokens each rank's decoder sees: every CP rank's student and
expert passes get T_pad / CP tokens of each micro-batch, so a path that ran the whole sequence
on every rank cannot pass.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.train.common import make_samples, tiny_policy

pytestmark = pytest.mark.usefixtures("comm_rules")


def _step(rank, world, overrides, samples):
    from megatron.core import parallel_state as mps

    from megatron_tg.config import load_config
    from megatron_tg.models.qwen3_moe.mapping import current_layout, merge_tp_shards, to_hf
    from megatron_tg.train.trainer import Trainer

    trainer = Trainer(load_config("recipes/tiny_cpu.yaml", overrides))
    seen: list[int] = []

    def tokens(block, _args, kw):  # a later pipeline stage's input comes as the block's input_tensor
        h = kw.get("hidden_states")
        seen.append(int((h if h is not None else block.input_tensor).shape[0]))
    hook = trainer.gpt.decoder.register_forward_pre_hook(tokens, with_kwargs=True)
    dp = trainer.ctx.dims.dp
    dp_rank = mps.get_data_parallel_rank()
    metrics = trainer.train_step(samples[dp_rank::dp] if dp > 1 else samples)
    hook.remove()
    layout = current_layout(model=trainer.gpt)
    named = {}
    for name, p in trainer.gpt.named_parameters():
        g = p.main_grad.detach().clone()
        expert = ".experts." in name
        group = mps.get_expert_tensor_parallel_group() if expert else mps.get_tensor_model_parallel_group()
        size = torch.distributed.get_world_size(group)
        if size > 1 and getattr(p, "tensor_model_parallel", False):  # TP-merged, as HF holds it
            shards = [torch.empty_like(g) for _ in range(size)]
            torch.distributed.all_gather(shards, g, group=group)
            g = merge_tp_shards(name, shards, trainer.arch, layout)
        named.update(to_hf(name, g, trainer.arch, layout))
    return dict(metrics=metrics, grads=named, decoder_tokens=seen, prefix_reuse=trainer.prefix_reuse,
                cp_rank=mps.get_context_parallel_rank(), tp=trainer.ctx.dims.tp,
                pp=trainer.ctx.dims.pp, pp_rank=mps.get_pipeline_model_parallel_rank(),
                sequence_parallel=bool(trainer.gpt.config.sequence_parallel))


def _policy(tmp_path_factory, **model_kw):
    tok, cfg, state = tiny_policy(**model_kw)
    d = tmp_path_factory.mktemp("policy")
    from tests.models.qwen3_moe.common import tiny_hf_model

    _cfg, model, _state = tiny_hf_model(vocab_size=len(tok), **model_kw)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    samples = make_samples(tok, cfg, state)
    base = [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "objective.kl_coef=0.5", "optimizer.lr=1e-3",
            "optimizer.micro_batch_tokens=4096"]
    return base, samples


def _cp1(setup, tmp_path_factory, reuses):
    """CP 1 on one rank per ``objective.expert_prefix_reuse`` value."""
    base, samples = setup
    out = {}
    for reuse in reuses:
        run = tmp_path_factory.mktemp("cp1")
        out[reuse] = run_distributed(_step, 1, base + [
            f"objective.expert_prefix_reuse={str(reuse).lower()}", f"checkpoint.dir={run}/ckpt",
            f"logging.run_dir={run}/run"], samples)[0]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return _policy(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """CP 1 on one rank: as configured (prefix reuse on), and with prefix reuse off (the
    passes CP runs, for the token counts)."""
    return _cp1(setup, tmp_path_factory, (True, False))


LAYOUTS = {"cp2": (2, ["parallel.cp=2"]),
           "cp2-ep2": (2, ["parallel.cp=2", "parallel.ep=2"]),
           "cp2-tp2": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"])}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_step_equals_cp1(setup, reference, name, tmp_path):
    base, samples = setup
    world, extra = LAYOUTS[name]
    out = run_distributed(_step, world, base + extra + [f"checkpoint.dir={tmp_path}/ckpt",
                                                        f"logging.run_dir={tmp_path}/run"], samples)
    ref, passes = reference[True], reference[False]
    assert ref["prefix_reuse"] and not passes["prefix_reuse"] and not any(o["prefix_reuse"] for o in out)
    _compare(name, out, ref, passes)
    # Prefix reuse off changes nothing but the cost (the expert's states are the same).
    torch.testing.assert_close(passes["metrics"]["loss"], ref["metrics"]["loss"], atol=2e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def pp_setup(tmp_path_factory):
    """Two layers, one per stage: the first stage's is dense (no router to replay into)."""
    return _policy(tmp_path_factory, num_hidden_layers=2)


def test_cp2_pp2_step_equals_cp1_pp1(pp_setup, tmp_path_factory, tmp_path):
    """CP 2 x PP 2 (megatron's 1F1B schedule; stages exchange each micro-batch's CP share, its
    shape sent first since micro-batches differ in length) against CP 1 x PP 1 with prefix
    reuse off (the trainer turns it off under both PP and CP)."""
    base, samples = pp_setup
    ref = _cp1(pp_setup, tmp_path_factory, (False,))[False]
    out = run_distributed(_step, 4, base + ["parallel.cp=2", "parallel.pp=2",
                                            f"checkpoint.dir={tmp_path}/ckpt",
                                            f"logging.run_dir={tmp_path}/run"], samples)
    assert not ref["prefix_reuse"] and not any(o["prefix_reuse"] for o in out)
    assert all(o["pp"] == 2 for o in out) and sorted(o["pp_rank"] for o in out) == [0, 0, 1, 1]
    # Each stage holds its layer's parameters only: the union is the whole model.
    assert all(len(o["grads"]) < len(ref["grads"]) for o in out)
    _compare("cp2-pp2", out, ref, ref)
    # Every stage reports the last stage's loss.
    assert len({o["metrics"]["loss"] for o in out}) == 1


def _compare(name, out, ref, passes):
    """The CP run ``out`` (every rank's) against CP 1's ``ref``: metrics, every gradient by HF
    name, and each CP rank's decoder input (its share of every pass of ``passes``)."""
    m, r = out[0]["metrics"], ref["metrics"]
    assert m["kl/frac_gated"] > 0 and r["optim/grad_norm"] > 0
    keys = [k for k in r if not k.startswith(("time/", "throughput/"))]
    d_metrics = {k: abs(m[k] - r[k]) for k in keys}
    grads = {}  # under EP each rank holds its experts: the union by HF name
    for o in out:
        grads.update({n: g for n, g in o["grads"].items() if n not in grads})
    assert set(grads) == set(ref["grads"])
    d_grad = {n: (grads[n] - g).abs().max().item() for n, g in ref["grads"].items()}
    worst = max(d_grad, key=d_grad.get)
    per_rank = [(o["cp_rank"], o["decoder_tokens"]) for o in out]
    print(f"\n{name}: max |CP - CP1| loss {d_metrics['loss']:.3g}, metrics {max(d_metrics.values()):.3g} "
          f"({max(d_metrics, key=d_metrics.get)}), grads {d_grad[worst]:.3g} ({worst}); decoder "
          f"tokens per pass (rank: cp rank, passes): {per_rank}; CP 1: {passes['decoder_tokens']}")
    torch.testing.assert_close(m["loss"], r["loss"], atol=2e-6, rtol=1e-5)
    for k in keys:
        assert m[k] == pytest.approx(r[k], rel=1e-4, abs=2e-6), k
    for n, g in ref["grads"].items():
        torch.testing.assert_close(grads[n], g, atol=3e-7, rtol=1e-4, msg=n)
    # Every CP rank's decoder saw its share of every pass (the student's and the expert's,
    # in the same order on every rank), and together they cover the padded sequence: each
    # share is about half of CP 1's tokens (the pad to 2·CP per segment adds a few).
    by_cp = {}
    for o in out:
        by_cp.setdefault(o["cp_rank"], o["decoder_tokens"])
    assert sorted(by_cp) == [0, 1] and by_cp[0] == by_cp[1]
    tp_split = out[0]["tp"] if out[0]["sequence_parallel"] else 1
    full = passes["decoder_tokens"]  # [expert pass, student pass], as CP runs them
    assert len(by_cp[0]) == len(full)
    for share, whole in zip(by_cp[0], full):
        assert whole / 2 <= share * tp_split < whole / 2 + 64, (share, whole)


def _train_save_train(rank, world, overrides, samples, resume):
    """One step and a checkpoint (``resume`` False), or a resume of that checkpoint
    (``resume`` True); then two more steps. Returns the weights after the checkpoint (or the
    resume) by HF name (rank 0's view) and the two steps' metrics."""
    from megatron.core import parallel_state as mps

    from megatron_tg.config import load_config
    from megatron_tg.models.qwen3_moe.mapping import current_layout, to_hf
    from megatron_tg.train.trainer import Trainer

    trainer = Trainer(load_config("recipes/tiny_cpu.yaml", overrides))
    dp, dp_rank = trainer.ctx.dims.dp, mps.get_data_parallel_rank()
    mine = samples[dp_rank::dp] if dp > 1 else samples
    if resume:
        assert trainer.resume() is not None and trainer.step == 1
    else:
        trainer.train_step(mine)
        trainer.save({})
        trainer.checkpointer.finalize(blocking=True)
    layout = current_layout(model=trainer.gpt)

    def named(attr):
        return {hf: t.clone() for name, p in trainer.gpt.named_parameters()
                for hf, t in to_hf(name, (p.main_grad if attr else p).detach(), trainer.arch, layout)}
    saved = named(False)
    metrics = trainer.train_step(mine)
    third = trainer.train_step(mine)  # its loss reads the update the resumed Adam state made
    return dict(saved=saved, metrics=metrics, third=third)


@pytest.mark.parametrize("distopt", ["false", "true"])
def test_a_cp2_checkpoint_resumes_at_cp1(setup, tmp_path, distopt):
    """CP 2 trains a step and checkpoints (with the distributed optimizer: sharded over
    DP x CP); CP 1 resumes it: the same weights bit for bit, and its next step (loss, and the
    update the resumed Adam state makes) equals the CP 2 run's own next step. TIS's cap is
    raised out of reach here: a truncated importance weight is a step function of the
    log-probs, and one that sits at the cap flips with float noise between layouts."""
    base, samples = setup
    common = base + [f"checkpoint.dir={tmp_path}/ckpt", f"logging.run_dir={tmp_path}/run",
                     f"parallel.use_distributed_optimizer={distopt}", "objective.tis_cap=1000"]
    cp2 = run_distributed(_train_save_train, 2, common + ["parallel.cp=2"], samples, False)[0]
    cp1 = run_distributed(_train_save_train, 1, common, samples, True)[0]
    assert set(cp1["saved"]) == set(cp2["saved"])
    for n, w in cp2["saved"].items():
        assert torch.equal(cp1["saved"][n], w), n  # the checkpoint's weights, bit for bit
    a, b = cp1["metrics"], cp2["metrics"]
    a3, b3 = cp1["third"], cp2["third"]
    print(f"\nresume CP 2 -> CP 1 (distributed optimizer {distopt}): the next step's loss "
          f"{a['loss']:.7g} vs {b['loss']:.7g}, grad norm {a['optim/grad_norm']:.7g} vs "
          f"{b['optim/grad_norm']:.7g}; the step after: loss {a3['loss']:.7g} vs {b3['loss']:.7g} "
          f"(moved from {b['loss']:.7g} by the resumed optimizer's update)")
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-4)
    # Post-Adam weights are not compared element by element (Adam turns float noise on
    # near-zero gradients into lr-sized steps); the loss they give is.
    assert abs(b3["loss"] - b["loss"]) > 100 * abs(a3["loss"] - b3["loss"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="needs transformer-engine (the GPU extra)")
def test_cp_step_on_te_equals_cp1(setup, tmp_path):
    """The GPU twin of :func:`test_cp_step_equals_cp1` (the same ``_step``): TE's attention
    with ``cp_comm_type="p2p"`` on the THD shares, NCCL, bf16. CP 2 on 2 GPUs against CP 1 on
    one GPU: the loss within bf16 noise, and the gradients pointing the same way (cosine
    similarity per parameter) with each rank's decoder input its share."""
    base, samples = setup
    gpu = ["model.transformer_impl=te", "parallel.backend=nccl", "model.params_dtype=bfloat16"]
    runs = {}
    for name, world, extra in (("cp1", 1, []), ("cp2", 2, ["parallel.cp=2"])):
        runs[name] = run_distributed(_step, world, base + gpu + extra + [
            f"checkpoint.dir={tmp_path}/{name}/ckpt", f"logging.run_dir={tmp_path}/{name}/run"],
            samples, backend="nccl")
    ref, out = runs["cp1"][0], runs["cp2"]
    loss, loss1 = out[0]["metrics"]["loss"], ref["metrics"]["loss"]
    cos = {n: torch.nn.functional.cosine_similarity(out[0]["grads"][n].float().flatten(),
                                                    g.float().flatten(), dim=0).item()
           for n, g in ref["grads"].items() if g.abs().sum() > 0}
    print(f"\nTE CP 2 vs CP 1: loss {loss:.5g} vs {loss1:.5g}; lowest gradient cosine "
          f"{min(cos.values()):.4f} ({min(cos, key=cos.get)}); decoder tokens "
          f"{[o['decoder_tokens'] for o in out]} vs {ref['decoder_tokens']}")
    assert loss == pytest.approx(loss1, rel=2e-2, abs=1e-3)
    assert min(cos.values()) > 0.99
    for o in out:
        assert o["decoder_tokens"][-1] < ref["decoder_tokens"][-1]
