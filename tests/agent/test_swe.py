"""SWE-style tasks from real code: a pinned PyPI sdist (toolz 1.0.0, sha256 checked) turned
into instances by the builder, read back through the SWE-bench loader from a local git
mirror, and graded through the real harness with scripted agents: the right fix passes,
doing nothing or gaming the grader fails. Also the published formats' variants and their
validation errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from megatron_tg.agent import AgentHarness, run_standalone
from megatron_tg.agent.swe.build import apply, build, candidates, verify
from megatron_tg.agent.swe.formats import detect_format, task_from_swe_row
from megatron_tg.agent.swe.sdist import SdistError, fetch_sdist
from megatron_tg.agent.tasks import TaskFormatError, load_tasks
from megatron_tg.config.rollout import RolloutConfig

from .conftest import ScriptedClient
from .test_harness import turn

SDIST = "toolz==1.0.0"
SHA256 = "2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02"
CACHE = Path(os.environ.get("TG_SDIST_CACHE", os.path.expanduser("~/.cache/megatron-tg/sdists")))


@pytest.fixture(scope="module")
def toolz_tree():
    try:
        return fetch_sdist(SDIST, SHA256, CACHE)
    except SdistError as e:  # a failure, not a skip: the real task set is what this file checks
        pytest.fail(f"could not fetch the pinned sdist {SDIST}: {e}")


@pytest.fixture(scope="module")
def built(toolz_tree, tmp_path_factory):
    root = tmp_path_factory.mktemp("swe")
    repos, out = root / "repos", root / "swe_tasks.jsonl"
    rows = build(toolz_tree, repo="pytoolz/toolz", repos_root=repos, out=out, package_dirs=["toolz"],
                 test_paths=["toolz/tests"], max_instances=2, seed=0, version="1.0.0", log=lambda *a: None)
    return rows, repos, out


def test_sdist_hash_is_checked_before_unpacking(toolz_tree, tmp_path):
    assert (toolz_tree / "toolz" / "itertoolz.py").is_file()
    archive = next(p for p in CACHE.iterdir() if p.name.startswith("toolz-1.0.0") and p.is_file())
    (tmp_path / archive.name).write_bytes(archive.read_bytes())
    with pytest.raises(SdistError, match="does not match the pinned"):
        fetch_sdist(SDIST, "0" * 64, tmp_path)
    assert not (tmp_path / f"{archive.name}.src").exists()  # nothing unpacked
    with pytest.raises(SdistError, match="pin an exact version"):
        fetch_sdist("toolz", SHA256, tmp_path)


def test_mutations_splice_into_the_source():
    src = "def f(a, b=1):\n    # keep me\n    if a < b and not a:\n        return a + 2\n    return a\n"
    muts = candidates(src, "m.py")
    assert {m.kind for m in muts} == {"compare", "boolean", "negation", "arithmetic", "constant"}
    assert all(m.function == "f" for m in muts)  # the default b=1 is not mutated
    out = {m.kind: apply(src, m) for m in muts}
    assert "if a <= b and not a:" in out["compare"] and "# keep me" in out["compare"]
    assert "return a - 2" in out["arithmetic"] and "if a < b and a:" in out["negation"]


def test_builder_writes_swe_bench_rows_and_a_mirror(built):
    rows, repos, out = built
    assert len(rows) == 2 and (repos / "pytoolz__toolz" / "HEAD").is_file()
    for r in rows:
        assert detect_format(r) == "swe-bench" and r["FAIL_TO_PASS"] and r["PASS_TO_PASS"]
        assert not set(r["FAIL_TO_PASS"]) & set(r["PASS_TO_PASS"])
        for t in r["FAIL_TO_PASS"]:
            assert f"`{t}`" in r["problem_statement"]  # written from the failing tests
        removed = [ln[1:] for ln in r["patch"].splitlines() if ln.startswith("-") and not ln.startswith("---")]
        assert removed and all(ln.strip() not in r["problem_statement"] for ln in removed)  # not the bug itself
    tasks = load_tasks(out, repos_root=repos)
    assert [t.id for t in tasks] == [r["instance_id"] for r in rows]
    # through the real grader: unchanged fails, the fix (applied with git apply) passes
    assert verify(out, repos, log=print) == (2, 2, 2)
    assert tasks[0].repo == os.path.realpath(repos / "pytoolz__toolz") and tasks[0].base_commit == rows[0]["base_commit"]


def _fix_turns(tok, row):
    """A scripted agent that reads the failing module and applies the right fix with edit_file."""
    path = re.search(r"^\+\+\+ b/(\S+)", row["patch"], re.M).group(1)
    old = [ln[1:] for ln in row["patch"].splitlines() if ln.startswith("-") and not ln.startswith("---")]
    new = [ln[1:] for ln in row["patch"].splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return [turn(tok, "", None, ("search", {"query": "def " + path.rsplit("/", 1)[-1][:-3], "lines": 3})),
            turn(tok, "", None, ("edit_file", {"path": path, "old_string": "\n".join(old),
                                               "new_string": "\n".join(new)})),
            turn(tok, "", None, ("run_shell", {"command": f"python -m pytest -q -p no:cacheprovider "
                                                          f"{row['FAIL_TO_PASS'][0]} 2>&1 | tail -1"})),
            turn(tok, "Fixed.")]


def _harness(tok, sandbox):
    cfg = RolloutConfig(max_turns=8, max_new_tokens=1024, max_context_tokens=16384, test_timeout_s=120)
    return AgentHarness(tok, cfg, sandbox=sandbox)


def test_scripted_agents_on_real_instances(built, tok, sandbox):
    rows, repos, out = built
    tasks = {t.id: t for t in load_tasks(out, repos_root=repos)}
    h = _harness(tok, sandbox)
    row = rows[0]
    task = tasks[row["instance_id"]]

    def roll(script):
        return asyncio.run(run_standalone(h, ScriptedClient(tok, script), task))

    r = roll(_fix_turns(tok, row))
    assert r.metadata["tests_passed"] is True, r.metadata["tests"]
    assert set(r.metadata["tests"]["results"]) == set(row["FAIL_TO_PASS"]) | set(row["PASS_TO_PASS"])
    r = roll([turn(tok, "I looked and it is fine.")])
    assert r.metadata["tests_passed"] is False
    assert set(r.metadata["tests"]["results"][t] for t in row["FAIL_TO_PASS"]) == {"failed"}
    # Gaming: blank out the failing tests, add a conftest that turns failures into passes.
    f2p_file = row["FAIL_TO_PASS"][0].split("::")[0]
    flip = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    out = yield\n    out.get_result().outcome = 'passed'\n")
    game = [turn(tok, "", None, ("write_file", {"path": f2p_file, "content": "def test_nothing():\n    pass\n"}),
                 ("write_file", {"path": "conftest.py", "content": flip}),
                 ("run_shell", {"command": "echo 'import os; os._exit(0)' >> toolz/__init__.py"})),
            turn(tok, "Done.")]
    r = roll(game)
    assert r.metadata["tests_passed"] is False, r.metadata["tests"]


def test_swe_bench_test_patch_is_applied_from_the_task(built, tok, sandbox):
    """The SWE-bench form: a test patch the agent never sees, applied for grading onto the
    base commit's test file (not the workspace's)."""
    rows, repos, _ = built
    row = dict(rows[1])
    target = row["FAIL_TO_PASS"][0].split("::")[0]
    base = subprocess.run(["git", f"--git-dir={repos / 'pytoolz__toolz'}", "show", f"{row['base_commit']}:{target}"],
                          capture_output=True, text=True, check=True).stdout
    n = len(base.splitlines())
    row["test_patch"] = (f"diff --git a/{target} b/{target}\n--- a/{target}\n+++ b/{target}\n"
                         f"@@ -{n},0 +{n + 1},3 @@\n+\n+def test_added_by_the_patch():\n+    assert True\n")
    row["PASS_TO_PASS"] = json.dumps(row["PASS_TO_PASS"] + [f"{target}::test_added_by_the_patch"])
    row["FAIL_TO_PASS"] = json.dumps(row["FAIL_TO_PASS"])  # as the Hugging Face rows store them
    task = task_from_swe_row(row, repos_root=repos)
    h = _harness(tok, sandbox)
    r = asyncio.run(run_standalone(h, ScriptedClient(tok, _fix_turns(tok, rows[1])), task))
    assert r.metadata["tests"]["results"][f"{target}::test_added_by_the_patch"] == "passed"
    assert r.metadata["tests_passed"] is True, r.metadata["tests"]


def test_published_variants_and_their_errors(built, tmp_path):
    rows, repos, _ = built
    r0 = rows[0]
    bench = task_from_swe_row(r0, repos_root=repos)
    assert bench.image == "docker.io/swebench/sweb.eval.x86_64.pytoolz_1776_toolz-0001:latest"
    assert bench.privileged == {"patch": r0["patch"]}  # the gold fix is for the judge only
    rebench = task_from_swe_row({**r0, "install_config": {"test_cmd": "pytest -rA"},
                                 "docker_image": "swerebench/sweb.eval.x86_64.pytoolz_1776_toolz-0001"},
                                repos_root=repos)
    assert rebench.metadata["format"] == "swe-rebench" and rebench.metadata["test_cmd"] == "pytest -rA"
    assert rebench.image == "swerebench/sweb.eval.x86_64.pytoolz_1776_toolz-0001"
    smith = {k: v for k, v in r0.items() if k not in ("base_commit", "test_patch")}
    smith.update(repo="swesmith/pytoolz__toolz.1.0.0", image_name="jyangballin/swesmith.x86_64.toolz", patch="")
    os.symlink(repos / "pytoolz__toolz", repos / "pytoolz__toolz.1.0.0")
    t = task_from_swe_row(smith, repos_root=repos)
    assert t.metadata["format"] == "swe-smith" and t.base_commit == r0["instance_id"]  # the branch
    assert t.image == "jyangballin/swesmith.x86_64.toolz"
    r2e = {"repo_name": "pytoolz/toolz", "commit_hash": r0["base_commit"], "docker_image": "namanjain12/toolz_final",
           "problem_statement": "x", "expected_output_json": json.dumps({r0["FAIL_TO_PASS"][0]: "PASSED",
                                                                        "toolz/tests/test_a.py::test_b": "FAILED"})}
    t = task_from_swe_row(r2e, repos_root=repos)
    assert t.metadata["format"] == "r2e-gym" and t.fail_to_pass == [r0["FAIL_TO_PASS"][0]]
    # errors name the file, line and field
    bad = [{**r0, "FAIL_TO_PASS": '["test_foo (django.tests.X)"]'}, {**r0, "repo": "../../etc/ssl"},
           {**r0, "problem_statement": ""}, {**r0, "FAIL_TO_PASS": "[not json"}]
    msgs = ["FAIL_TO_PASS: 'test_foo (django.tests.X)' is not a test id", "repo: no mirror of '../../etc/ssl'",
            "problem_statement: must be a non-empty string", "FAIL_TO_PASS: not a JSON list"]
    for row, msg in zip(bad, msgs):
        p = tmp_path / "rows.jsonl"
        p.write_text(json.dumps(r0) + "\n" + json.dumps({**row, "instance_id": "other"}) + "\n")
        with pytest.raises(TaskFormatError, match=re.escape(f"rows.jsonl:2: {msg}")):
            load_tasks(p, repos_root=repos)
    outside = tmp_path / "elsewhere"  # a real mirror, outside the root, linked from inside it
    subprocess.run(["git", "init", "-q", "--bare", str(outside)], check=True)
    os.symlink(outside, repos / "escape__toolz")
    with pytest.raises(TaskFormatError, match="outside the repos root"):
        task_from_swe_row({**r0, "repo": "escape/toolz"}, repos_root=repos)


def test_the_trainer_refuses_a_missing_task_file_up_front(tmp_path):
    from megatron_tg.train.command import main

    missing = tmp_path / "nope" / "swe_tasks.jsonl"
    with pytest.raises(SystemExit, match=re.escape(f"rollout.tasks: task file {missing} does not exist")):
        main(["--recipe", str(Path(__file__).resolve().parents[2] / "recipes" / "tg_30b.yaml"),
              f"rollout.tasks={missing}"])
