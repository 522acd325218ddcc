"""load_config: defaults <- recipe (with includes) <- overrides, and the errors on bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_tg.config import ConfigError, TGConfig, load_config, save_resolved
from megatron_tg.config.loader import RESOLVED_NAME

MODEL = "model.hf_config=some/model"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_equal_the_schema_and_resolve_interpolations():
    cfg = load_config(None, [MODEL])
    expected = TGConfig()
    assert cfg.parallel == expected.parallel and cfg.objective == expected.objective
    assert cfg.logging.run_dir == "runs/tg"
    assert cfg.checkpoint.dir == "runs/tg/checkpoints"


def test_missing_model_is_an_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.hf_config: required"):
        load_config(None, [])


def test_recipe_overrides_defaults_and_keeps_the_rest(tmp_path):
    recipe = write(tmp_path / "r.yaml", "model: {hf_config: m}\nparallel: {tp: 2, sequence_parallel: true}\n"
                                        "optimizer: {lr: 3e-6}\nrun_name: mine\n")
    cfg = load_config(recipe)
    assert cfg.parallel.tp == 2 and cfg.parallel.sequence_parallel
    assert cfg.optimizer.lr == 3e-6 and isinstance(cfg.optimizer.lr, float)  # YAML 1.1 would say str
    assert cfg.parallel.pp == TGConfig().parallel.pp
    assert cfg.checkpoint.dir == "runs/mine/checkpoints"  # interpolation sees the recipe's run_name


def test_include_chain_applies_in_order_relative_to_each_file(tmp_path):
    write(tmp_path / "base.yaml", "model: {hf_config: base_model}\nsteps: 1\nseed: 1\nrun_name: base\n")
    write(tmp_path / "mid" / "mid.yaml", "defaults: [../base.yaml]\nsteps: 2\nrun_name: mid\n")
    top = write(tmp_path / "top" / "deeper" / "top.yaml", "defaults: [../../mid/mid.yaml]\nrun_name: top\n")
    cfg = load_config(top)
    assert (cfg.model.hf_config, cfg.seed, cfg.steps, cfg.run_name) == ("base_model", 1, 2, "top")


def test_later_includes_win_and_the_recipe_wins_over_all(tmp_path):
    write(tmp_path / "a.yaml", "model: {hf_config: m}\nsteps: 1\nseed: 1\nrun_name: a\n")
    write(tmp_path / "b.yaml", "steps: 2\nseed: 2\n")
    top = write(tmp_path / "top.yaml", "defaults: [a.yaml, b.yaml]\nseed: 3\n")
    cfg = load_config(top)
    assert (cfg.run_name, cfg.steps, cfg.seed) == ("a", 2, 3)


def test_a_shared_include_is_merged_once_at_first_use(tmp_path):
    # top -> [left, right], both -> base. Re-merging base for `right` would undo left's steps.
    write(tmp_path / "base.yaml", "model: {hf_config: m}\nsteps: 1\n")
    write(tmp_path / "left.yaml", "defaults: [base.yaml]\nsteps: 5\n")
    write(tmp_path / "right.yaml", "defaults: [base.yaml]\nseed: 7\n")
    cfg = load_config(write(tmp_path / "top.yaml", "defaults: [left.yaml, right.yaml]\n"))
    assert (cfg.steps, cfg.seed) == (5, 7)


def test_include_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "defaults: [b.yaml]\n")
    write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(tmp_path / "a.yaml")


def test_missing_include_names_both_files(tmp_path):
    top = write(tmp_path / "top.yaml", "defaults: [nope.yaml]\n")
    with pytest.raises(ConfigError, match=r"nope\.yaml: recipe file not found \(included from .*top\.yaml\)"):
        load_config(top)


def test_missing_recipe_and_bad_yaml_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(write(tmp_path / "bad.yaml", "model: {hf_config: [\n"))
    with pytest.raises(ConfigError, match=r"list\.yaml: a recipe must be a YAML mapping"):
        load_config(write(tmp_path / "list.yaml", "- a\n- b\n"))
    with pytest.raises(ConfigError, match="defaults: expected a list of recipe paths"):
        load_config(write(tmp_path / "inc.yaml", "defaults: {a: 1}\n"))


def test_overrides_are_converted_to_the_field_types():
    cfg = load_config(None, [
        MODEL, "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true", "optimizer.lr=1e-5",
        "rollout.server_urls=[http://a:1,http://b:2]", "logging.wandb_project=null",
        "objective.criterion_weights.style=0.5", "rollout.temperature=1",
    ])
    assert cfg.parallel.tp == 2 and cfg.parallel.sequence_parallel is True
    assert cfg.optimizer.lr == 1e-5
    assert cfg.rollout.server_urls == ["http://a:1", "http://b:2"]
    assert cfg.logging.wandb_project is None
    assert cfg.objective.criterion_weights == {"style": 0.5}
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)


def test_override_beats_recipe(tmp_path):
    recipe = write(tmp_path / "r.yaml", "model: {hf_config: m}\nobjective: {kl_coef: 0.3}\n")
    assert load_config(recipe, ["objective.kl_coef=0.1"]).objective.kl_coef == 0.1


def test_unknown_key_in_override_names_it_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(None, [MODEL, "parallel.tpp=2"])
    assert str(err.value) == "override 'parallel.tpp=2': unknown key 'parallel.tpp' (did you mean parallel.tp?)"


def test_unknown_key_in_recipe_names_file_and_key(tmp_path):
    recipe = write(tmp_path / "r.yaml", "model: {hf_config: m}\nrollout:\n  grup_size: 4\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: unknown key 'rollout\.grup_size' \(did you mean rollout\.group_size\?\)"):
        load_config(recipe)


def test_unknown_key_in_an_include_names_the_include(tmp_path):
    write(tmp_path / "base.yaml", "bogus: 1\n")
    top = write(tmp_path / "top.yaml", "defaults: [base.yaml]\nmodel: {hf_config: m}\n")
    with pytest.raises(ConfigError, match=r"base\.yaml: unknown key 'bogus'"):
        load_config(top)


def test_wrong_type_names_field_expected_type_and_value(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, [MODEL, "parallel.tp=two"])
    assert str(err.value) == "override 'parallel.tp=two': parallel.tp: expected int, got 'two'"
    recipe = write(tmp_path / "r.yaml", "model: {hf_config: m}\nrollout: {server_urls: http://a}\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: rollout\.server_urls: expected list of str, got 'http://a'"):
        load_config(recipe)


def test_scalar_where_a_section_belongs():
    with pytest.raises(ConfigError, match="parallel: expected a mapping of ParallelConfig fields, got 2"):
        load_config(None, [MODEL, "parallel=2"])


@pytest.mark.parametrize("bad", ["parallel.tp", "=3", "defaults=[x.yaml]"])
def test_malformed_overrides(bad):
    with pytest.raises(ConfigError, match="override"):
        load_config(None, [MODEL, bad])


def test_dangling_interpolation_is_a_config_error():
    with pytest.raises(ConfigError, match=r"checkpoint\.dir: .*nope"):
        load_config(None, [MODEL, "checkpoint.dir=${nope}/ckpt"])


def test_save_resolved_round_trips(tmp_path):
    cfg = load_config(None, [MODEL, "parallel.tp=2", "parallel.sequence_parallel=true",
                             "objective.criterion_weights.style=0.5", "rollout.server_urls=[http://a]",
                             "run_name=rt"])
    path = save_resolved(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / RESOLVED_NAME
    text = path.read_text()
    assert "${" not in text and "runs/rt/checkpoints" in text  # stored resolved
    assert load_config(path) == cfg
    assert sorted(p.name for p in path.parent.iterdir()) == [RESOLVED_NAME]  # no temp file left


def test_save_resolved_defaults_to_the_run_dir(tmp_path):
    cfg = load_config(None, [MODEL, f"logging.run_dir={tmp_path}/runs/x"])
    assert save_resolved(cfg) == tmp_path / "runs" / "x" / RESOLVED_NAME
