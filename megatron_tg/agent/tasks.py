"""Coding tasks: the JSONL format, the built-in set, and materialising a task's workspace.

One task per line::

    {"id": "fizzbuzz",
     "instruction": "Implement fizzbuzz(n) in solution.py ...",      # the user message
     "files": {"solution.py": "def fizzbuzz(n):\\n    raise NotImplementedError\\n"},
     "repo": "repos/fizz",          # optional: a directory copied in first (relative to the JSONL)
     "test_command": "python test_visible.py",   # optional: what the agent's run_tests runs
     "hidden_files": {"_hidden_test.py": "..."}, # written only for grading, never shown
     "hidden_test_command": "python _hidden_test.py",
     "privileged": {...},           # optional, for the judge only (e.g. a reference solution)
     "metadata": {...}}             # optional, free-form

The reward is whether ``hidden_test_command`` exits 0 in a copy of the final workspace with
``hidden_files`` added (see :mod:`megatron_tg.agent.harness`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

BUILTIN_TASKS = Path(__file__).parent / "data" / "tasks.jsonl"
_KEYS = {"id", "instruction", "files", "repo", "test_command", "hidden_files", "hidden_test_command",
         "privileged", "metadata"}


class TaskFormatError(ValueError):
    pass


@dataclass
class Task:
    id: str
    instruction: str
    hidden_test_command: str
    files: dict[str, str] = field(default_factory=dict)
    repo: str | None = None
    """Absolute path of a directory whose contents seed the workspace (before ``files``)."""
    test_command: str | None = None
    hidden_files: dict[str, str] = field(default_factory=dict)
    privileged: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    """The file this task was read from (the sandbox hides it: it holds the hidden tests)."""

    @classmethod
    def from_dict(cls, d: Any, base_dir: str | os.PathLike | None = None, source: str | None = None) -> "Task":
        if not isinstance(d, dict):
            raise TaskFormatError(f"expected an object, got {type(d).__name__}")
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise TaskFormatError(f"unknown field(s) {unknown}")
        for k in ("id", "instruction", "hidden_test_command"):
            if not isinstance(d.get(k), str) or not d[k].strip():
                raise TaskFormatError(f"{k}: must be a non-empty string, got {d.get(k)!r}")
        files = _file_map(d.get("files", {}), "files")
        hidden = _file_map(d.get("hidden_files", {}), "hidden_files")
        repo = d.get("repo")
        if repo is not None:
            if not isinstance(repo, str):
                raise TaskFormatError(f"repo: must be a path string, got {repo!r}")
            repo = os.path.abspath(os.path.join(base_dir or ".", repo))
            if not os.path.isdir(repo):
                raise TaskFormatError(f"repo: {repo} is not a directory")
        tc = d.get("test_command")
        if tc is not None and not isinstance(tc, str):
            raise TaskFormatError(f"test_command: must be a string, got {tc!r}")
        md = d.get("metadata", {})
        if not isinstance(md, dict):
            raise TaskFormatError("metadata: must be an object")
        return cls(id=d["id"], instruction=d["instruction"], hidden_test_command=d["hidden_test_command"],
                   files=files, repo=repo, test_command=tc, hidden_files=hidden,
                   privileged=d.get("privileged"), metadata=md, source=source)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "instruction": self.instruction, "files": self.files,
                             "hidden_test_command": self.hidden_test_command}
        for k in ("repo", "test_command", "privileged"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.hidden_files:
            d["hidden_files"] = self.hidden_files
        if self.metadata:
            d["metadata"] = self.metadata
        return d


def _file_map(v: Any, name: str) -> dict[str, str]:
    if not isinstance(v, dict):
        raise TaskFormatError(f"{name}: must be an object {{path: content}}")
    for p, c in v.items():
        safe_relpath(p, name)
        if not isinstance(c, str):
            raise TaskFormatError(f"{name}[{p!r}]: content must be a string")
    return dict(v)


def safe_relpath(p: Any, what: str = "path") -> PurePosixPath:
    """A relative path that stays inside its root (no absolute paths, no ``..``)."""
    if not isinstance(p, str) or not p or "\x00" in p:
        raise TaskFormatError(f"{what}: invalid path {p!r}")
    pp = PurePosixPath(p)
    if pp.is_absolute() or ".." in pp.parts:
        raise TaskFormatError(f"{what}: path {p!r} must be relative and stay inside the workspace")
    return pp


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """Read a task JSONL; errors name the file and line. Ids must be unique."""
    path = os.path.abspath(path)
    tasks: list[Task] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                t = Task.from_dict(json.loads(line), base_dir=os.path.dirname(path), source=path)
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
    if task.repo is not None:
        shutil.copytree(task.repo, dest, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git"))
    write_files(dest, task.files)
    return dest
