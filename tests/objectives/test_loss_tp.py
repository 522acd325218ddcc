"""The whole objective at TP=2 (one gloo world) equals the single-process objective."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives import TGObjective
from megatron_tg.testing.distributed import run_distributed
from tests.objectives.fixtures import rollout_batch

VOCAB, PADDED, HIDDEN = 7, 8, 5


def _compare(rank, world, cfg, fused: bool) -> float:
    gen = torch.Generator().manual_seed(17)
    vs = PADDED // world
    hid = torch.randn(10, HIDDEN, generator=gen, dtype=torch.float64)
    hid_e = torch.randn(10, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64)
    z, ze = hid @ w[:VOCAB].t(), hid_e @ w[:VOCAB].t()
    kw = dict(lengths=[4, 6], failed=[[1, 2], [0, 5]], thinking=[[0], [0, 1]], vocab=VOCAB, cfg=cfg)
    ref_batch = rollout_batch(logits=z, expert_logits_full=ze, **kw)
    ref = TGObjective(cfg)(ref_batch)
    ref.loss.backward()

    local = rollout_batch(logits=z, expert_logits_full=ze, **kw)
    cols = slice(rank * vs, (rank + 1) * vs)
    if fused:
        h, wl = hid.clone().requires_grad_(True), w[cols].clone().requires_grad_(True)
        local = dataclasses.replace(local, hidden=h, output_weight=wl,
                                    expert_hidden=hid_e[local.gate_index])
    else:
        # The logits as hidden states through this rank's rows of an identity output weight:
        # its local logits are its vocabulary shard of z. The padding's weight rows are NaN,
        # so reading a padded column would show; without the hidden-gradient all-reduce each
        # rank's gradient is its own shard's.
        pad = torch.zeros(10, PADDED, dtype=torch.float64)
        pad_e = pad.clone()
        pad[:, :VOCAB], pad_e[:, :VOCAB] = z, ze
        head = torch.eye(PADDED, dtype=torch.float64)
        head[VOCAB:] = float("nan")
        local = dataclasses.replace(local, hidden=pad.clone().requires_grad_(True),
                                    output_weight=head[cols], expert_hidden=pad_e[local.gate_index])
    out = TGObjective(cfg, group=dist.group.WORLD, reduce_hidden_grad=fused)(local)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
    for key in ref.metrics:
        torch.testing.assert_close(out.metrics[key].double(), ref.metrics[key].double(),
                                   rtol=1e-10, atol=1e-12, equal_nan=True, msg=key)
    full_grad = torch.zeros(10, PADDED, dtype=torch.float64)
    full_grad[:, :VOCAB] = ref_batch.hidden.grad
    if fused:
        torch.testing.assert_close(local.hidden.grad, full_grad @ w)
        torch.testing.assert_close(local.output_weight.grad, full_grad[:, cols].t() @ hid)
    else:
        shard = torch.zeros_like(full_grad)
        shard[:, cols] = full_grad[:, cols]
        torch.testing.assert_close(local.hidden.grad, shard)
    return out.loss.item()


def objective_world(rank, world):
    losses = []
    for direction in ("reverse", "forward", "jsd"):
        cfg = ObjectiveConfig(mode="tg", kl_coef=0.5, kl_direction=direction, logits_chunk_size=3,
                              kl_diagnostics=True)
        losses.append(_compare(rank, world, cfg, fused=False))
    losses.append(_compare(rank, world, ObjectiveConfig(mode="always_on", kl_coef=2.0,
                                                        kl_diagnostics=True), fused=True))
    return losses


def test_objective_tp2_matches_single_process():
    results = run_distributed(objective_world, 2)
    assert results[0] == results[1] and len(results[0]) == 4
