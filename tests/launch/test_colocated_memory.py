"""The colocated memory plan (megatron_tg/launch/colocated_memory.py): one GPU, two phases,
each checked; layouts that cannot colocate refused at plan time with the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_tg.config import load_config
from megatron_tg.launch import memory as M
from megatron_tg.launch.colocated_memory import (ENGINE_RELEASED_GIB, colocated_mem_fraction,
                                                 layout_refusal, trainer_left_gib)
from megatron_tg.launch.engine_memory import sglang_default_mem_fraction
from megatron_tg.launch.memory_terms import GIB, H100_MEMORY_GIB
from megatron_tg.launch.plan import engine_flags

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "fixtures" / "hf_configs" / "qwen3-coder-30b-a3b-instruct.json"
COLOCATED = ["rollout.placement=colocated", "rollout.engine_tp=1", "rollout.max_staleness=0"]


def _cfg(*overrides):
    return load_config(str(ROOT / "recipes" / "tg_30b.yaml"), [f"model.hf_config={HF}", *COLOCATED, *overrides])


def test_both_phases_are_planned_from_the_disaggregated_terms():
    """The train phase is the trainer's plan plus a released engine; the generate phase is the
    engine's plan at the colocated fraction plus what the trainer keeps, and it adds up to the
    GPU (SGLang's pool is a fraction of the whole GPU)."""
    cfg = _cfg("rollout.num_engines=16", "rollout.max_context_tokens=32768")
    plan = M.memory_plan(cfg, world_size=16)
    alone = M.memory_plan(load_config(str(ROOT / "recipes" / "tg_30b.yaml"), [f"model.hf_config={HF}"]),
                          world_size=16)
    train, gen = plan.roles["train"], plan.roles["engine"]
    assert train.terms == {**alone.roles["train"].terms, "engine_released": ENGINE_RELEASED_GIB * GIB}
    assert gen.terms["trainer_offloaded"] == trainer_left_gib() * GIB
    assert gen.kv["mem_fraction_static"] == colocated_mem_fraction(cfg.rollout)
    assert gen.total <= H100_MEMORY_GIB * GIB + 1 and gen.total > 0.99 * H100_MEMORY_GIB * GIB
    assert gen.terms["weights"] == pytest.approx(2 * alone.total_params)  # bf16 at engine TP 1
    assert train.host["colocated_offload"] == train.terms["weights"] + train.terms["optimizer"]
    assert plan.refusal() is None, plan.refusal()


def test_one_node_is_refused_naming_the_optimizer_and_two_nodes_train():
    """The issue's figures: on one 8-GPU node expert-DP is 1 and the optimizer shards double
    (42.7 GiB): the train phase does not fit; on two nodes it does (21.3 GiB)."""
    one = M.memory_plan(_cfg("parallel.nodes=1", "rollout.num_engines=8", "rollout.max_context_tokens=32768"),
                        world_size=8)
    refusal = one.refusal()
    assert refusal.startswith("memory: the colocated GPU, train phase GPU needs") and "optimizer" in refusal
    assert one.roles["train"].terms["optimizer"] / GIB == pytest.approx(42.7, abs=0.1)
    two = M.memory_plan(_cfg("rollout.num_engines=16", "rollout.max_context_tokens=32768"), world_size=16)
    assert two.roles["train"].fits() and two.roles["train"].terms["optimizer"] / GIB == pytest.approx(21.3, abs=0.1)


def test_a_30b_engine_at_tp1_holds_no_64k_rollout_and_the_fix_names_the_context():
    """At engine TP 1 the 30B model's bf16 weights leave a KV cache smaller than one 64k
    rollout: refused, naming what can change."""
    plan = M.memory_plan(_cfg("rollout.num_engines=16"), world_size=16)
    assert plan.roles["engine"].kv["kv_tokens"] < 65536
    assert "rollout.max_context_tokens" in plan.refusal() and "rollout.engine_tp" in plan.refusal()


def test_layouts_that_cannot_colocate_are_refused_with_the_numbers():
    cfg = _cfg()  # the recipe's 8 engines on a 16-GPU trainer
    assert layout_refusal(cfg, 16) == (
        "rollout.placement='colocated': rollout.num_engines x rollout.engine_tp = 8 x 1 = 8 GPUs, but the "
        "trainer has 16: set rollout.num_engines=16 (one engine TP rank on each trainer GPU)")
    assert M.memory_plan(cfg, world_size=16).refusal() == layout_refusal(cfg, 16)
    odd = _cfg()
    odd.rollout.engine_tp = 3  # past the config's own engine_tp=1 check, as a later mapping may allow
    assert "rollout.engine_tp=3 does not divide parallel.gpus_per_node=8" in layout_refusal(odd, 16)


def test_colocated_engines_get_the_memory_saver_and_their_fraction():
    cfg = _cfg("rollout.num_engines=16")
    frac = colocated_mem_fraction(cfg.rollout)
    assert frac < sglang_default_mem_fraction(H100_MEMORY_GIB * 1024, 1)
    assert engine_flags(cfg.rollout)[-3:] == ["--enable-memory-saver", "--mem-fraction-static", str(frac)]
    assert engine_flags(cfg.rollout, "embedded")[-1] == "--enable-memory-saver"
    plain = load_config(str(ROOT / "recipes" / "tg_30b.yaml"), [f"model.hf_config={HF}"])
    assert "--enable-memory-saver" not in engine_flags(plain.rollout)


def test_the_step_time_is_the_phases_in_turn_beside_the_overlap():
    """Colocated, generate, offload/onload and train take turns: the step is their sum (the
    checkpoint's USR1 lead time follows it); the disaggregated overlap is printed beside it."""
    from megatron_tg.launch import timeplan

    cfg = _cfg("rollout.num_engines=16", "rollout.max_context_tokens=32768")
    plan = M.memory_plan(cfg, world_size=16)
    t = timeplan.time_plan(cfg, plan)
    c = t["colocated"]
    moved = plan.roles["train"].host["colocated_offload"]
    assert c["offload_onload_s"] == round(2 * moved / (timeplan.ASSUMED_PCIE_GBPS * 1e9), 1)
    assert c["step_s"] == pytest.approx(t["generate_s"] + t["train_s"] + c["offload_onload_s"], abs=0.2)
    assert c["disaggregated_step_s"] == max(t["train_s"], t["generate_s"])
    assert timeplan.step_seconds(t) == c["step_s"]
    assert any(line.startswith("  colocated step: generate") for line in timeplan.render(t))
    plain = load_config(str(ROOT / "recipes" / "tg_30b.yaml"), [f"model.hf_config={HF}"])
    tp = timeplan.time_plan(plain, M.memory_plan(plain, world_size=16))
    assert tp["colocated"] is None and timeplan.step_seconds(tp) == max(tp["train_s"], tp["generate_s"])


def test_the_shipped_colocated_recipe_fits_both_phases_on_two_nodes():
    """recipes/tg_30b_colocated.yaml: 8 engines x TP 2 on the trainer's 16 GPUs; both phases
    fit, the engine holds more than one 64k rollout, and the plan has no rollout nodes."""
    from megatron_tg.launch.plan import Knobs, make_plan

    recipe = str(ROOT / "recipes" / "tg_30b_colocated.yaml")
    cfg = load_config(recipe, [f"model.hf_config={HF}"])
    plan = M.memory_plan(cfg, world_size=16)
    assert plan.refusal() is None, plan.refusal()
    assert plan.roles["engine"].kv["rollouts_at_full_context"] >= 1
    assert plan.roles["engine"].terms["weights"] == pytest.approx(plan.total_params)  # bf16 over 2 GPUs
    launch = make_plan(recipe, [f"model.hf_config={HF}"], Knobs(judge_model="models/judge"))
    assert launch.colocated and launch.roles["rollout"] == [] and len(launch.roles["train"]) == 2
    assert launch.checkpoint["usr1_lead_s"] == 11070  # = slurm/tg_30b_colocated.sh's --signal
    assert "#SBATCH --signal=B:USR1@11070" in (ROOT / "slurm" / "tg_30b_colocated.sh").read_text()
