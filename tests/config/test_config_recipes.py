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


FIXTURES = ROOT / "tests" / "fixtures" / "hf_configs"
# The paper-scale recipes name model directories that exist only on a cluster; their public
# config.json files are fixtures here, so the model-shape checks of the layout run on them.
PUBLISHED = {"Qwen3-Coder-30B-A3B-Instruct": "qwen3-coder-30b-a3b-instruct.json",
             "Qwen3-235B-A22B-Instruct-2507": "qwen3-235b-a22b.json",
             "Qwen3-Coder-480B-A35B-Instruct": "qwen3-coder-480b-a35b-instruct.json"}


def _with_local_hf_config(path: Path):
    """The recipe, with its cluster-only hf_config replaced by the published config.json."""
    cfg = load_config(path)
    name = Path(cfg.model.hf_config).name if cfg.model.hf_config else None
    if name in PUBLISHED:
        cfg = load_config(path, [f"model.hf_config={FIXTURES / PUBLISHED[name]}"])
    return cfg


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_validates_and_its_layout_fits(path):
    cfg = _with_local_hf_config(path)  # validates
    dims = cfg.layout(cfg.parallel.default_world_size())
    if cfg.parallel.nodes is not None:
        assert dims.world_size == cfg.parallel.nodes * cfg.parallel.gpus_per_node


def test_every_recipe_layout_is_checked_against_a_model_shape():
    """No cluster recipe's model-shape check is skipped for want of its config.json. The two
    CPU recipes name models their jobs build at run time (megatron_tg.models.tiny, the demo's
    base model); their layouts meet the real model in the loop and demo tests."""
    unchecked = {p.name for p in ALL if _with_local_hf_config(p).model.read_hf_config() is None}
    assert unchecked == {"tiny_cpu.yaml", "demo_cpu.yaml", "demo_paper_cpu.yaml"}


def test_a_layout_the_published_model_cannot_take_is_refused():
    from megatron_tg.config import ConfigError

    cfg = load_config(RECIPES / "tg_235b.yaml", [
        f"model.hf_config={FIXTURES / PUBLISHED['Qwen3-235B-A22B-Instruct-2507']}",
        "parallel.pp=4"])  # 94 layers do not split into 4 stages
    with pytest.raises(ConfigError, match="num_layers=94 not divisible by pp=4"):
        cfg.layout(cfg.parallel.default_world_size())


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_rubric_exists_and_parses(path):
    cfg = load_config(path)
    from megatron_tg.judge.rubric import load_rubric

    if cfg.judge.rubric is None:  # only the demo's recipes: their task modules supply the rubric
        from megatron_tg.demo import paper_env, task

        env = {"demo_cpu.yaml": task, "demo_paper_cpu.yaml": paper_env}.get(path.name)
        assert env is not None, f"{path}: judge.rubric is not set"
        style = {"search_lines"} | (set(paper_env.STYLE_CRITERIA) if env is paper_env else set())
        assert {c.name for c in env.rubric().criteria} == set(cfg.objective.primary_criteria) | style
        assert env.rubric().primary_names() == cfg.objective.primary_criteria
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
    ("hinted", "hinted_samples", 1), ("placebo", "expert_feedback", "placebo"),
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
