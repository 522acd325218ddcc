"""GRPO term and advantages against closed forms computed by hand on tiny inputs."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives import (PolicyBatch, TGObjective, combine_rewards, group_advantages,
                                    policy_gradient_term)
from tests.objectives.fixtures import logits_as_hidden


def _two_token_vocab_batch(behaviour, advantages, rollout_index, old=None):
    """V=2 with equal logits: log π(target) = log 0.5 on every row, so ratios are chosen
    exactly through the behaviour/old log-probs."""
    n = len(behaviour)
    return PolicyBatch(
        target_ids=torch.zeros(n, dtype=torch.long),
        behaviour_logprobs=torch.tensor(behaviour, dtype=torch.float64),
        loss_mask=torch.ones(n, dtype=torch.bool),
        rollout_index=torch.tensor(rollout_index),
        advantages=torch.tensor(advantages, dtype=torch.float64),
        gate=torch.zeros(n),
        **logits_as_hidden(torch.zeros(n, 2, dtype=torch.float64, requires_grad=True)),
        old_logprobs=None if old is None else torch.tensor(old, dtype=torch.float64),
    )


def test_ppo_clip_closed_form_value_gradient_and_clip_fraction():
    # old_logprobs="behaviour": the ratio is taken against the engine's log-probs.
    cfg = ObjectiveConfig(mode="grpo", clip_eps_low=0.2, clip_eps_high=0.28,
                          old_logprobs="behaviour")
    # ratios 2, 0.5, 1 in each rollout; rollout 0 has A=+1, rollout 1 has A=-1.
    b = [math.log(0.25), 0.0, math.log(0.5)] * 2
    batch = _two_token_vocab_batch(b, [1.0, -1.0], [0, 0, 0, 1, 1, 1])
    out = TGObjective(cfg, compute_entropy=False)(batch)
    # A=+1: -min(2, 1.28) = -1.28, -min(.5, .8) = -.5, -1.   A=-1: 2, .8, 1.
    want = ((-1.28 - 0.5 - 1.0) / 3 + (2.0 + 0.8 + 1.0) / 3) / 2
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    out.loss.backward()
    # dℓ/dlogπ = -A·r on the unclipped branch, 0 where the clip is active; then /3 tokens, /2 rollouts.
    dlogp = torch.tensor([0.0, -0.5, -1.0, 2.0, 0.0, 1.0], dtype=torch.float64) / 6
    # dlogπ(0)/dz = onehot(0) - softmax = [0.5, -0.5].
    want_grad = torch.stack([0.5 * dlogp, -0.5 * dlogp], dim=1)
    torch.testing.assert_close(batch.hidden.grad, want_grad)
    assert out.metrics["pg/clip_frac"].item() == pytest.approx(2 / 6)
    assert out.metrics["pg/is_weight_mean"].item() == 1.0  # no π_old: no TIS


def test_truncated_importance_sampling_closed_form():
    cfg = ObjectiveConfig(mode="grpo", tis_cap=2.0, pg_token_normalization="global")
    old = [math.log(0.5)] * 3  # ratio 1 against the trainer's old log-probs
    behaviour = [math.log(0.1), math.log(0.4), math.log(0.5)]  # raw weights 5, 1.25, 1
    batch = _two_token_vocab_batch(behaviour, [2.0], [0, 0, 0], old=old)
    out = TGObjective(cfg, compute_entropy=False)(batch)
    weights = [2.0, 1.25, 1.0]  # 5 truncated to the cap C=2
    assert out.loss.item() == pytest.approx(sum(-2.0 * w for w in weights) / 3, abs=1e-12)
    m = out.metrics
    assert m["pg/is_weight_mean"].item() == pytest.approx(sum(weights) / 3)
    assert m["pg/is_weight_max"].item() == pytest.approx(5.0)
    assert m["pg/is_frac_truncated"].item() == pytest.approx(1 / 3)
    out.loss.backward()
    torch.testing.assert_close(batch.hidden.grad[:, 0],
                               torch.tensor([-2.0 * w / 3 * 0.5 for w in weights], dtype=torch.float64))
    # tis_cap <= 0 disables the correction entirely.
    off = TGObjective(ObjectiveConfig(mode="grpo", tis_cap=0.0, pg_token_normalization="global"),
                      compute_entropy=False)(_two_token_vocab_batch(behaviour, [2.0], [0, 0, 0], old=old))
    assert off.loss.item() == pytest.approx(-2.0, abs=1e-12)


def _student_old_batch(deltas, advantages, rollout_index, vocab=5, seed=0):
    """Random logits; behaviour log-probs = the trainer's own minus ``deltas`` (known gap)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(deltas)
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2
    target = torch.randint(0, vocab, (n,), generator=gen)
    logp = logits.log_softmax(-1).gather(1, target[:, None]).squeeze(1)
    return PolicyBatch(
        target_ids=target, behaviour_logprobs=logp - torch.tensor(deltas, dtype=torch.float64),
        loss_mask=torch.ones(n, dtype=torch.bool), rollout_index=torch.tensor(rollout_index),
        advantages=torch.tensor(advantages, dtype=torch.float64), gate=torch.zeros(n),
        **logits_as_hidden(logits.requires_grad_(True)))


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_default_old_logprobs_are_the_students_detached_and_tis_is_on(mode):
    """Defaults, no old_logprobs given: π_old = the student's log-probs detached, so r = 1 and
    the loss is −(1/R) Σ_i (1/|o_i|) Σ_t w_t·A_i with w = min(e^δ, C) (or e^δ inside
    [1/C, C], else 0), where δ = log π_old − log π_behaviour is set by construction; the
    logit gradient is −w_t·A_i/(R·|o_i|)·(onehot(y_t) − softmax(z_t))."""
    cfg = ObjectiveConfig(mode="grpo", tis_mode=mode)  # tis_cap 2.0, old_logprobs "student"
    deltas = [math.log(5.0), 0.2, -0.1, -math.log(3.0), 0.0]
    rollout_index, adv = [0, 0, 0, 1, 1], [1.5, -0.5]
    batch = _student_old_batch(deltas, adv, rollout_index)
    out = TGObjective(cfg, compute_entropy=False)(batch)
    raw = [math.exp(d) for d in deltas]
    if mode == "truncate":
        w = [min(x, 2.0) for x in raw]
    else:
        w = [x if 0.5 <= x <= 2.0 else 0.0 for x in raw]
    lengths = [3, 2]
    want = sum(-w[t] * adv[r] / lengths[r] for t, r in enumerate(rollout_index)) / 2
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    out.loss.backward()
    probs = batch.hidden.detach().softmax(-1)
    onehot = torch.nn.functional.one_hot(batch.target_ids, probs.shape[1]).double()
    coef = torch.tensor([-w[t] * adv[r] / (2 * lengths[r]) for t, r in enumerate(rollout_index)],
                        dtype=torch.float64)
    torch.testing.assert_close(batch.hidden.grad, coef[:, None] * (onehot - probs))
    m = out.metrics
    assert m["pg/ratio_mean"].item() == 1.0 and m["pg/clip_frac"].item() == 0.0
    assert m["pg/is_weight_mean"].item() == pytest.approx(sum(w) / 5)
    assert m["pg/is_weight_max"].item() == pytest.approx(5.0)
    assert m["pg/is_weight_min"].item() == pytest.approx(1 / 3)
    assert m["pg/is_frac_truncated"].item() == pytest.approx((1 if mode == "truncate" else 2) / 5)
    assert m["pg/engine_logprob_gap"].item() == pytest.approx(sum(map(abs, deltas)) / 5)


def test_tis_metric_follows_the_engine_gap():
    """The IS-weight metric is the weight distribution, not a constant: zero gap gives weight
    1 (up to the op's rounding of the log-prob), and a larger gap a larger spread."""
    objective = TGObjective(ObjectiveConfig(mode="grpo"), compute_entropy=False)
    stds = []
    for scale in (0.0, 0.1, 0.4):
        deltas = (scale * torch.randn(50, generator=torch.Generator().manual_seed(1))).tolist()
        m = objective(_student_old_batch(deltas, [1.0], [0] * 50)).metrics
        stds.append(m["pg/is_weight_std"].item())
        if scale == 0.0:
            assert m["pg/is_weight_mean"].item() == pytest.approx(1.0, abs=1e-12)
            assert m["pg/is_weight_max"].item() == pytest.approx(1.0, abs=1e-12)
    assert stds[0] < 1e-12 and 0.05 < stds[1] < stds[2]


def test_masked_tis_needs_a_band():
    with pytest.raises(ValueError, match="objective.tis_cap"):
        ObjectiveConfig(tis_mode="mask", tis_cap=1.0).validate()
    with pytest.raises(ValueError, match="objective.old_logprobs"):
        ObjectiveConfig(old_logprobs="engine").validate()


def test_prompt_and_tool_rows_never_count():
    cfg = ObjectiveConfig(mode="grpo")
    batch = _two_token_vocab_batch([math.log(0.5)] * 4, [1.0], [0, 0, 0, 0])
    batch.loss_mask[1] = False
    loss = TGObjective(cfg, compute_entropy=False)(batch).loss
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)  # mean over the 3 assistant rows, not 4
    assert (batch.hidden.grad[1] == 0).all() and (batch.hidden.grad[0] != 0).all()


def test_global_vs_rollout_token_normalisation():
    # Rollout 0: 1 token with A=+1; rollout 1: 3 tokens with A=-1; ratio 1 everywhere.
    b = [math.log(0.5)] * 4
    per_rollout = TGObjective(ObjectiveConfig(mode="grpo"), compute_entropy=False)(
        _two_token_vocab_batch(b, [1.0, -1.0], [0, 1, 1, 1])).loss
    token_level = TGObjective(ObjectiveConfig(mode="grpo", pg_token_normalization="global"),
                              compute_entropy=False)(_two_token_vocab_batch(b, [1.0, -1.0], [0, 1, 1, 1])).loss
    assert per_rollout.item() == pytest.approx((-1.0 + 1.0) / 2)
    assert token_level.item() == pytest.approx((-1.0 + 3.0) / 4)


def test_group_advantages_closed_form():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0])
    groups = torch.tensor([7, 7, 9, 9, 4])  # arbitrary ids; group 4 has a single rollout
    cfg = ObjectiveConfig(adv_eps=1e-6)
    a = group_advantages(rewards, groups, cfg)
    s = 0.5 / (0.5 + 1e-6)  # centred ±0.5 over the population std of {1, 0}, 0.5
    torch.testing.assert_close(a, torch.tensor([s, -s, 0.0, 0.0, 0.0]))
    b = group_advantages(rewards, groups, ObjectiveConfig(advantage_std_norm=False))
    torch.testing.assert_close(b, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]))


def test_rewards_weights_and_opsd_drops_non_primary():
    scores = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    names = ["tests_pass", "markdown", "bolded"]
    tg = ObjectiveConfig(criterion_weights={"markdown": 0.5})
    torch.testing.assert_close(combine_rewards(scores, names, tg),
                               torch.tensor([2.0, 1.5], dtype=torch.float64))
    opsd = ObjectiveConfig(mode="opsd", criterion_weights={"markdown": 0.5},
                           primary_criteria=["tests_pass"])
    torch.testing.assert_close(combine_rewards(scores, names, opsd),
                               torch.tensor([1.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="none are set"):  # unresolved: every reward would be 0
        combine_rewards(scores, names, ObjectiveConfig(mode="opsd"))
    with pytest.raises(ValueError, match="rollouts"):
        combine_rewards(scores, names[:2], tg)


def test_policy_gradient_term_directly_matches_formula():
    gen = torch.Generator().manual_seed(3)
    n = 9
    logp = torch.log(torch.rand(n, generator=gen, dtype=torch.float64))
    beh = logp + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    idx = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    adv = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)
    batch = PolicyBatch(target_ids=torch.zeros(n, dtype=torch.long), behaviour_logprobs=beh,
                        loss_mask=torch.ones(n, dtype=torch.bool), rollout_index=idx,
                        advantages=adv, gate=torch.zeros(n), **logits_as_hidden(torch.zeros(n, 1)),
                        old_logprobs=old)
    cfg = ObjectiveConfig(clip_eps_low=0.1, clip_eps_high=0.3, tis_cap=1.5)
    loss, _ = policy_gradient_term(logp, batch, cfg)
    want = 0.0
    for r in range(3):
        rows = (idx == r).nonzero().flatten().tolist()
        acc = 0.0
        for t in rows:
            ratio = math.exp(logp[t] - old[t])
            a = adv[r].item()
            surr = -min(ratio * a, min(max(ratio, 0.9), 1.3) * a)
            acc += surr * min(math.exp(old[t] - beh[t]), 1.5)
        want += acc / len(rows)
    assert loss.item() == pytest.approx(want / 3, abs=1e-12)


def test_primary_gated_style_reward_cannot_be_bought_with_the_task():
    """style_reward=primary_gated: style terms count only where every primary criterion
    passes; the plain sum lets a task-failing, styled rollout tie with a correct one."""
    names = ["answer", "search_lines", "answer_style", "brief"]
    weights = {"search_lines": 0.5, "answer_style": 0.5, "brief": 0.5}
    scores = torch.tensor([[1.0, 0.0, 0.0, 0.0],    # the task, no style
                           [0.0, 1.0, 1.0, 0.0],    # the hack: no search, "Answer: <guess>"
                           [1.0, 1.0, 1.0, 1.0],    # everything
                           [0.0, 1.0, 1.0, 1.0]])   # all style, wrong answer
    plain = combine_rewards(scores, names, ObjectiveConfig(criterion_weights=weights))
    torch.testing.assert_close(plain, torch.tensor([1.0, 1.0, 2.5, 1.5], dtype=torch.float64))
    gated = combine_rewards(scores, names, ObjectiveConfig(criterion_weights=weights, primary_criteria=["answer"],
                                                           style_reward="primary_gated"))
    torch.testing.assert_close(gated, torch.tensor([1.0, 0.0, 2.5, 0.0], dtype=torch.float64))
    two = ObjectiveConfig(primary_criteria=["answer", "brief"], style_reward="primary_gated")
    torch.testing.assert_close(combine_rewards(scores, names, two),
                               torch.tensor([1.0, 0.0, 4.0, 1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="needs primary criteria"):
        combine_rewards(scores, names, ObjectiveConfig(style_reward="primary_gated"))
    with pytest.raises(ValueError, match="not among the scored"):
        combine_rewards(scores, names, ObjectiveConfig(style_reward="primary_gated", primary_criteria=["x"]))
