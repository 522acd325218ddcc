"""Local git mirrors of task repositories: a commit's tree as a workspace, and the test
files a grader restores (a commit's version with the instance's test patch applied).

Only ``git`` plumbing that needs no work tree is used (``archive``, ``show``, ``apply`` on
a scratch directory), so one bare mirror serves any number of concurrent workspaces.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

from megatron_tg.agent.task_types import TaskFormatError, safe_relpath

_DIFF_PATH = re.compile(r"^(?:---|\+\+\+) (?:[ab]/)?(\S+)", re.M)


class RepoError(RuntimeError):
    """A mirror, commit or patch cannot be used; the message names which."""


def git_dir(repo: str | os.PathLike) -> str:
    """The git directory of a mirror: ``repo`` itself (bare) or ``repo/.git``."""
    for cand in (Path(repo, ".git"), Path(repo)):
        if (cand / "HEAD").is_file() and (cand / "objects").is_dir():
            return str(cand)
    raise RepoError(f"{repo} is not a git repository (no HEAD/objects in it or its .git)")


def _git(repo: str, *args: str, input: bytes | None = None) -> bytes:
    r = subprocess.run(["git", f"--git-dir={git_dir(repo)}", *args], input=input, capture_output=True,
                       timeout=300, env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"})
    if r.returncode != 0:
        raise RepoError(f"git {' '.join(args[:2])} in {repo} failed: {r.stderr.decode(errors='replace').strip()[:400]}")
    return r.stdout


def checkout(repo: str, commit: str, dest: str | os.PathLike) -> None:
    """Extract ``commit``'s tree into ``dest`` (no .git: the agent gets files, not history
    that could hold the fix)."""
    data = _git(repo, "archive", "--format=tar", commit)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")  # refuses absolute paths, .. and links out of dest


def patch_paths(patch: str) -> list[str]:
    """The files a unified diff touches (both sides), in order."""
    out = []
    for p in _DIFF_PATH.findall(patch):
        if p != "/dev/null" and p not in out:
            safe_relpath(p, "test_patch")
            out.append(p)
    return out


def patched_files(repo: str, commit: str, patch: str | None, also: list[str] = ()) -> dict[str, str]:
    """``{path: content}`` of every file ``patch`` touches and of the files ``also`` names,
    as ``commit`` has them with the patch applied (files the patch deletes, and files of
    ``also`` the commit does not have, are left out)."""
    paths = list(dict.fromkeys(patch_paths(patch or "") + [safe_relpath(p, "test id").as_posix() for p in also]))
    with tempfile.TemporaryDirectory(prefix="tg-patch-") as d:
        for p in paths:
            try:
                content = _git(repo, "show", f"{commit}:{p}")
            except RepoError:
                continue  # a file the patch creates
            Path(d, p).parent.mkdir(parents=True, exist_ok=True)
            Path(d, p).write_bytes(content)
        r = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=d, input=patch.encode(),
                           capture_output=True, timeout=60) if patch else None
        if r is not None and r.returncode != 0:
            raise RepoError(f"test_patch does not apply to {commit} of {repo}: "
                            f"{r.stderr.decode(errors='replace').strip()[:400]}")
        return {p: Path(d, p).read_text(encoding="utf-8", errors="replace") for p in paths if Path(d, p).is_file()}


def find_mirror(root: str | os.PathLike, name: str) -> str:
    """The mirror of ``owner/name`` under ``root``: ``owner__name`` (SWE-bench's spelling),
    ``owner/name``, or ``name`` with ``.git`` optional; errors list what was tried."""
    owner_repo = name.split("/", 1)[-1] if name.startswith("swesmith/") else name
    flat = owner_repo.replace("/", "__")
    cands = [flat, owner_repo, owner_repo.rsplit("/", 1)[-1]]
    cands += [c + ".git" for c in cands]
    for c in cands:
        p = Path(root, c)
        if p.is_dir():
            return c
    raise TaskFormatError(f"repo: no mirror of {name!r} under {os.path.realpath(root)} (tried {', '.join(cands)})")
