"""Turning a real Python package's source tree and test suite into SWE-style instances.

For each function of the package (tests, setup scripts and version files excluded), in a
seeded order, one mutation is tried at a time — a comparison flipped (``<`` / ``<=``,
``==`` / ``!=``, ``in`` / ``not in``, ...), ``+`` / ``-`` swapped, ``and`` / ``or`` swapped, a
``not`` dropped, a small integer constant changed — spliced into the source text (the rest
of the file keeps its formatting). The package's own test suite then runs on the mutant:

* FAIL_TO_PASS = the tests that passed on the original tree and fail on the mutant;
* PASS_TO_PASS = the other tests of the same test files, which pass on both;
* a mutant that breaks nothing (an equivalent mutation), breaks more than
  ``max_fail_to_pass`` tests (an import-time break, not a bug to find) or breaks collection is
  skipped, and at most one instance is kept per function.

Each kept mutant becomes a commit on top of the original tree in a bare git mirror, and a
row in the SWE-bench format (``instance_id``, ``repo``, ``base_commit`` = the buggy commit,
``problem_statement``, ``test_patch`` = "" (the tests are unchanged; the grader restores them
from the base commit), ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``patch`` = the fix). The problem
statement is written from the failing tests: their ids and pytest's failure messages, the
module they exercise, never the mutated line.

The package's own tests run here without the sandbox: this is the maintainers' code at a
pinned, hash-checked version, not a policy's.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_SKIP_FILES = ("setup.py", "versioneer.py", "_version.py", "conftest.py")
_GIT_ENV = {"GIT_AUTHOR_NAME": "swe-builder", "GIT_AUTHOR_EMAIL": "swe-builder@localhost",
            "GIT_COMMITTER_NAME": "swe-builder", "GIT_COMMITTER_EMAIL": "swe-builder@localhost",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
            "GIT_CONFIG_NOSYSTEM": "1"}


@dataclass(frozen=True)
class Mutation:
    path: str
    function: str
    kind: str
    lineno: int
    col: int
    end_lineno: int
    end_col: int
    replacement: str


def _mutants_of(node: ast.AST) -> list[tuple[str, ast.AST]]:
    import copy

    out = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
        m = copy.deepcopy(node)
        m.ops = [_FLIP[type(node.ops[0])]()]
        out.append(("compare", m))
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        m = copy.deepcopy(node)
        m.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        out.append(("arithmetic", m))
    elif isinstance(node, ast.BoolOp):
        m = copy.deepcopy(node)
        m.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        out.append(("boolean", m))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("negation", node.operand))
    elif (isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 2):
        out.append(("constant", ast.Constant(node.value + 1)))
    return out


def candidates(source: str, path: str) -> list[Mutation]:
    """Every single mutation of every function in ``source`` (in source order)."""
    tree = ast.parse(source)
    out: list[Mutation] = []

    def visit(scope: list[str], body: list[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = ".".join(scope + [st.name])
                for node in ast.walk(st):
                    if node is st or getattr(node, "end_lineno", None) is None:
                        continue
                    if isinstance(node, ast.Constant) and node in {d for a in ast.walk(st.args)
                                                                   for d in ast.iter_child_nodes(a)}:
                        continue  # default values: rarely what a test pins down
                    for kind, new in _mutants_of(node):
                        out.append(Mutation(path, name, kind, node.lineno, node.col_offset, node.end_lineno,
                                            node.end_col_offset, ast.unparse(new)))
            elif isinstance(st, ast.ClassDef):
                visit(scope + [st.name], st.body)

    visit([], tree.body)
    return out


def apply(source: str, m: Mutation) -> str:
    lines = source.splitlines(keepends=True)
    # ast columns are UTF-8 byte offsets
    head = "".join(lines[: m.lineno - 1]) + lines[m.lineno - 1].encode()[: m.col].decode()
    tail = lines[m.end_lineno - 1].encode()[m.end_col:].decode() + "".join(lines[m.end_lineno:])
    return head + m.replacement + tail


def junit_key(node_id: str) -> tuple[str, str]:
    """(classname, name) under which pytest's junitxml reports ``node_id`` (what pytest's
    ``mangle_test_address`` computes, without importing pytest's internals here)."""
    path, bracket, params = node_id.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def run_suite(tree: Path, test_paths: list[str], timeout_s: float = 300) -> dict[str, tuple[str, str]]:
    """{node id: (outcome, failure message)} of the package's tests on ``tree``."""
    with tempfile.TemporaryDirectory(prefix="tg-suite-") as d:
        ini, report = Path(d, "pytest.ini"), Path(d, "junit.xml")
        ini.write_text("[pytest]\naddopts =\njunit_family = xunit1\n")
        base = [sys.executable, "-B", "-m", "pytest", "-c", str(ini), f"--rootdir={tree}", "-p", "no:cacheprovider",
                "-q", *test_paths]
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTHONPATH", None)
        ids = subprocess.run(base + ["--collect-only"], cwd=tree, env=env, capture_output=True, text=True,
                             timeout=timeout_s).stdout
        node_ids = [ln.strip() for ln in ids.splitlines() if "::" in ln]
        subprocess.run(base + [f"--junitxml={report}"], cwd=tree, env=env, capture_output=True, timeout=timeout_s)
        if not report.is_file():
            return {}
        by_key = {junit_key(n): n for n in node_ids}
        out: dict[str, tuple[str, str]] = {}
        for tc in ET.parse(report).getroot().iter("testcase"):
            node = by_key.get((tc.get("classname", ""), tc.get("name", "")))
            if node is None:
                continue
            bad = [c for c in tc if c.tag in ("failure", "error")]
            skipped = any(c.tag == "skipped" for c in tc)
            outcome = "failed" if bad else "skipped" if skipped else "passed"
            if node not in out or outcome == "failed":
                out[node] = (outcome, (bad[0].get("message") or "").strip() if bad else "")
        return out


def _git(git_dir: Path, *args: str, env: dict | None = None, input: bytes | None = None) -> str:
    env = {**os.environ, **_GIT_ENV, **(env or {})}
    r = subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, input=input, env=env,
                       cwd=env.get("GIT_WORK_TREE"), timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"git {args[0]} failed: {r.stderr.decode(errors='replace')[:400]}")
    out = r.stdout.decode()
    return out if args[0] == "diff" else out.strip()  # a diff needs its last newline


def problem_statement(module: str, failures: dict[str, str], max_chars: int = 4000) -> str:
    lines = [f"Something is wrong in `{module}`: these tests of the package's own test suite fail.", ""]
    for test, msg in failures.items():
        first = "\n".join(msg.splitlines()[:6])[:600]
        lines.append(f"- `{test}`" + (f":\n  ```\n  {first.replace(chr(10), chr(10) + '  ')}\n  ```" if first else ""))
    lines += ["", "Find the cause in the package's code and fix it so that these tests pass and the rest of "
              "the test suite keeps passing. Do not change the tests."]
    return "\n".join(lines)[:max_chars]


def build(tree: str | os.PathLike, *, repo: str, repos_root: str | os.PathLike, out: str | os.PathLike,
          package_dirs: list[str], test_paths: list[str], max_instances: int = 20, seed: int = 0,
          max_fail_to_pass: int = 20, version: str | None = None, log=print) -> list[dict]:
    """Build instances from the source ``tree``; writes the mirror (``repos_root/<owner__name>``)
    and the JSONL ``out``; returns the rows."""
    tree = Path(tree).resolve()
    baseline = run_suite(tree, test_paths)
    passing = {t for t, (o, _) in baseline.items() if o == "passed"}
    if not passing:
        raise RuntimeError(f"no test of {test_paths} passes on the original tree {tree}")
    log(f"baseline: {len(passing)} of {len(baseline)} tests pass")
    mirror = Path(repos_root, repo.replace("/", "__")).resolve()  # git runs in the tree: no relative paths
    if mirror.exists():
        shutil.rmtree(mirror)
    mirror.mkdir(parents=True)
    _git(mirror, "init", "--bare", "-q")
    work = Path(tempfile.mkdtemp(prefix="tg-build-"))
    index = {"GIT_INDEX_FILE": str(work / "index"), "GIT_WORK_TREE": str(tree)}
    try:
        _git(mirror, "add", "-A", "--", ".", ":!*.egg-info", ":!**/__pycache__", env=index)
        base_tree = _git(mirror, "write-tree", env=index)
        base = _git(mirror, "commit-tree", base_tree, "-m", f"{repo} {version or ''}".strip(), env=index)
        _git(mirror, "update-ref", "refs/heads/main", base)
        muts: list[Mutation] = []
        for d in package_dirs:
            for p in sorted(Path(tree, d).rglob("*.py")):
                rel = p.relative_to(tree).as_posix()
                if p.name in _SKIP_FILES or "tests" in p.relative_to(tree).parts or p.name.startswith("test_"):
                    continue
                muts += candidates(p.read_text(encoding="utf-8"), rel)
        random.Random(seed).shuffle(muts)
        rows, used = [], set()
        scratch = work / "tree"
        shutil.copytree(tree, scratch, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        for m in muts:
            if len(rows) >= max_instances:
                break
            if (m.path, m.function) in used:
                continue
            original = (tree / m.path).read_text(encoding="utf-8")
            mutated = apply(original, m)
            try:
                ast.parse(mutated)
            except SyntaxError:
                continue
            (scratch / m.path).write_text(mutated, encoding="utf-8")
            try:
                res = run_suite(scratch, test_paths)
            finally:
                (scratch / m.path).write_text(original, encoding="utf-8")
            f2p = sorted(t for t in passing if res.get(t, ("missing", ""))[0] != "passed")
            if not f2p or len(f2p) > max_fail_to_pass or not res:
                continue
            files = {t.split("::", 1)[0] for t in f2p}
            p2p = sorted(t for t in passing - set(f2p) if t.split("::", 1)[0] in files
                         and res.get(t, ("missing",))[0] == "passed")
            used.add((m.path, m.function))
            blob = _git(mirror, "hash-object", "-w", "--stdin", input=mutated.encode())
            _git(mirror, "read-tree", base_tree, env=index)
            _git(mirror, "update-index", "--cacheinfo", f"100644,{blob},{m.path}", env=index)
            bug = _git(mirror, "commit-tree", _git(mirror, "write-tree", env=index), "-p", base,
                       "-m", f"mutant {m.kind} in {m.function}", env=index)
            iid = f"{repo.replace('/', '__')}-{len(rows) + 1:04d}"
            _git(mirror, "update-ref", f"refs/heads/{iid}", bug)
            module = m.path[:-3].replace("/", ".")
            rows.append({
                "instance_id": iid, "repo": repo, "base_commit": bug,
                "problem_statement": problem_statement(module, {t: res[t][1] for t in f2p}),
                "test_patch": "", "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
                "patch": _git(mirror, "diff", bug, base), "version": version,
                "created_at": "builder", "hints_text": ""})
            log(f"{iid}: {m.kind} in {m.path}:{m.function} -> {len(f2p)} FAIL_TO_PASS, {len(p2p)} PASS_TO_PASS")
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def verify(out: str | os.PathLike, repos_root: str | os.PathLike, log=print) -> tuple[int, int, int]:
    """Grade every instance of ``out`` twice through the real grader in a bwrap sandbox: the
    unchanged workspace (must fail) and the workspace with the instance's fix applied (must
    pass). Returns (instances, unchanged failing, fixed passing)."""
    import asyncio

    from megatron_tg.agent.grading import Grader
    from megatron_tg.agent.proc import Limits
    from megatron_tg.agent.sandbox import Sandbox, rmtree
    from megatron_tg.agent.tasks import load_tasks, materialize

    tasks = load_tasks(out, repos_root=repos_root)
    fixes = {json.loads(ln)["instance_id"]: json.loads(ln)["patch"] for ln in open(out, encoding="utf-8") if ln.strip()}
    sandbox = Sandbox("bwrap")
    grader = Grader(sandbox, Limits(wall_s=300, cpu_s=300, memory_mb=4096, max_procs=64))
    failing = passing = 0
    for t in tasks:
        for fixed in (False, True):
            ws = tempfile.mkdtemp(prefix="tg-verify-")
            try:
                materialize(t, ws)
                if fixed:
                    subprocess.run(["git", "apply", "-"], cwd=ws, input=fixes[t.id].encode(), check=True,
                                   capture_output=True)
                sandbox.adopt(ws, ws)
                g = asyncio.run(grader.grade(t, ws))
            finally:
                rmtree(ws)
            if fixed:
                passing += g.passed
            else:
                failing += not g.passed
            if g.passed != fixed:
                log(f"{t.id}: {'fixed' if fixed else 'unchanged'} graded {'pass' if g.passed else 'fail'}: {g.reason}")
    log(f"verified {len(tasks)} instances: unchanged fails {failing}/{len(tasks)}, fixed passes {passing}/{len(tasks)}")
    return len(tasks), failing, passing


def main(argv: list[str] | None = None) -> int:
    import argparse

    from megatron_tg.agent.swe.sdist import fetch_sdist

    ap = argparse.ArgumentParser(prog="python tools/build_swe_tasks.py", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--sdist", help="a pinned PyPI requirement NAME==VERSION (needs --sha256)")
    src.add_argument("--tree", help="a source tree already on disk")
    ap.add_argument("--sha256", help="sha256 of the sdist archive")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/megatron-tg/sdists"))
    ap.add_argument("--repo", required=True, help="owner/name the instances name as their repo")
    ap.add_argument("--package", action="append", required=True, help="package directory to mutate (repeatable)")
    ap.add_argument("--tests", action="append", required=True, help="test path given to pytest (repeatable)")
    ap.add_argument("--repos-root", required=True, help="where the git mirror is written (rollout.repos_root)")
    ap.add_argument("--out", required=True, help="the JSONL to write (rollout.tasks)")
    ap.add_argument("--max-instances", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify", action="store_true", help="then grade every instance unchanged and fixed "
                    "through the real grader (needs bubblewrap)")
    a = ap.parse_args(argv)
    if a.sdist and not a.sha256:
        ap.error("--sdist needs --sha256 (the archive is checked before it is unpacked)")
    tree = fetch_sdist(a.sdist, a.sha256, a.cache) if a.sdist else Path(a.tree)
    version = a.sdist.split("==", 1)[1] if a.sdist else None
    rows = build(tree, repo=a.repo, repos_root=a.repos_root, out=a.out, package_dirs=a.package, test_paths=a.tests,
                 max_instances=a.max_instances, seed=a.seed, version=version)
    print(f"wrote {len(rows)} instances to {a.out}; mirror under {a.repos_root}")
    if a.verify and rows:
        n, failing, passing = verify(a.out, a.repos_root)
        return 0 if failing == passing == n else 1
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
