"""The ``megatron-tg`` CLI, run as a user runs it: a subprocess, output parsed back."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_tg.cli import SUBCOMMANDS
from megatron_tg.config import load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny_cpu.yaml"


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    return subprocess.run([sys.executable, "-m", "megatron_tg.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=120, env={**base, **(env or {})})


def test_config_prints_the_resolved_config_only():
    out = cli("config", "--recipe", TINY, "objective.kl_coef=0.3")
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert docs == [yaml.safe_load(to_yaml(load_config(TINY, ["objective.kl_coef=0.3"])))]
    assert docs[0]["objective"]["kl_coef"] == 0.3


def test_dry_run_prints_config_and_layout_with_rank_groups():
    out = cli("config", "--recipe", TINY, "--dry-run", "--world-size", "4", "parallel.ep=2")
    assert out.returncode == 0, out.stderr
    config, layout = yaml.safe_load_all(out.stdout)
    assert config["parallel"]["ep"] == 2 and config["run_name"] == "tiny_cpu"
    layout = layout["layout"]
    assert layout["sizes"] == {"world_size": 4, "tp": 1, "cp": 1, "ep": 2, "pp": 1, "dp": 4,
                               "etp": 1, "edp": 2}
    assert layout["groups"]["ep"] == [[0, 1], [2, 3]]
    assert layout["groups"]["edp"] == [[0, 2], [1, 3]]
    assert layout["groups"]["dp"] == [[0, 1, 2, 3]]
    assert "parallel layout for 4 ranks (--world-size)" in out.stdout


def test_dry_run_prints_every_timeout_resolved():
    out = cli("config", "--recipe", TINY, "--dry-run", "timeouts.collective_s=600",
              "rollout.max_turns=3", "rollout.request_timeout_s=100", "judge.timeout_s=10",
              "judge.max_retries=1")
    assert out.returncode == 0, out.stderr
    t = list(yaml.safe_load_all(out.stdout))[1]["timeouts"]
    assert t["timeouts.collective_s"] == 600.0
    assert t["timeouts.rollout_wait_s"] == 3 * 100 + 2 * 10  # derived: None in the config
    assert t["rollout.request_timeout_s"] == 100.0 and t["judge.timeout_s"] == 10.0
    out = cli("config", "--recipe", TINY, "--dry-run", "timeouts.rollout_wait_s=7")
    assert list(yaml.safe_load_all(out.stdout))[1]["timeouts"]["timeouts.rollout_wait_s"] == 7.0
    out = cli("config", "--recipe", TINY, "timeouts.health_s=0")
    assert out.returncode != 0 and "timeouts.health_s: must be > 0" in out.stderr


def test_overrides_may_come_before_and_after_options():
    out = cli("config", "--recipe", TINY, "objective.kl_coef=0.2", "--dry-run", "parallel.ep=2",
              "--world-size", "2", "seed=3")
    assert out.returncode == 0, out.stderr
    config, layout = yaml.safe_load_all(out.stdout)
    assert (config["objective"]["kl_coef"], config["parallel"]["ep"], config["seed"]) == (0.2, 2, 3)
    assert layout["layout"]["sizes"]["world_size"] == 2
    out = cli("config", "--recipe", TINY, "seed=3", "--dryrun")
    assert out.returncode == 2 and "unrecognized arguments: --dryrun" in out.stderr


def test_dry_run_world_size_from_env_then_from_recipe_nodes():
    out = cli("config", "--recipe", TINY, "--dry-run", "parallel.tp=2", env={"WORLD_SIZE": "2"})
    assert out.returncode == 0, out.stderr
    assert list(yaml.safe_load_all(out.stdout))[1]["layout"]["groups"]["tp"] == [[0, 1]]
    out = cli("config", "--recipe", "recipes/tg_235b.yaml", "--dry-run")
    assert out.returncode == 0, out.stderr
    layout = list(yaml.safe_load_all(out.stdout))[1]["layout"]
    assert layout["sizes"]["world_size"] == 128 and layout["gpus"]["total"] == 128 + 64
    assert "not listed" in layout["groups"]  # 128 ranks is too many to print


@pytest.mark.parametrize("args, message", [
    (("parallel.tpp=2",), "unknown key 'parallel.tpp'"),
    (("parallel.tp=two",), "parallel.tp: expected int, got 'two'"),
    (("--dry-run", "--world-size", "3", "parallel.ep=2"), "world_size=3 is not divisible"),
])
def test_bad_input_exits_2_with_one_line_and_no_traceback(args, message):
    out = cli("config", "--recipe", TINY, *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""  # nothing half-printed


def test_help_is_lazy_and_lists_subcommands():
    code = ("import sys\nfrom megatron_tg import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'omegaconf'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    for name in SUBCOMMANDS:
        assert name in out.stdout


def test_subcommand_help_shows_its_own_options():
    out = cli("config", "--help")
    assert out.returncode == 0 and "--dry-run" in out.stdout and "--world-size" in out.stdout


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_parses_its_own_options(name, capsys):
    """``megatron-tg NAME --help`` builds NAME's parser from its module's add_arguments and
    prints its description; the parsed command dispatches to that module's run (or, for a
    module holding two subcommands, to the named one's)."""
    from megatron_tg import cli as cli_mod

    with pytest.raises(SystemExit) as exit_:
        cli_mod.main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: megatron-tg {name}") and SUBCOMMANDS[name].help.split()[0] in out
    parser = cli_mod.build_parser([name])
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    options = [a for a in sub._actions if a.dest != "help"]
    assert options, f"{name} registers no arguments"
    spec = SUBCOMMANDS[name]
    module = importlib.import_module(spec.module)
    entry = getattr(module, spec.attr) if spec.attr else module
    assert sub.get_default("_run") is entry.run
    # Subcommands live in their package's command module (cli.py's own rule).
    assert spec.module.endswith(".command"), spec.module


def test_console_script_is_installed_and_runs():
    script = Path(sys.executable).with_name("megatron-tg")
    if not script.exists():
        pytest.skip("megatron-tg console script not installed next to this interpreter")
    out = subprocess.run([str(script), "config", "--recipe", TINY, "--dry-run"], cwd=ROOT, text=True,
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "layout:" in out.stdout


def test_convert_subcommand_runs_the_converter(tmp_path):
    """``megatron-tg convert hf-to-megatron --dry-run`` reaches the converter's own planner
    (the 30B model's published config.json, no weights)."""
    import json
    import shutil

    shutil.copy(ROOT / "tests" / "fixtures" / "hf_configs" / "qwen3-coder-30b-a3b-instruct.json",
                tmp_path / "config.json")
    out = cli("convert", "hf-to-megatron", "--hf-dir", str(tmp_path), "--dry-run", "--tp", "2",
              "--ep", "8")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    assert plan["layout"] == {"tp": 2, "ep": 8, "pp": 1, "etp": 2, "world_size": 16}
    out = cli("convert", "megatron-to-hf", "--megatron-dir", str(tmp_path), "--out-dir",
              str(tmp_path / "hf"))
    assert out.returncode == 2 and "not a megatron torch_dist checkpoint" in out.stderr
    assert not (tmp_path / "hf").exists()


def _actions_without_help(parser, path):
    import argparse

    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _actions_without_help(sub, path + [name])
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"megatron-tg {' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_of_every_subcommand_has_help_text():
    import argparse

    from megatron_tg.cli import SUBCOMMANDS, build_parser

    missing = []
    for name in SUBCOMMANDS:
        sub = next(a for a in build_parser([name])._actions
                   if isinstance(a, argparse._SubParsersAction)).choices[name]
        missing += _actions_without_help(sub, [name])
    assert missing == [], "options without help text:\n" + "\n".join(missing)


def _check_runtime():
    """``scripts/check_runtime.py``, the front door's check: one scanner of the named entry
    points serves CI's runtime venv and this test."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_runtime", ROOT / "scripts" / "check_runtime.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_entry_point_scan_reads_shell_commands_and_argv_lists():
    cr = _check_runtime()
    text = ('exec "$venv/bin/python" -m megatron_tg.demo "$@"\n'
            'torchrun --nproc-per-node 2 -m megatron_tg.cli sft --recipe R\n'
            'cmd = [sys.executable, "-m", "megatron_tg.sampling.service", "--recipe", str(recipe)]\n'
            'pytest -m gpu tests/models; git commit -m megatron_tgx; see python -m megatron_tg.train.\n')
    found = {m for pattern in cr.ENTRY_POINT_RES for m in pattern.findall(text)}
    assert found == {"megatron_tg.demo", "megatron_tg.cli", "megatron_tg.sampling.service",
                     "megatron_tg.train"}


def test_every_named_python_m_entry_point_runs_its_help():
    """Each module of the package that the README, docs, scripts, slurm/, recipes, .ci, tools,
    benchmarks, tests or the package's own code run with ``-m`` exits 0 on ``--help`` with a
    usage line: a module moved without its callers fails here. Measured on a 2-core machine:
    19 modules, about 30 s whether one or four run at a time (each is a process start plus
    its imports); four at a time is for machines with more cores."""
    from concurrent.futures import ThreadPoolExecutor

    cr = _check_runtime()
    modules = cr.documented_entry_points(ROOT)
    # callers the scan must see: slurm/lib.sh's trainer, the service client's argv, scripts/demo.sh
    assert {"megatron_tg.train", "megatron_tg.sampling.service", "megatron_tg.demo"} <= set(modules)
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}

    def help_of(mod: str) -> tuple[str, subprocess.CompletedProcess]:
        argv = [sys.executable, "-m", mod, *cr.ENTRY_POINT_VERBS.get(mod, []), "--help"]
        return mod, subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, timeout=300, env=env)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(help_of, modules))
    bad = [f"python -m {mod} --help: exit {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}"
           for mod, r in results if r.returncode != 0 or "usage:" not in r.stdout]
    assert not bad, "\n".join(bad)
