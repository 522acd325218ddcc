"""The task data model: :class:`Task`, its validation, and the path rules every task reader
shares. Readers of task files (:mod:`megatron_tg.agent.tasks`, the SWE formats in
:mod:`megatron_tg.agent.swe`) build on it, so it imports none of them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

_KEYS = {"id", "instruction", "files", "repo", "base_commit", "test_command", "hidden_files", "fail_to_pass",
         "pass_to_pass", "pythonpath", "image", "privileged", "metadata", "grading"}
GRADINGS = ("runner", "calls")

class TaskFormatError(ValueError):
    pass


@dataclass
class Task:
    id: str
    instruction: str
    fail_to_pass: list[str]
    """Test node ids (``path::name``) that must pass for the task to count as solved."""
    pass_to_pass: list[str] = field(default_factory=list)
    """Test node ids that passed before the change and must keep passing."""
    files: dict[str, str] = field(default_factory=dict)
    repo: str | None = None
    """Absolute path of a directory (a source tree or a git mirror) seeding the workspace."""
    base_commit: str | None = None
    """With a git repository as ``repo``: the commit whose tree seeds the workspace."""
    test_command: str | None = None
    hidden_files: dict[str, str] = field(default_factory=dict)
    """Test files written over the graded copy (the agent never sees them)."""
    test_patch: str | None = None
    """A unified diff applied to the base commit's files for grading (SWE-bench's test_patch)."""
    pythonpath: list[str] = field(default_factory=lambda: ["."])
    image: str | None = None
    privileged: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    """The file this task was read from (the sandbox hides it: it holds the hidden tests)."""
    grading: str = "runner"
    """How the grader runs the required tests: ``"runner"``, pytest in the sandbox beside the
    tested code, which in-process checks watch (any test, e.g. a SWE-bench row's); ``"calls"``,
    pytest outside the sandbox, the tested code reached only through calls that return plain
    data (tests that call the task's functions and compare what they return; no in-process
    attack can reach the verdict). docs/grading.md compares the two."""

    @property
    def required_tests(self) -> list[str]:
        return list(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))

    @classmethod
    def from_dict(cls, d: Any, base_dir: str | os.PathLike | None = None, source: str | None = None,
                  repos_root: str | os.PathLike | None = None) -> "Task":
        if not isinstance(d, dict):
            raise TaskFormatError(f"expected an object, got {type(d).__name__}")
        if "hidden_test_command" in d:
            raise TaskFormatError("hidden_test_command: no longer read (an exit code can be forged); list "
                                  "the tests that decide the task in fail_to_pass / pass_to_pass")
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise TaskFormatError(f"unknown field(s) {unknown}")
        for k in ("id", "instruction"):
            if not isinstance(d.get(k), str) or not d[k].strip():
                raise TaskFormatError(f"{k}: must be a non-empty string, got {d.get(k)!r}")
        files = _file_map(d.get("files", {}), "files")
        hidden = _file_map(d.get("hidden_files", {}), "hidden_files")
        f2p, p2p = test_ids(d.get("fail_to_pass"), "fail_to_pass"), test_ids(d.get("pass_to_pass", []), "pass_to_pass")
        if not f2p and not p2p:
            raise TaskFormatError("fail_to_pass: no test decides this task (fail_to_pass and pass_to_pass empty)")
        repo = d.get("repo")
        if repo is not None:
            repo = resolve_repo(repo, repos_root if repos_root is not None else (base_dir or "."))
        for k in ("test_command", "base_commit", "image"):
            if d.get(k) is not None and (not isinstance(d[k], str) or not d[k].strip()):
                raise TaskFormatError(f"{k}: must be a non-empty string, got {d[k]!r}")
        if d.get("base_commit") is not None and repo is None:
            raise TaskFormatError("base_commit: needs a repo")
        pp = d.get("pythonpath", ["."])
        if not isinstance(pp, list) or not pp:
            raise TaskFormatError(f"pythonpath: must be a non-empty list of relative paths, got {pp!r}")
        pp = [str(safe_relpath(p, "pythonpath", allow_root=True)) for p in pp]
        md = d.get("metadata", {})
        if not isinstance(md, dict):
            raise TaskFormatError("metadata: must be an object")
        grading = d.get("grading", "runner")
        if grading not in GRADINGS:
            raise TaskFormatError(f"grading: must be one of {list(GRADINGS)}, got {grading!r}")
        return cls(id=d["id"], instruction=d["instruction"], fail_to_pass=f2p, pass_to_pass=p2p, files=files,
                   repo=repo, base_commit=d.get("base_commit"), test_command=d.get("test_command"),
                   hidden_files=hidden, pythonpath=pp, image=d.get("image"), privileged=d.get("privileged"),
                   metadata=md, source=source, grading=grading)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "instruction": self.instruction, "files": self.files,
                             "fail_to_pass": self.fail_to_pass}
        for k in ("repo", "base_commit", "test_command", "image", "privileged"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        for k in ("pass_to_pass", "hidden_files", "metadata"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if self.pythonpath != ["."]:
            d["pythonpath"] = self.pythonpath
        if self.grading != "runner":
            d["grading"] = self.grading
        return d


def resolve_repo(repo: Any, root: str | os.PathLike) -> str:
    """``repo`` resolved (links included) inside ``root``; anything else is refused."""
    if not isinstance(repo, str) or not repo.strip():
        raise TaskFormatError(f"repo: must be a path string, got {repo!r}")
    root_real = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root_real, repo))
    if path != root_real and not path.startswith(root_real + os.sep):
        raise TaskFormatError(f"repo: {repo!r} resolves to {path}, outside the repos root {root_real} "
                              "(set rollout.repos_root to the directory holding the mirrors)")
    if not os.path.isdir(path):
        raise TaskFormatError(f"repo: {path} is not a directory")
    return path


def test_ids(v: Any, name: str) -> list[str]:
    if v is None:
        raise TaskFormatError(f"{name}: required (a list of test ids 'path::name')")
    if not isinstance(v, list):
        raise TaskFormatError(f"{name}: must be a list of test ids, got {type(v).__name__}")
    for t in v:
        if not isinstance(t, str) or "::" not in t:
            raise TaskFormatError(f"{name}: {t!r} is not a test id 'path::name'")
        safe_relpath(t.split("::", 1)[0], name)
    if len(set(v)) != len(v):
        raise TaskFormatError(f"{name}: duplicate test ids {sorted({t for t in v if v.count(t) > 1})}")
    return list(v)


def _file_map(v: Any, name: str) -> dict[str, str]:
    if not isinstance(v, dict):
        raise TaskFormatError(f"{name}: must be an object {{path: content}}")
    seen: dict[str, str] = {}
    for p, c in v.items():
        norm = str(safe_relpath(p, name))
        if not isinstance(c, str):
            raise TaskFormatError(f"{name}[{p!r}]: content must be a string")
        if norm in seen:
            raise TaskFormatError(f"{name}: {p!r} and {seen[norm]!r} name the same file")
        seen[norm] = p
    for norm, p in seen.items():  # "a" and "a/b": one would silently replace the other
        for parent in PurePosixPath(norm).parents:
            if str(parent) in seen and str(parent) != ".":
                raise TaskFormatError(f"{name}: {seen[str(parent)]!r} is a file but {p!r} puts a file inside it")
    return dict(v)


def safe_relpath(p: Any, what: str = "path", allow_root: bool = False) -> PurePosixPath:
    """A relative path that stays inside its root (no absolute paths, no ``..``, no ``.``
    parts or empty parts that make two spellings of one file)."""
    if not isinstance(p, str) or not p or "\x00" in p:
        raise TaskFormatError(f"{what}: invalid path {p!r}")
    if allow_root and p == ".":
        return PurePosixPath(".")
    pp = PurePosixPath(p)
    if pp.is_absolute() or ".." in pp.parts:
        raise TaskFormatError(f"{what}: path {p!r} must be relative and stay inside the workspace")
    if p.endswith("/") or "//" in p or any(part == "." for part in p.split("/")):
        raise TaskFormatError(f"{what}: path {p!r} must name a file ('.', empty parts and a trailing / are not allowed)")
    return pp
