"""The graded checkout: which files are test support (always from the pristine source), the
test files written over the checkout, the policy's change applied to a pristine copy, and
the canary tests. Shared by both ways of running the tests (:mod:`megatron_tg.agent.grading`,
:mod:`megatron_tg.agent.grading_calls`)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from megatron_tg.agent.changes import ChangeSet
from megatron_tg.agent.tasks import Task, write_files

MAX_FILES = 200_000
PREPARE_S = 60.0
"""Longest the workspace may take to read (the walk and the reads of the change); the test run
has its own wall-clock limit (``Limits.wall_s``). A normal grade reads its workspace in well
under a second."""
TEST_DIR_NAMES = frozenset({"tests", "test", "testing"})
STARTUP_NAMES = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py"})


def is_test_support(rel: str, extra: frozenset[str] = frozenset()) -> bool:
    """A file the tests are run with rather than the code under test: graded from the
    pristine source only."""
    parts = rel.split("/")
    name = parts[-1]
    return (rel in extra or name in STARTUP_NAMES or name.endswith(".pth")
            or (name.startswith("test_") and name.endswith(".py")) or name.endswith("_test.py")
            or any(p in TEST_DIR_NAMES for p in parts[:-1]))


def grading_files(task: Task) -> dict[str, str]:
    """The test files written over the checkout: the task's hidden files; for a task from a
    git mirror also the files of its required tests and those its test patch touches, as
    the base commit has them with the patch applied."""
    files = dict(task.hidden_files)
    if task.repo is not None and task.base_commit is not None:
        from megatron_tg.agent.swe.repos import patched_files

        test_files = sorted({t.split("::", 1)[0] for t in task.required_tests} - set(files))
        files.update(patched_files(task.repo, task.base_commit, task.test_patch, test_files))
    return files


def apply_changes(tree: Path, changes: ChangeSet, keep: frozenset[str]) -> list[str]:
    """Write the change into ``tree`` (ours: a pristine copy), except paths that are test
    support; returns those left out."""
    ignored = []
    for rel in [*changes.deleted, *changes.written]:
        # A file where the task has a directory (``tests`` made a regular file) would make the
        # write below remove that directory, test support and all: not graded.
        if rel in changes.written and os.path.isdir(tree / rel) and not os.path.islink(tree / rel):
            ignored.append(rel)
    for rel in changes.deleted:
        if is_test_support(rel, keep):
            ignored.append(rel)
        elif os.path.lexists(tree / rel) and not os.path.isdir(tree / rel):
            os.unlink(tree / rel)
    for rel, data in changes.written.items():
        if rel in ignored:
            continue
        if is_test_support(rel, keep):
            ignored.append(rel)
            continue
        write_files(tree, {rel: ""})  # links and files on the way replaced, directories made
        (tree / rel).write_bytes(data)
    return sorted(ignored)


def canary(nonce: str) -> tuple[str, str, str]:
    """A module with one test that must pass and one that must fail, with names a solution
    cannot tell from the task's (no fixed prefix)."""
    ok, bad = f"test_{secrets.token_hex(4)}", f"test_{secrets.token_hex(4)}"
    body = (f"def {ok}():\n    assert [1, 2] + [3] == [1, 2, 3]\n\n\n"
            f"def {bad}():\n    assert sum([1, 2]) == 4\n")
    return body, ok, bad
