"""Coding tasks: the JSONL format, the built-in set, and materialising a task's workspace.

One task per line::

    {"id": "fizzbuzz",
     "instruction": "Implement fizzbuzz(n) in solution.py ...",      # the user message
     "files": {"solution.py": "def fizzbuzz(n):\\n    raise NotImplementedError\\n"},
     "repo": "repos/fizz",          # optional: a source tree copied in first, under the repos root
     "base_commit": "3f1c...",      # optional: with a git mirror as repo, the commit checked out
     "test_command": "python test_visible.py",   # optional: what the agent's run_tests runs
     "hidden_files": {"tests/test_hidden.py": "..."},  # restored for grading, never shown
     "fail_to_pass": ["tests/test_hidden.py::test_zero"],   # must pass after the change
     "pass_to_pass": ["tests/test_old.py::test_basic"],     # must keep passing
     "pythonpath": ["src"],         # optional: import roots of the tests (default: the workspace)
     "image": "docker://...",       # optional: the per-instance image for container sandboxes
     "privileged": {...},           # optional, for the judge only (e.g. a reference solution)
     "metadata": {...}}             # optional, free-form

The reward is decided by :mod:`megatron_tg.agent.grading`: pytest, run by the grader on a
copy of the final workspace with the test files restored from the task, must report every
``fail_to_pass`` and ``pass_to_pass`` test as passed. SWE-bench-style rows (``instance_id``,
``FAIL_TO_PASS``, ...) are read by :mod:`megatron_tg.agent.swe.formats`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from megatron_tg.agent.task_types import (
    Task,
    TaskFormatError,
    resolve_repo,
    safe_relpath,
    test_ids,
)

__all__ = ["BUILTIN_TASKS", "Task", "TaskFormatError", "builtin_tasks", "load_tasks", "materialize",
           "resolve_repo", "safe_relpath", "test_ids", "write_files"]

BUILTIN_TASKS = Path(__file__).parent / "data" / "tasks.jsonl"

def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise TaskFormatError(f"duplicate key {k!r} in one object (JSON keeps only the last)")
        d[k] = v
    return d


def load_tasks(path: str | os.PathLike, repos_root: str | os.PathLike | None = None) -> list[Task]:
    """Read a task JSONL; errors name the file, line and field. Ids must be unique.
    SWE-bench-style rows (with ``instance_id``) are converted by :mod:`megatron_tg.agent.swe.formats`."""
    from megatron_tg.agent.swe.formats import is_swe_row, task_from_swe_row

    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise TaskFormatError(f"task file {path} does not exist (see the README's agent section for how "
                              "to build one)")
    tasks: list[Task] = []
    seen: set[str] = set()
    with open(path, "rb") as f:  # bytes: a bad UTF-8 line is reported by its number
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskFormatError(f"{path}:{n}: not valid UTF-8 at byte {e.start} of the line "
                                      f"({raw[max(0, e.start - 10):e.start + 10]!r})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_no_duplicate_keys)
                if is_swe_row(row):
                    t = task_from_swe_row(row, repos_root=repos_root or os.path.dirname(path), source=path)
                else:
                    t = Task.from_dict(row, base_dir=os.path.dirname(path), source=path, repos_root=repos_root)
            except (json.JSONDecodeError, TaskFormatError) as e:
                raise TaskFormatError(f"{path}:{n}: {e}") from e
            if t.id in seen:
                raise TaskFormatError(f"{path}:{n}: duplicate task id {t.id!r}")
            seen.add(t.id)
            tasks.append(t)
    return tasks


def builtin_tasks() -> list[Task]:
    """The small built-in set of Python coding tasks (for CPU runs and tests)."""
    return load_tasks(BUILTIN_TASKS)


def write_files(root: str | os.PathLike, files: dict[str, str]) -> None:
    """Write ``{relative path: content}`` under ``root``. Symlinks on the way (which sandboxed
    code may have planted, e.g. ``tests -> /etc``) are replaced, never written through."""
    for rel, content in files.items():
        cur = Path(root)
        parts = safe_relpath(rel).parts
        for i, part in enumerate(parts):
            cur = cur / part
            if cur.is_symlink() or (i < len(parts) - 1 and cur.exists() and not cur.is_dir()):
                cur.unlink()
            if i < len(parts) - 1 and not cur.exists():
                cur.mkdir()
            elif i == len(parts) - 1 and cur.is_dir():
                shutil.rmtree(cur)
        cur.write_text(content, encoding="utf-8")


def materialize(task: Task, dest: str | os.PathLike) -> Path:
    """Fill ``dest`` (an empty directory) with the task's starting files."""
    dest = Path(dest)
    if task.repo is not None and task.base_commit is not None:
        from megatron_tg.agent.swe.repos import checkout

        checkout(task.repo, task.base_commit, dest)
    elif task.repo is not None:
        shutil.copytree(task.repo, dest, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git"))
    write_files(dest, task.files)
    return dest
