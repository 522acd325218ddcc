"""The entropy-spike guard: lowers λ on a fast rise, restores slowly, logs events, is off by default."""

from __future__ import annotations

import math

import pytest

from megatron_tg.config.objective import EntropyGuardConfig, ObjectiveConfig
from megatron_tg.objectives import EntropyGuard, TGObjective
from tests.objectives.fixtures import rollout_batch


def _guard(**kw) -> EntropyGuard:
    cfg = EntropyGuardConfig(enabled=True, rise_threshold=0.1, smoothing=0.5, decay_factor=0.5,
                             recover_rate=0.5, min_coef=0.2, **kw)
    return EntropyGuard(cfg, base_coef=1.0)


def test_lowers_on_spike_then_restores_slowly():
    g = _guard()
    assert g.update(1.0) is None            # first observation sets the baseline
    assert g.update(1.05) is None           # rise 0.05 < 0.1: calm, λ already at base
    ev = g.update(1.6)                      # baseline 1.025 → rise 0.575: spike
    assert ev.action == "lowered" and ev.new_coef == pytest.approx(0.5) and g.coef == 0.5
    assert ev.rise == pytest.approx(1.6 - 1.025)
    ev = g.update(1.0)                      # baseline (1.025+1.6)/2 = 1.3125: no rise
    assert ev.action == "restored" and g.coef == pytest.approx(0.75)
    g.update(1.0)
    assert g.coef == pytest.approx(0.875)
    for _ in range(20):
        g.update(1.0)
    assert g.coef == 1.0                    # snapped back to the configured λ


def test_floor_and_no_data_steps():
    g = _guard()
    g.update(0.0)
    for h in (1.0, 2.0, 3.0, 4.0):
        g.update(h)
    assert g.coef == pytest.approx(0.2)     # min_coef
    before = g.state_dict()
    assert g.update(float("nan")) is None and g.update(None) is None
    assert g.coef == before["coef"] and g.baseline == before["baseline"]


def test_state_round_trip():
    g = _guard()
    for h in (1.0, 2.0):
        g.update(h)
    h = _guard()
    h.load_state_dict(g.state_dict())
    assert (h.coef, h.baseline, h.step) == (g.coef, g.baseline, g.step)


def test_disabled_by_default_and_objective_uses_guard_coef():
    obj = TGObjective(ObjectiveConfig(kl_coef=0.4))
    assert obj.end_step(10.0) is None and obj.end_step(100.0) is None and obj.kl_coef == 0.4
    cfg = ObjectiveConfig(kl_coef=0.4, entropy_guard=EntropyGuardConfig(enabled=True, rise_threshold=0.1))
    obj = TGObjective(cfg)
    obj.end_step(1.0)
    assert obj.end_step(5.0).action == "lowered"
    out = obj(rollout_batch([3], failed=[[0]], cfg=cfg))
    assert out.metrics["kl/coef"].item() == pytest.approx(0.2)
    assert math.isfinite(out.metrics["entropy/gated"].item())
