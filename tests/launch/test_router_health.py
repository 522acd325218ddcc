"""The sglang-router's health flags: derived from the recipe, passed by slurm/task.sh, checked
by the preflight, and named as the installed router binary (the test extra's 0.3.2) names
them; its defaults let a weight-sync pause take every worker out, the derived ones do not."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from megatron_tg.config import load_config
from megatron_tg.launch.plan import Knobs, make_plan
from megatron_tg.launch.preflight import check_router
from megatron_tg.launch.router_health import (ROUTER_DEFAULTS, ROUTER_VERSION, check_router_argv,
                                              failing_checks, router_health, tolerated_pause_s)
from tests.launch.task_argv import task_argv

ROOT = Path(__file__).resolve().parents[2]
R30 = str(ROOT / "recipes" / "tg_30b.yaml")
JUDGE = Knobs(judge_model="models/judge", job_dir="JOB")


def test_pyproject_pins_the_router_version_the_flags_follow():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("gpu", "test"):
        assert f"sglang-router=={ROUTER_VERSION}" in extras[extra], (extra, extras[extra])


def test_flag_names_and_defaults_are_the_installed_routers():
    pytest.importorskip("sglang_router", reason="the test extra installs sglang-router==0.3.2")
    assert metadata.version("sglang-router") == ROUTER_VERSION
    text = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    flat = " ".join(text.split())
    for flag in router_health(load_config(R30)).flags()[::2]:
        assert f"{flag} " in flat, flag
    for flag, default in ROUTER_DEFAULTS.items():
        m = re.search(re.escape(flag) + r" [A-Z_]+ .*?\(default: (\d+)\)", flat)
        assert m and int(m.group(1)) == default, (flag, m and m.group(0)[:200])


def test_failing_checks_bounds_every_pause_placement():
    """The router checks at k * interval; a check fails when it runs into the pause (starts
    within its timeout before it, or during it). Over every placement of the pause, the most
    failures in a row never exceed failing_checks, which is at most one above (it counts a
    check on the pause's very edge as failing: timing jitter decides those)."""
    for interval, timeout, pause in [(60, 5, 180), (26, 25, 600), (10, 3, 7), (26, 25, 25)]:
        worst = 0
        for start10 in range(0, interval * 10):
            start = start10 / 10
            fails = [start - timeout < k * interval <= start + pause for k in range(0, 200)]
            run = best = 0
            for f in fails:
                run = run + 1 if f else 0
                best = max(best, run)
            worst = max(worst, best)
        assert worst <= failing_checks(pause, interval, timeout) <= worst + 1, (interval, timeout, pause, worst)
        th = failing_checks(pause, interval, timeout) + 1
        assert pause < tolerated_pause_s(interval, timeout, th) <= pause + interval


def test_defaults_fail_the_plans_pause_and_the_derived_flags_pass():
    cfg = load_config(R30)
    h = router_health(cfg)
    assert h.pause_s == 2 * cfg.timeouts.weight_sync_s  # the first sync pushes twice (coverage check)
    assert h.timeout_s >= 20  # a check waits for a paused engine's own 503
    state, detail = check_router_argv(cfg, ["--worker-urls", "http://a:1"])  # 0.3.2's defaults
    assert state == "FAIL" and "tolerates pauses under 115 s" in detail and " ".join(h.flags()) in detail
    assert check_router_argv(cfg, ["--worker-urls", "http://a:1", *h.flags()])[0] == "PASS"
    # ROUTER_ARGS come last on task.sh's command line: a smaller threshold there wins, and fails
    assert check_router_argv(cfg, [*h.flags(), "--health-failure-threshold=3"])[0] == "FAIL"
    # without the coverage check the first sync pushes once: fewer failures are enough
    lighter = router_health(load_config(R30, ["rollout.sync_verify_coverage=false"]))
    assert lighter.failure_threshold < h.failure_threshold
    with pytest.raises(ValueError, match="--health-failure-threshold needs an integer"):
        check_router_argv(cfg, ["--health-failure-threshold", "x"])


def test_task_sh_starts_the_router_with_the_plans_flags_and_the_preflight_checks_them(tmp_path):
    plan = make_plan(R30, [], JUDGE)
    expected = router_health(load_config(R30)).flags()
    assert plan.router_args == expected
    router = task_argv(plan, tmp_path, step=[s.role for s in plan.steps].index("router"))
    assert router[0] == "--worker-urls"
    i = router.index(expected[0])
    assert router[i:i + len(expected)] == expected
    cmdline = "python -m sglang_router.launch_router " + " ".join(router)
    assert check_router(R30, [], cmdline)[1] == "PASS"
    assert check_router(R30, [], cmdline + " --health-check-interval-secs 5")[1] == "FAIL"
    assert check_router(R30, [], "")[1] == "SKIP"
    bare = make_plan(R30, [], Knobs(judge_model="models/judge", job_dir="JOB", router=False))
    assert not bare.router_url and bare.router_args == []  # no router, no flags


def test_a_colocated_router_runs_without_health_checks():
    """Colocated engines are released for every train phase: the router gets
    --disable-health-check (tests/rollout/test_router.py: a router with it keeps a released
    engine, one with 1 s checks drops it), and a router started without it is refused."""
    cfg = load_config(str(ROOT / "recipes" / "tg_30b_colocated.yaml"))
    flags = router_health(cfg).flags()
    assert flags[-1] == "--disable-health-check"
    assert check_router_argv(cfg, ["--worker-urls", "http://a:1", *flags])[0] == "PASS"
    state, detail = check_router_argv(cfg, ["--worker-urls", "http://a:1", *flags[:-1]])
    assert state == "FAIL" and "--disable-health-check" in detail
    assert "--disable-health-check" not in router_health(load_config(R30)).flags()
