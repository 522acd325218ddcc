"""The tenth independent review's solutions (tests/agent/hostile_review10.py, written against
cbfe37b): on calc.add and on a real toolz row graded by the runner, and on four built-in
tasks graded by calls. On cbfe37b seven passed without the task (a module whose ``__getattr__``
is made of C callables, looked up by the runner's own namespace check or by inspect.getmodule
under pytest's traceback rendering, took frames with no frame of the policy's on the stack;
from them main()'s locals: the busy set, the flag budget, emit, seen). Each is graded FAIL now,
and the controls grade as they must on every task used."""
from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import tempfile
from pathlib import Path

import pytest

from megatron_tg.agent.swe.build import build
from megatron_tg.agent.tasks import builtin_tasks, load_tasks, materialize, write_files
from megatron_tg.agent.sandbox import rmtree

from .hostile_review10 import ATTACKS, CORRECT, RESULTS, WRONG
from .test_grading import LIMITS, TASK
from .test_swe import toolz_tree  # noqa: F401  (a fixture)

PASSED_ON_CBFE37B = {n for n, v in RESULTS.items() if v.startswith("PASS") and "correct add" not in v}


@pytest.fixture(scope="module")
def grader(sandbox):
    from megatron_tg.agent.grading import Grader
    return Grader(sandbox, LIMITS)


@pytest.fixture(scope="module")
def swe_row(toolz_tree, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("swe10")
    repos, out = root / "repos", root / "swe_tasks.jsonl"
    rows = build(toolz_tree, repo="pytoolz/toolz", repos_root=repos, out=out, package_dirs=["toolz"],
                 test_paths=["toolz/tests"], max_instances=1, seed=0, version="1.0.0", log=lambda *a: None)
    return load_tasks(out, repos_root=repos)[0], rows[0]


def _task(kind, swe_row):
    if kind == "calc":
        return TASK
    if kind == "swe":
        return swe_row[0]
    return dataclasses.replace({t.id: t for t in builtin_tasks()}[kind[len("calls:"):]], grading="calls")


def _grade(grader, task, files):
    ws = tempfile.mkdtemp(prefix="tg-test-r10-")
    try:
        materialize(task, ws)
        plain = {}
        for rel, v in files.items():
            if rel == "__patch__":
                subprocess.run(["git", "apply", "-"], input=v, text=True, cwd=ws, check=True)
            elif callable(v):
                p = Path(ws, rel)
                plain[rel] = v(p.read_text() if p.exists() else "")
            else:
                plain[rel] = v
        write_files(ws, plain)
        grader.sandbox.adopt(ws, ws)
        return asyncio.run(grader.grade(task, ws))
    finally:
        rmtree(ws)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_the_tenth_review_s_solutions_are_graded_fail(grader, swe_row, name):
    spec = ATTACKS[name]
    g = _grade(grader, _task(spec["task"], swe_row), spec["files"])
    assert not g.passed, (name, g.reason, g.flags, g.output[-2000:])
    if name in PASSED_ON_CBFE37B:
        assert g.reason.startswith("tampering detected"), (name, g.reason)


@pytest.mark.parametrize("kind", sorted({s["task"] for s in ATTACKS.values()}))
def test_the_tenth_review_s_controls(grader, swe_row, kind):
    task = _task(kind, swe_row)
    if kind == "calc":
        good, bad = {"calc.py": CORRECT}, {"calc.py": WRONG}
    elif kind == "swe":
        good, bad = {"__patch__": swe_row[1]["patch"]}, {}
    else:
        good, bad = dict(task.privileged["reference"]), {}
    g = _grade(grader, task, good)
    assert g.passed, (kind, g.reason, g.flags, g.output[-2000:])
    assert not _grade(grader, task, bad).passed
