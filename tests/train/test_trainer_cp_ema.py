"""The EMA expert under context parallelism: sharded over DP x CP, gathered exactly, and
the expert it gives at CP 2 is CP 1's.

CP 2 trains one step with ``objective.expert=ema`` (the gathered expert with megatron's
distributed optimizer; the replicated expert with the CPU AdamW's equal ranges) and
checkpoints; CP 1 resumes the checkpoint. Checked: every fp32 shard's group is the DP x CP
pair and the two CP ranks' ranges partition every parameter; the gathered average is the
closed form d·θ_0 + (1 − d)·θ_1 of the gathered weights, exactly (an average summed twice
over the CP pair, or one CP rank's half alone, fails); the CP 1 resume reads it back bit for
bit; and the next step, whose expert is that average, gives the same expert hidden states at
the gated rows, the same per-row KL to the expert and the same metrics at CP 2 and CP 1."""

from __future__ import annotations

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.train.common import make_samples, tiny_policy

pytestmark = pytest.mark.usefixtures("comm_rules")

DECAY = 0.5  # an average far from both θ_0 and θ_1


class _Recorder:
    """The trainer's objective, recording what the expert gave each micro-batch."""

    def __init__(self, objective):
        self.objective, self.seen = objective, []

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def __call__(self, batch):
        out = self.objective(batch)
        if batch.expert_hidden is not None and batch.expert_hidden.shape[0]:
            self.seen.append(dict(expert_hidden=batch.expert_hidden.detach().clone(),
                                  kl=out.rows["kl"].detach().clone()))
        return out


def _ema_step(rank, world, overrides, samples, resume):
    from megatron.core import parallel_state as mps

    from megatron_tg.config import load_config
    from megatron_tg.train.trainer import Trainer

    trainer = Trainer(load_config("recipes/tiny_cpu.yaml", overrides))
    ema = trainer.ema
    weights = lambda: {n: p.detach().float().clone() for n, p in trainer.gpt.named_parameters()}  # noqa: E731
    out = dict(groups=sorted({torch.distributed.get_process_group_ranks(s.group).__len__()
                              for s in ema.shards if s.group is not None}),
               ranges={n: (s.start, e.numel()) for n, s, e in zip(ema.names, ema.shards, ema.ema)},
               numel={n: s.param.numel() for n, s in zip(ema.names, ema.shards)},
               cp_rank=mps.get_context_parallel_rank(), cp=trainer.ctx.dims.cp)
    if resume:
        assert trainer.resume() is not None and trainer.step == 1
    else:
        out["initial"], out["ema_initial"] = weights(), ema.full_state()
        trainer.train_step(samples)
        trainer.save({})
        trainer.checkpointer.finalize(blocking=True)
        out["trained"] = weights()
    out["ema"] = ema.full_state()
    if ema.replicated:
        out["expert"] = {n: p.detach().clone() for n, p in trainer.expert_model.named_parameters()}
    trainer.objective = recorder = _Recorder(trainer.objective)
    out["metrics"] = trainer.train_step(samples)  # its expert: the average after step 1
    out["seen"] = recorder.seen
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.models.qwen3_moe.common import tiny_hf_model

    tok, cfg, state = tiny_policy()
    d = tmp_path_factory.mktemp("policy")
    _cfg, model, _state = tiny_hf_model(vocab_size=len(tok))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    base = [f"model.hf_config={d}", f"model.hf_checkpoint={d}", "model.seq_length=1024",
            "rollout.max_context_tokens=1024", "objective.kl_coef=0.5", "optimizer.lr=1e-3",
            "optimizer.micro_batch_tokens=4096", "objective.expert=ema",
            f"objective.ema_decay={DECAY}", "objective.kl_direction=forward",
            "objective.tis_cap=1000"]  # a capped TIS weight flips with float noise
    return base, make_samples(tok, cfg, state)


LAYOUTS = {"gathered-distopt": ["objective.ema_weights=gathered", "parallel.use_distributed_optimizer=true"],
           "replicated": ["objective.ema_weights=replicated", "parallel.use_distributed_optimizer=false"]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_ema_expert_at_cp2_equals_cp1(setup, tmp_path, name):
    base, samples = setup
    common = base + LAYOUTS[name] + [f"checkpoint.dir={tmp_path}/ckpt", f"logging.run_dir={tmp_path}/run"]
    cp2 = run_distributed(_ema_step, 2, common + ["parallel.cp=2"], samples, False)
    cp1 = run_distributed(_ema_step, 1, common, samples, True)[0]
    assert [o["cp"] for o in cp2] == [2, 2] and sorted(o["cp_rank"] for o in cp2) == [0, 1]
    # Sharded over DP x CP (the pair here): the CP ranks' ranges of every parameter partition
    # it (megatron's distributed optimizer cuts buckets, so one rank may own a whole
    # parameter), and each rank holds part of the model.
    assert all(o["groups"] == [2] for o in cp2) and cp1["groups"] in ([], [1])
    numel = {n: k for o in cp2 for n, k in o["numel"].items()}
    for n, k in numel.items():
        end = 0
        for start, count in sorted(o["ranges"][n] for o in cp2 if n in o["ranges"]):
            assert start == end, n
            end += count
        assert end == k, n
    held = [sum(c for _, c in o["ranges"].values()) for o in cp2]
    assert sum(held) == sum(numel.values()) and min(held) > 0, held
    r0 = cp2[0]
    # Gathered exactly: the average starts at the weights and moves by the closed form.
    for o in cp2:
        for n, t in o["ema"].items():
            assert torch.equal(o["ema_initial"][n], r0["initial"][n]), n
            want = r0["initial"][n].lerp(r0["trained"][n], 1.0 - DECAY)
            assert torch.equal(t, want), n
            assert torch.equal(cp1["ema"][n], t), n  # the CP 1 resume reads it back
            if "expert" in o:
                assert torch.equal(o["expert"][n], t.to(o["expert"][n].dtype)), n
    moved = sum(int((r0["ema"][n] != r0["initial"][n]).sum()) for n in r0["ema"])
    # The next step: its expert (the average) gives CP 1's hidden states, KL and metrics.
    s2, s1 = r0["seen"], cp1["seen"]
    assert len(s2) == len(s1) > 0
    d_hidden = max((a["expert_hidden"] - b["expert_hidden"]).abs().max().item() for a, b in zip(s2, s1))
    d_kl = max((a["kl"] - b["kl"]).abs().max().item() for a, b in zip(s2, s1))
    m2, m1 = r0["metrics"], cp1["metrics"]
    keys = [k for k in m1 if not k.startswith(("time/", "throughput/"))]
    d_metrics = {k: abs(m2[k] - m1[k]) for k in keys}
    rows = sum(a["expert_hidden"].shape[0] for a in s1)
    print(f"\n{name}: {len(r0['ema'])} EMA tensors exact at CP 2 ({moved} elements moved) and "
          f"bit-equal after the CP 1 resume; the next step's expert at {rows} gated rows: max "
          f"|CP2 - CP1| hidden {d_hidden:.3g}, KL {d_kl:.3g}, loss {d_metrics['loss']:.3g}, "
          f"metrics {max(d_metrics.values()):.3g} ({max(d_metrics, key=d_metrics.get)}); "
          f"kl/mean_gated {m1['kl/mean_gated']:.5g}")
    assert moved > 0 and rows > 0 and m1["kl/frac_gated"] > 0
    for a, b in zip(s2, s1):
        torch.testing.assert_close(a["expert_hidden"], b["expert_hidden"], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(a["kl"], b["kl"], atol=2e-6, rtol=1e-4)
    for k in keys:
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=2e-6), k
