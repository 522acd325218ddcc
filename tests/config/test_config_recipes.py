"""Every recipe in recipes/ loads, validates and lays out; the shipped ones say what they claim."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_tg.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
# recipes/rubrics/ holds judge rubrics that recipes point to, not run recipes.
ALL = sorted(p for p in RECIPES.rglob("*.yaml") if p.relative_to(RECIPES).parts[0] != "rubrics")


def test_recipes_are_found():
    assert {"tiny_cpu.yaml", "tg_30b.yaml", "tg_235b.yaml", "tg_480b.yaml"} <= {p.name for p in ALL}


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_validates_and_its_layout_fits(path):
    cfg = load_config(path)  # validates
    dims = cfg.layout(cfg.parallel.default_world_size())
    if cfg.parallel.nodes is not None:
        assert dims.world_size == cfg.parallel.nodes * cfg.parallel.gpus_per_node


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_rubric_exists_and_parses(path):
    cfg = load_config(path)
    from megatron_tg.judge.rubric import load_rubric

    if cfg.judge.rubric is None:  # only the demo's recipe: its task module supplies the rubric
        from megatron_tg.demo import task

        assert path.name == "demo_cpu.yaml", f"{path}: judge.rubric is not set"
        assert {c.name for c in task.rubric().criteria} == set(cfg.objective.primary_criteria) | {"search_lines"}
        return
    assert load_rubric(ROOT / cfg.judge.rubric).criteria  # paths are relative to the repo root


def test_run_names_are_unique_so_runs_do_not_share_a_directory():
    names = [load_config(p).run_name for p in ALL]
    assert len(names) == len(set(names)), names


def test_tiny_cpu_is_the_cpu_default():
    cfg = load_config(RECIPES / "tiny_cpu.yaml")
    assert (cfg.parallel.backend, cfg.rollout.engine, cfg.model.transformer_impl) == ("gloo", "embedded", "local")


def test_tg_30b_has_the_paper_setting():
    cfg = load_config(RECIPES / "tg_30b.yaml")
    assert (cfg.steps, cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (200, 32, 32)
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (3e-6, 0.0)
    assert (cfg.objective.mode, cfg.objective.distill_thinking) == ("tg", True)
    assert cfg.rollout.engine == "sglang" and cfg.model.params_dtype == "bfloat16"


@pytest.mark.parametrize("name, field, value", [
    ("grpo", "mode", "grpo"), ("opsd", "mode", "opsd"), ("always_on", "mode", "always_on"),
    ("no_thinking", "mode", "no_thinking"), ("kl_forward", "kl_direction", "forward"),
])
def test_ablation_changes_one_objective_field_of_tg_30b(name, field, value):
    base = load_config(RECIPES / "tg_30b.yaml")
    cfg = load_config(RECIPES / "ablations" / f"{name}.yaml")
    assert getattr(cfg.objective, field) == value
    assert _without_names(cfg, objective={field: getattr(base.objective, field)}) == _without_names(base)


@pytest.mark.parametrize("path", sorted((RECIPES / "ablations" / "lambda_sweep").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_lambda_sweep_point_sets_kl_coef_from_its_name(path):
    base = load_config(RECIPES / "tg_30b.yaml")
    cfg = load_config(path)
    assert cfg.objective.kl_coef == float(re.fullmatch(r"lambda_(.+)\.yaml", path.name).group(1))
    assert _without_names(cfg, objective={"kl_coef": base.objective.kl_coef}) == _without_names(base)


def _without_names(cfg, objective=None):
    """cfg with run name (and what follows from it) blanked and ``objective`` fields replaced."""
    return dataclasses.replace(
        cfg, run_name="", logging=dataclasses.replace(cfg.logging, run_dir=""),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=""),
        objective=dataclasses.replace(cfg.objective, **(objective or {})))
