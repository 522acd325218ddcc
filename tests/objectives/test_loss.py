"""The composed objective: gating, exact GRPO equivalence, stop-gradient, normalisation, metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives import TGObjective, flat_positions, select_rows
from tests.objectives.fixtures import rollout_batch
from tests.ops.reference import ref_kl


def _grads(cfg, batch):
    out = TGObjective(cfg)(batch)
    out.loss.backward()
    return out, batch.hidden.grad.clone()


@pytest.mark.parametrize("direction", ["reverse", "forward", "jsd"])
def test_tg_equals_grpo_bitwise_when_every_criterion_passes(direction):
    kw = dict(lengths=[4, 3, 5], seed=1, thinking=[[0, 1]])
    tg_cfg = ObjectiveConfig(mode="tg", kl_coef=1.0, kl_direction=direction)
    tg, tg_grad = _grads(tg_cfg, rollout_batch(failed=[], cfg=tg_cfg, **kw))
    grpo, grpo_grad = _grads(ObjectiveConfig(mode="grpo"), rollout_batch(failed=[], **kw))
    assert "kl" not in tg.terms
    assert torch.equal(tg.loss, grpo.loss) and torch.equal(tg_grad, grpo_grad)
    assert tg.metrics["kl/frac_gated"].item() == 0.0
    # Not vacuous: one failing turn makes them differ.
    failing, _ = _grads(tg_cfg, rollout_batch(failed=[[2]], cfg=tg_cfg, **kw))
    assert "kl" in failing.terms and not torch.equal(failing.loss, grpo.loss)


def test_loss_is_sum_of_named_terms_and_kl_matches_closed_form():
    cfg = ObjectiveConfig(mode="tg", kl_coef=0.3)
    batch = rollout_batch([4, 3, 5], failed=[[1, 2], [], [0, 3, 4]], cfg=cfg, seed=2)
    out = TGObjective(cfg)(batch)
    assert torch.equal(out.loss, out.terms["pg"] + out.terms["kl"])
    gi = batch.gate_index
    kl = ref_kl(batch.hidden.detach()[gi], batch.expert_hidden, "reverse")
    # rollout_gated: mean over each rollout's gated rows; rollout 1 has none and counts 0; / 3 rollouts.
    want = (kl[:2].mean() + 0 + kl[2:].mean()) / 3
    assert out.terms["kl"].item() == pytest.approx(0.3 * want.item(), rel=1e-12)
    assert out.metrics["kl/mean_gated"].item() == pytest.approx(kl.mean().item(), rel=1e-12)
    assert out.metrics["kl/frac_gated"].item() == pytest.approx(5 / 12)
    assert out.metrics["kl/coef"].item() == pytest.approx(0.3)
    for key in ("entropy/all", "entropy/gated", "pg/clip_frac", "pg/is_weight_mean",
                "pg/is_weight_max", "pg/is_frac_truncated"):
        assert torch.isfinite(out.metrics[key]), key


def test_expert_is_stop_gradient():
    cfg = ObjectiveConfig(mode="tg", kl_coef=1.0)
    batch = rollout_batch([3, 3], failed=[[0, 1], [2]], cfg=cfg)
    batch.expert_hidden.requires_grad_(True)
    TGObjective(cfg)(batch).loss.backward()
    assert batch.expert_hidden.grad is None
    assert batch.hidden.grad[batch.gate_index].abs().sum() > 0


def _kl_term(norm, lengths, failed, logits, expert):
    cfg = ObjectiveConfig(mode="tg", kl_coef=1.0, kl_token_normalization=norm)
    b = rollout_batch(lengths, failed=failed, cfg=cfg, logits=logits, expert_logits_full=expert)
    return TGObjective(cfg, compute_entropy=False)(b).terms["kl"].item()


@pytest.mark.parametrize("norm", ["rollout_gated", "rollout_assistant", "global"])
def test_doubling_a_rollout_does_not_double_its_weight(norm):
    gen = torch.Generator().manual_seed(5)
    zs, ze = torch.randn(5, 7, generator=gen, dtype=torch.float64), torch.randn(5, 7, generator=gen, dtype=torch.float64)
    # Rollout 0 = rows 0-1 (both failing), rollout 1 = rows 2-4 (all failing).
    base = _kl_term(norm, [2, 3], [[0, 1], [0, 1, 2]], zs, ze)
    # Rollout 1 played twice as long with the same per-token divergences.
    zs2 = torch.cat([zs, zs[2:]]); ze2 = torch.cat([ze, ze[2:]])
    doubled = _kl_term(norm, [2, 6], [[0, 1], [0, 1, 2, 3, 4, 5]], zs2, ze2)
    if norm == "global":
        assert doubled != pytest.approx(base)  # token-level: the long rollout does weigh more
    else:
        assert doubled == pytest.approx(base, rel=1e-12)


def test_rollout_assistant_denominator_counts_passing_turns():
    gen = torch.Generator().manual_seed(6)
    zs, ze = torch.randn(4, 7, generator=gen, dtype=torch.float64), torch.randn(4, 7, generator=gen, dtype=torch.float64)
    kl = ref_kl(zs, ze, "reverse")
    gated = _kl_term("rollout_gated", [4], [[1]], zs, ze)
    assistant = _kl_term("rollout_assistant", [4], [[1]], zs, ze)
    assert gated == pytest.approx(kl[1].item(), rel=1e-12)
    assert assistant == pytest.approx(kl[1].item() / 4, rel=1e-12)


def test_fused_batch_equals_logits_batch():
    gen = torch.Generator().manual_seed(8)
    n, h, v = 9, 4, 6
    hid = torch.randn(n, h, generator=gen, dtype=torch.float64)
    hid_e = torch.randn(n, h, generator=gen, dtype=torch.float64)
    w = torch.randn(v, h, generator=gen, dtype=torch.float64)
    cfg = ObjectiveConfig(mode="tg", kl_coef=0.7, kl_direction="forward", logits_chunk_size=2)
    ref = rollout_batch([5, 4], vocab=v, failed=[[0, 4], [1, 2, 3]], cfg=cfg, logits=hid @ w.t(),
                        expert_logits_full=hid_e @ w.t())
    out_ref = TGObjective(cfg)(ref)
    out_ref.loss.backward()
    hid_l, w_l = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    he = hid_e[ref.gate_index].clone().requires_grad_(True)
    fused = dataclasses.replace(ref, hidden=hid_l, output_weight=w_l, expert_hidden=he)
    out = TGObjective(cfg)(fused)
    out.loss.backward()
    torch.testing.assert_close(out.loss, out_ref.loss)
    torch.testing.assert_close(hid_l.grad, ref.hidden.grad @ w)
    torch.testing.assert_close(w_l.grad, ref.hidden.grad.t() @ hid)
    assert he.grad is None
    for k in ("kl/mean_gated", "entropy/all", "entropy/gated"):
        torch.testing.assert_close(out.metrics[k], out_ref.metrics[k])


def test_zero_coef_keeps_metrics_but_no_term():
    cfg = ObjectiveConfig(mode="tg", kl_coef=0.0)
    out = TGObjective(cfg)(rollout_batch([3], failed=[[0]], cfg=cfg))
    assert "kl" not in out.terms and out.metrics["kl/mean_gated"].item() > 0


def test_missing_expert_rows_is_a_named_error():
    cfg = ObjectiveConfig(mode="tg")
    batch = rollout_batch([3], failed=[[0, 1]], cfg=cfg)
    batch.expert_hidden = batch.expert_hidden[:1]
    with pytest.raises(ValueError, match="expert_hidden"):
        TGObjective(cfg)(batch)
    batch.hidden = None
    with pytest.raises(ValueError, match="hidden states"):
        TGObjective(cfg)(batch)


def test_sequence_first_row_selection():
    s, b, v = 4, 3, 5
    x = torch.arange(s * b * v, dtype=torch.float64).reshape(s, b, v)
    mask = torch.zeros(s, b, dtype=torch.bool)
    mask[1, 2] = mask[3, 0] = True
    rows = flat_positions(mask)
    assert rows.tolist() == [1 * b + 2, 3 * b + 0]
    torch.testing.assert_close(select_rows(x, rows), torch.stack([x[1, 2], x[3, 0]]))


def test_kl_diagnostics_are_step_means_over_gated_tokens():
    """``kl_diagnostics``: per-step means over the gated tokens of the rescue mass, both
    directions' logit-gradient norms and the KL, against plain torch (softmax + autograd),
    with the step split into two micro-batches aggregated the way the trainer does."""
    cfg = ObjectiveConfig(mode="tg", kl_coef=0.5, kl_direction="forward", kl_diagnostics=True,
                          logits_chunk_size=2)
    gen = torch.Generator().manual_seed(4)
    parts = [dict(lengths=[4, 6], failed=[[1, 2], [0, 5]]), dict(lengths=[3], failed=[[0, 1, 2]])]
    zs = [torch.randn(sum(p["lengths"]), 7, generator=gen, dtype=torch.float64) * 3 for p in parts]
    ze = [torch.randn(sum(p["lengths"]), 7, generator=gen, dtype=torch.float64) * 3 for p in parts]
    zs[0][1, 3] = -15.0  # a token the student cannot sample ...
    ze[0][1, 3] = 9.0    # ... that the expert wants: nonzero rescue mass
    batches = [rollout_batch(logits=z, expert_logits_full=e, cfg=cfg, **p) for p, z, e in zip(parts, zs, ze)]
    n_rollouts, n_gated = 3, sum(float(b.gate.sum()) for b in batches)
    sums: dict[str, float] = {}
    for b in batches:  # the trainer: Σ_mb value · rollouts_mb / rollouts_step
        b = dataclasses.replace(b, num_rollouts=n_rollouts, num_gated_tokens=n_gated)
        out = TGObjective(cfg)(b)
        for k, v in out.metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v) * b.advantages.shape[0] / n_rollouts
    s = torch.cat([z[b.gate_index] for z, b in zip(zs, batches)])
    e = torch.cat([z[b.gate_index] for z, b in zip(ze, batches)])
    assert s.shape[0] == n_gated == 7
    ps, pe = s.softmax(-1), e.softmax(-1)
    want = {"kl/rescue_mass": torch.where(ps < 1e-4, pe, 0.0).sum(-1).mean(),
            "kl/token_mean": ref_kl(s, e, "forward").mean()}
    for direction in ("reverse", "forward"):
        z = s.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(ref_kl(z, e, direction).sum(), z)
        want[f"kl/grad_norm_{direction}"] = g.norm(dim=-1).mean()
    assert want["kl/rescue_mass"] > 0.05
    for k, v in want.items():
        assert sums[k] == pytest.approx(float(v), rel=1e-9), k
    # the rescue row (row 1 of the first micro-batch): its own two norms
    out = TGObjective(cfg)(batches[0])
    row = zs[0][1:2].clone().requires_grad_(True)
    norms = {d: torch.autograd.grad(ref_kl(row, ze[0][1:2], d).sum(), row)[0].norm()
             for d in ("reverse", "forward")}
    mass = torch.where(row.softmax(-1) < 1e-4, ze[0][1:2].softmax(-1), 0.0).sum()
    assert mass >= 0.5 and float(out.metrics["kl/rescue_mass_max"]) == pytest.approx(float(mass))
    assert float(out.metrics["kl/rescue_grad_reverse_max"]) == pytest.approx(float(norms["reverse"]))
    assert float(out.metrics["kl/rescue_grad_forward_min"]) == pytest.approx(float(norms["forward"]))
    # off by default: none of it is computed
    plain = TGObjective(ObjectiveConfig(mode="tg", kl_coef=0.5))(batches[0])
    assert not any(k in plain.metrics for k in want)


def test_the_kl_s_split_between_thinking_and_action_rows():
    cfg = ObjectiveConfig(mode="tg", kl_coef=1.0)
    # rollout 0 fails on rows 0-3 (rows 0, 1 thinking); rollout 2 fails on 0, 3, 4 (row 0 thinking)
    batch = rollout_batch([4, 3, 5], failed=[[0, 1, 2, 3], [], [0, 3, 4]], cfg=cfg, seed=3,
                          thinking=[[0, 1], [], [0]])
    out = TGObjective(cfg)(batch)
    gi = batch.gate_index
    kl = ref_kl(batch.hidden.detach()[gi], batch.expert_hidden, "reverse")
    th = batch.thinking_mask[gi]
    m = out.metrics
    assert m["kl/frac_gated_thinking"].item() == pytest.approx(3 / 7)
    assert m["kl/mean_gated_thinking"].item() == pytest.approx(kl[th].mean().item(), rel=1e-12)
    assert m["kl/mean_gated_action"].item() == pytest.approx(kl[~th].mean().item(), rel=1e-12)
    # rollout_gated weights: 1/4 per row of rollout 0, 1/3 per row of rollout 2 (then / 3)
    assert m["kl/weight_frac_thinking"].item() == pytest.approx((2 / 4 + 1 / 3) / 2)
    # without the mask (a batch with no thinking), no split is reported
    plain = TGObjective(cfg)(rollout_batch([4, 3, 5], failed=[[0, 1, 2, 3], [], [0, 3, 4]], cfg=cfg, seed=3))
    assert not any(k.startswith("kl/") and "thinking" in k for k in plain.metrics)


def test_kl_action_weight_moves_weight_to_action_rows_within_each_rollout():
    kw = dict(lengths=[4, 3, 5], failed=[[0, 1, 2, 3], [], [0, 3, 4]], seed=3, thinking=[[0, 1], [], [0]])
    cfg1 = ObjectiveConfig(mode="tg", kl_coef=1.0)
    cfg4 = ObjectiveConfig(mode="tg", kl_coef=1.0, kl_action_weight=4.0)
    b1, b4 = rollout_batch(cfg=cfg1, **kw), rollout_batch(cfg=cfg4, **kw)
    o1, o4 = TGObjective(cfg1)(b1), TGObjective(cfg4)(b4)
    gi = b1.gate_index
    kl = ref_kl(b1.hidden.detach()[gi], b1.expert_hidden, "reverse")
    # rollout 0: 2 thinking + 2 action rows -> weights 1:4, summing to 1/3 (its share before);
    # rollout 2: 1 thinking + 2 action rows -> 1:4:4 over 1/3
    w0 = torch.tensor([1, 1, 4, 4], dtype=kl.dtype) / 10 / 3
    w2 = torch.tensor([1, 4, 4], dtype=kl.dtype) / 9 / 3
    want = (torch.cat([w0, w2]) * kl).sum()
    assert o4.terms["kl"].item() == pytest.approx(want.item(), rel=1e-12)
    assert o4.metrics["kl/weight_frac_thinking"].item() == pytest.approx((2 / 10 + 1 / 9) / 2)
    assert o1.terms["kl"].item() != pytest.approx(o4.terms["kl"].item())
    from megatron_tg.config.base import ConfigError

    with pytest.raises(ConfigError, match="kl_action_weight"):
        ObjectiveConfig(kl_action_weight=0.0).validate()
