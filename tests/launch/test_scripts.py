"""slurm/*.sh outside Slurm: the dry-run, the submit helper, argument errors, shellcheck.

Slurm's commands are replaced by recorders on PATH, so these run anywhere and prove that a
dry-run submits and starts nothing. The scripts inside a real job: tests/slurm/.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WRAPPERS = sorted((ROOT / "slurm").glob("tg_*.sh"))
SCRIPTS = sorted([*(ROOT / "slurm").glob("*.sh"), *(ROOT / "tests" / "slurm").glob("*.sh")])


@pytest.fixture
def fake_slurm(tmp_path):
    """PATH with recording stand-ins for Slurm's commands; returns the record file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "slurm-calls"
    for tool in ("sbatch", "srun", "scancel", "scontrol", "squeue", "salloc"):
        path = bin_dir / tool
        path.write_text(f'#!/bin/sh\necho "$(basename "$0") $*" >> "{record}"\necho 4242\n')
        path.chmod(0o755)
    return bin_dir, record


def run_script(script: Path, *args: str, fake_slurm, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    bin_dir, _ = fake_slurm
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TG_"))}
    # The knobs a lab might have exported must not leak into these tests.
    for knob in ("RECIPE", "TRAIN_NODES", "ROLLOUT_NODES", "JUDGE_NODES", "JUDGE_MODEL", "JUDGE_URL",
                 "GPUS_PER_NODE", "ACCEL", "ENGINE", "OVERRIDES", "DRY_RUN", "PORT_BASE"):
        clean.pop(knob, None)
    full = {**clean, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=full, capture_output=True, text=True)


def header(script: Path, option: str) -> str:
    match = re.search(rf"^#SBATCH --{option}=(\S+)$", script.read_text(), re.M)
    assert match, f"{script.name}: no #SBATCH --{option}"
    return match.group(1)


@pytest.mark.parametrize("script", WRAPPERS, ids=lambda p: p.name)
def test_dry_run_prints_the_plan_sized_like_the_header_and_submits_nothing(script, fake_slurm):
    out = run_script(script, "--dry-run", fake_slurm=fake_slurm)
    assert out.returncode == 0, out.stderr
    assert "# launch plan:" in out.stdout and "\nlayout: world " in out.stdout
    assert re.search(r"^train +\d+ +\d+ ", out.stdout, re.M)
    assert not fake_slurm[1].exists(), fake_slurm[1].read_text()
    # `sbatch slurm/tg_X.sh` allocates what the header says: the plan's node count
    total = re.search(r"^total +(\d+)", out.stdout, re.M)
    assert total and total.group(1) == header(script, "nodes"), out.stdout
    assert re.search(r'^export RECIPE="\$\{RECIPE:-recipes/\w+\.yaml\}"', script.read_text(), re.M)
    assert header(script, "job-name") == script.stem  # runs/slurm/<script>-<job id>.log
    for option in ("signal", "output", "open-mode", "time"):
        header(script, option)
    assert "#SBATCH --requeue" in script.read_text() and "#SBATCH --exclusive" in script.read_text()


def test_dry_run_with_nodes_and_a_refused_count(fake_slurm):
    out = run_script(ROOT / "slurm" / "tg_30b.sh", "--dry-run", "--nodes", "7", fake_slurm=fake_slurm)
    assert out.returncode == 0 and re.search(r"^rollout +4 +32 ", out.stdout, re.M), out.stdout
    out = run_script(ROOT / "slurm" / "tg_235b.sh", "--dry-run", fake_slurm=fake_slurm, TRAIN_NODES="12")
    assert out.returncode == 2 and "multiple of 8 trainer nodes" in out.stderr, out.stderr
    assert not fake_slurm[1].exists()


def test_submit_sizes_nodes_from_the_plan(fake_slurm, tmp_path):
    script = ROOT / "slurm" / "tg_30b.sh"
    out = run_script(script, "--partition=gpu", "objective.kl_coef=0.3", fake_slurm=fake_slurm, cwd=tmp_path,
                     RECIPE=str(ROOT / "recipes" / "tg_30b.yaml"), TRAIN_NODES="4", JUDGE_MODEL="models/j")
    assert out.returncode == 0, out.stderr
    calls = fake_slurm[1].read_text().splitlines()
    assert calls == [f"sbatch --nodes=7 --partition=gpu {script} objective.kl_coef=0.3"]
    assert (tmp_path / "runs" / "slurm").is_dir()  # sbatch does not create --output's directory


def test_submit_refuses_a_plan_with_blockers(fake_slurm, tmp_path):
    out = run_script(ROOT / "slurm" / "tg_30b.sh", fake_slurm=fake_slurm, cwd=tmp_path,
                     RECIPE=str(ROOT / "recipes" / "tg_30b.yaml"))
    assert out.returncode != 0 and "JUDGE_MODEL" in out.stderr and "not submitting" in out.stderr
    assert not fake_slurm[1].exists()


def test_arguments_that_are_neither_overrides_nor_options_are_refused(fake_slurm):
    out = run_script(ROOT / "slurm" / "tg_tiny.sh", "--dry-run", "gpu", fake_slurm=fake_slurm)
    assert out.returncode != 0 and "neither key=value nor an option" in out.stderr


def test_scripts_are_shellcheck_clean():
    """CI installs it with `apt-get install -y shellcheck`."""
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    assert len(SCRIPTS) >= 7
    out = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
