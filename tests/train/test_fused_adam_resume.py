"""Adam's moments survive save -> resume bit-exact with megatron's distributed optimizer
around an optimizer that keeps its state like Transformer Engine's FusedAdam
(:mod:`tests.train.te_style_adam`), with and without the EMA expert.

The EMA expert reads the optimizer's fp32 main parameters when it is built, in
``Trainer.__init__``, before any resume. Reading them through megatron's
``_get_main_param_and_optimizer_states`` left an empty ``optimizer.state[p]`` entry per
parameter; megatron's ``load_state_dict`` then saw a non-empty state, allocated no moments to
load into, and loaded only ``param``; FusedAdam's first step found empty entries and started
the moments from zero while the step counter said otherwise. Here a run of 3 steps (saved
after step 2) is compared with a run resumed from that save: the loaded moments and step
counter equal the saved ones bit for bit, and the resumed step 3 gives the uninterrupted
run's weights bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import tiny_hf_model

pytestmark = pytest.mark.usefixtures("comm_rules")


def _grads(model, step: int) -> dict[str, torch.Tensor]:
    """The same gradient on every DP rank (so the DP mean is it), different per step."""
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) * 1e-2 for n, p in model.named_parameters()}


def _moments(opt) -> dict:
    """This rank's Adam state of the distributed optimizer's shards, in parameter order."""
    out = {}
    for k, o in enumerate(getattr(opt.opt, "chained_optimizers", [opt.opt])):
        inner = o.optimizer
        out[f"steps{k}"] = [g.get("step") for g in inner.param_groups]
        for gi, group in enumerate(inner.param_groups):
            for pi, p in enumerate(group["params"]):
                st = inner.state.get(p, {})
                out[f"{k}.{gi}.{pi}"] = {n: st[n].clone() for n in ("exp_avg", "exp_avg_sq")
                                         if n in st}
    return out


def _run_fn(rank, world, state, hf_cfg, root, ema_expert, resume):
    """3 steps, saving after step 2; or (``resume``) load step 2 and run step 3. Returns the
    moments right after the save/load, and the weights after step 3."""
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)

    from megatron_tg.config.train import OptimizerConfig
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.checkpoint import Checkpointer
    from megatron_tg.train.ema import ShardedEMA
    from megatron_tg.train.optim import build_optimizer
    from tests.train.te_style_adam import TEStyleAdam, install

    install()
    init_parallel(tp=1, seed=5)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=1)
    if not resume:  # resumed: only the checkpoint can supply the weights
        load_hf_weights(model, state, arch, current_layout())
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(
                                      grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    opt = build_optimizer(ddp, OptimizerConfig(lr=1e-3, grad_clip=0.0), distributed=True)
    assert isinstance(opt.opt.optimizer, TEStyleAdam)
    expert = ema = None
    if ema_expert:  # built as Trainer.__init__ builds it: before any step or resume
        expert = build_model(arch, tp=1)
        expert.load_state_dict(model.state_dict())
        ema = ShardedEMA(opt, expert, model, decay=0.5)
    ckpt = Checkpointer(root, keep_last=2)

    def step(i):
        opt.zero_grad()
        for n, p in model.named_parameters():
            p.main_grad.copy_(_grads(model, i)[n])
        finalize_model_grads([ddp])
        assert opt.step()["skipped"] == 0.0
        if ema is not None:
            ema.update()

    if resume:
        assert ckpt.load(ckpt.latest(), ddp, opt, expert, ema)["step"] == 2
    else:
        for i in range(2):
            step(i)
        ckpt.save(2, ddp, opt, {}, expert, ema)
    moments = _moments(opt)
    step(2)
    return dict(moments=moments,
                weights={n: p.detach().clone() for n, p in model.named_parameters()},
                expert={} if expert is None else
                {n: p.detach().clone() for n, p in expert.named_parameters()})


@pytest.mark.parametrize("ema_expert", [False, True], ids=["no_expert", "ema_expert"])
def test_fused_adam_moments_survive_resume(tmp_path, ema_expert):
    cfg, _, state = tiny_hf_model(seed=0, num_hidden_layers=2)
    root = str(tmp_path / "ckpt")
    whole = run_distributed(_run_fn, 2, state, cfg.to_dict(), root, ema_expert, False)
    resumed = run_distributed(_run_fn, 2, state, cfg.to_dict(), root, ema_expert, True)
    for rank, (w, r) in enumerate(zip(whole, resumed)):
        saved, loaded = w["moments"], r["moments"]
        assert saved.keys() == loaded.keys()
        # FusedAdam's one counter per param group (groups without parameters never step)
        assert all(set(s) <= {2, None} and 2 in s for k, s in saved.items() if k.startswith("steps"))
        for key, st in saved.items():
            if key.startswith("steps"):
                assert loaded[key] == st, (rank, key, loaded[key])
                continue
            assert set(st) == {"exp_avg", "exp_avg_sq"}, (rank, key)
            assert set(loaded[key]) == set(st), (rank, key, "moments not loaded")
            for n in st:
                assert torch.equal(loaded[key][n], st[n]), (rank, key, n)
            assert st["exp_avg_sq"].abs().sum() > 0  # the moments saved are not zeros
        for n, t in w["weights"].items():
            assert torch.equal(r["weights"][n], t), (rank, n)
        for n, t in w["expert"].items():
            assert torch.equal(r["expert"][n], t), (rank, n)
