"""Each mode's switches, and their effect on the gate and on the loss's terms."""

from __future__ import annotations

import pytest
import torch

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives import TGObjective, build_gate, mode_switches
from tests.objectives.fixtures import rollout_batch

LOSS = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)     # last row: a tool output
FAILED = torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool)   # rows of turns failing a criterion
THINKING = torch.tensor([1, 0, 1, 0, 0], dtype=torch.bool)


@pytest.mark.parametrize("mode,distill_thinking,want", [
    ("tg", True, [1, 1, 0, 0, 0]),
    ("tg", False, [0, 1, 0, 0, 0]),
    ("no_thinking", True, [0, 1, 0, 0, 0]),
    ("always_on", True, [1, 1, 1, 1, 0]),
    ("always_on", False, [0, 1, 0, 1, 0]),
    ("opsd", True, [1, 1, 1, 1, 0]),
    ("grpo", True, [0, 0, 0, 0, 0]),
])
def test_gate_per_mode(mode, distill_thinking, want):
    cfg = ObjectiveConfig(mode=mode, distill_thinking=distill_thinking)
    assert build_gate(LOSS, FAILED, THINKING, cfg).tolist() == want


def test_switch_table():
    got = {m: mode_switches(ObjectiveConfig(mode=m)) for m in ("tg", "grpo", "opsd", "always_on", "no_thinking")}
    assert [m for m, s in got.items() if s.kl] == ["tg", "opsd", "always_on", "no_thinking"]
    assert [m for m, s in got.items() if s.failing_turns_only] == ["tg", "no_thinking"]
    assert [m for m, s in got.items() if s.primary_rewards_only] == ["opsd"]
    assert [m for m, s in got.items() if not s.kl_on_thinking] == ["no_thinking"]


def test_always_on_distills_passing_rollouts_and_tg_does_not():
    for mode, has_kl in (("always_on", True), ("opsd", True), ("tg", False), ("no_thinking", False)):
        cfg = ObjectiveConfig(mode=mode, kl_coef=1.0)
        out = TGObjective(cfg)(rollout_batch([3, 2], failed=[], cfg=cfg))
        assert ("kl" in out.terms) is has_kl, mode


def test_grpo_ignores_gates_handed_to_it():
    tg_cfg = ObjectiveConfig(mode="tg", kl_coef=1.0)
    batch = rollout_batch([3, 2], failed=[[0, 1]], cfg=tg_cfg)
    out = TGObjective(ObjectiveConfig(mode="grpo"))(batch)
    assert set(out.terms) == {"pg"} and out.metrics["kl/coef"].item() == 0.0


def test_no_thinking_removes_thinking_rows_from_the_kl():
    kw = dict(lengths=[4], failed=[[0, 1, 2, 3]], thinking=[[0, 1]], seed=4)
    tg_cfg, nt_cfg = ObjectiveConfig(mode="tg", kl_coef=1.0), ObjectiveConfig(mode="no_thinking", kl_coef=1.0)
    tg_b, nt_b = rollout_batch(cfg=tg_cfg, **kw), rollout_batch(cfg=nt_cfg, **kw)
    assert tg_b.gate_index.tolist() == [0, 1, 2, 3] and nt_b.gate_index.tolist() == [2, 3]
    TGObjective(nt_cfg)(nt_b).terms["kl"].backward()
    assert (nt_b.hidden.grad[:2] == 0).all() and (nt_b.hidden.grad[2:] != 0).any()


def test_names_written_in_two_layers_agree():
    """The config keeps its own copies of these names so that importing it needs no torch;
    they must be the ones the code below it accepts."""
    from megatron_tg.config.objective import KL_DIRECTIONS, MODES, ObjectiveConfig
    from megatron_tg.objectives.modes import mode_switches
    from megatron_tg.ops.vocab_parallel import KL_DIRECTIONS as OPS_DIRECTIONS

    assert KL_DIRECTIONS == OPS_DIRECTIONS
    for mode in MODES:  # every configurable mode has switches
        mode_switches(ObjectiveConfig(mode=mode))


def test_objective_errors_are_config_errors():
    import pytest

    from megatron_tg.config import ConfigError
    from megatron_tg.config.objective import ObjectiveConfig

    with pytest.raises(ConfigError, match="objective.kl_coef must be >= 0"):
        ObjectiveConfig(kl_coef=-1.0).validate()


@pytest.mark.parametrize("mode,want", [("tg", [1, 0, 0, 0, 0]), ("always_on", [1, 0, 1, 0, 0])])
def test_thinking_only_kl_gates_the_thinking_rows_of_the_mode_s_turns(mode, want):
    cfg = ObjectiveConfig(mode=mode, distill_actions=False)
    assert build_gate(LOSS, FAILED, THINKING, cfg).tolist() == want
    assert build_gate(LOSS, FAILED, None, cfg).tolist() == [0, 0, 0, 0, 0]  # no thinking, no row


def test_thinking_only_kl_without_thinking_distilled_is_refused():
    from megatron_tg.config.base import ConfigError

    for kw in (dict(mode="no_thinking"), dict(mode="tg", distill_thinking=False)):
        with pytest.raises(ConfigError, match="distill_actions=false"):
            ObjectiveConfig(distill_actions=False, **kw).validate()
    ObjectiveConfig(mode="tg", distill_actions=False).validate()
