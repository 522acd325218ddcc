"""The agent's tools over a real workspace and sandbox; the task format and built-in tasks."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import pytest

from megatron_tg.agent.sandbox import rmtree
from megatron_tg.agent.tasks import (Task, TaskFormatError, load_tasks, materialize,
                                     write_files)
from megatron_tg.agent.tools import Tools, search_lines, terms, tool_specs


def call(tools, name, **args):
    return asyncio.run(tools.call(name, {k: str(v) for k, v in args.items()}))


@pytest.fixture
def tools(sandbox, workdir):
    write_files(workdir, {
        "pkg/pricing.py": "def apply_discount(amount, percent):\n    return amount - percent\n",
        "pkg/cart.py": "from pkg.pricing import apply_discount\n\nclass Cart:\n    def total(self):\n"
                       "        return apply_discount(self.subtotal(), self.discount_percent)\n",
        "README.md": "Discounts are applied by the cart.\n",
        "notes.txt": "\n".join(f"line {i} about nothing" for i in range(30)) + "\n",
    })
    sandbox.adopt(workdir, workdir)
    return Tools(workdir, sandbox, test_command="python -c 'import pkg.pricing; print(\"tests ok\")'",
                 search_default_lines=3, max_output_chars=2000)


def test_specs_render_through_the_chat_template(tok):
    specs = tool_specs(7)
    names = [s["function"]["name"] for s in specs]
    assert names == ["read_file", "list_dir", "write_file", "edit_file", "run_shell", "run_tests", "search"]
    search = specs[-1]["function"]["parameters"]
    assert search["required"] == ["query"] and search["properties"]["lines"]["type"] == "integer"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=specs, tokenize=False)
    assert "<name>search</name>" in text and "<name>lines</name>" in text and "(default 7)" in text


def test_file_tools(tools, workdir):
    r = call(tools, "read_file", path="pkg/pricing.py")
    assert r.ok and "def apply_discount" in r.output
    r = call(tools, "list_dir")
    assert r.ok and r.output.split() == ["README.md", "notes.txt", "pkg/"]
    r = call(tools, "write_file", path="new/dir/x.py", content="print('hi')\n")
    assert r.ok and Path(workdir, "new/dir/x.py").read_text() == "print('hi')\n"
    r = call(tools, "run_shell", command="python new/dir/x.py && echo more >> new/dir/x.py && echo ok")
    assert r.ok and "hi" in r.output  # files our tools created are writable by sandboxed commands
    r = call(tools, "edit_file", path="pkg/pricing.py", old_string="amount - percent",
             new_string="amount * (1 - percent / 100)")
    assert r.ok and "percent / 100" in Path(workdir, "pkg/pricing.py").read_text()
    r = call(tools, "edit_file", path="pkg/pricing.py", old_string="not there", new_string="x")
    assert not r.ok and "occurs 0 times" in r.output
    r = call(tools, "run_tests")
    assert r.ok and "tests ok" in r.output and r.output.startswith("exit code: 0")


def test_bad_calls_become_error_observations(tools):
    cases = [
        ("nope", {}, "unknown tool 'nope'"),
        ("read_file", {}, "missing required parameter(s) ['path']"),
        ("read_file", {"path": "a", "mode": "r"}, "unknown parameter(s) ['mode']"),
        ("search", {"query": "x", "lines": "many"}, "'lines' must be an integer"),
        ("search", {"query": "x", "lines": "0"}, "lines must be between 1 and 100"),
        ("read_file", {"path": "../../etc/passwd"}, "outside the workspace"),
        ("read_file", {"path": "/etc/passwd"}, "outside the workspace"),
        ("write_file", {"path": "../escape.txt", "content": "x"}, "outside the workspace"),
        ("read_file", {"path": "missing.py"}, "no such file"),
        ("read_file", {"path": "pkg"}, "is a directory"),
    ]
    for name, args, msg in cases:
        r = asyncio.run(tools.call(name, args))
        assert not r.ok and r.output.startswith("Error:") and msg in r.output, (name, args, r.output)


def test_symlink_planted_by_the_agent_cannot_escape(tools, workdir):
    r = call(tools, "run_shell", command="ln -s /etc/passwd leak && ln -s /etc etcdir && echo linked")
    assert r.ok, r.output
    for name, args in (("read_file", {"path": "leak"}), ("read_file", {"path": "etcdir/passwd"}),
                       ("write_file", {"path": "etcdir/evil", "content": "x"}),
                       ("edit_file", {"path": "leak", "old_string": "root", "new_string": "x"})):
        r = asyncio.run(tools.call(name, args))
        assert not r.ok and "outside the workspace" in r.output, (name, r.output)
    assert not Path("/etc/evil").exists()


def test_fifos_and_devices_never_block_the_tools(tools, workdir):
    assert call(tools, "run_shell", command="mkfifo pipe && echo made").ok
    for name, args in (("read_file", {"path": "pipe"}), ("write_file", {"path": "pipe", "content": "x"}),
                       ("edit_file", {"path": "pipe", "old_string": "a", "new_string": "b"})):
        r = asyncio.run(tools.call(name, args))
        assert not r.ok and "not a regular file" in r.output, (name, r.output)
    assert call(tools, "search", query="apply discount").ok  # skips the FIFO instead of reading it


def test_search_default_count_and_lines_argument(tools):
    r = call(tools, "search", query="apply discount")
    hits = r.output.splitlines()
    assert r.ok and len(hits) == 3  # search_default_lines
    assert hits[0].startswith("pkg/pricing.py:1:") and "def apply_discount" in hits[0]
    r = call(tools, "search", query="apply discount", lines=1)
    assert r.output.splitlines() == hits[:1]
    r = call(tools, "search", query="line nothing", lines=25)
    assert len(r.output.splitlines()) == 25
    assert call(tools, "search", query="zebra").output == "No matches for 'zebra'."


def test_terms_split_identifiers():
    assert terms("parseHTTPHeader_v2 apply_discount Carts") == [
        "parse", "http", "header", "v", "2", "parsehttpheader_v2", "apply", "discount", "apply_discount", "cart"]


def test_output_cap(tools):
    r = call(tools, "run_shell", command="python -c \"print('x' * 3000)\"")
    assert r.output.endswith("[truncated: 3014 characters in total]") and len(r.output) < 2100


def test_task_format_errors(tmp_path):
    good = {"id": "t", "instruction": "do it", "fail_to_pass": ["t_test.py::test_a"], "files": {"a.py": ""}}
    Task.from_dict(good)
    (tmp_path / "inside").mkdir()
    for bad, msg in (({**good, "files": {"../x": ""}}, "stay inside"), ({**good, "extra": 1}, "unknown field"),
                     ({**good, "id": ""}, "id: must be"), ({**good, "repo": "nope"}, "not a directory"),
                     ({**good, "files": {"/abs": ""}}, "must be relative"),
                     ({**good, "fail_to_pass": []}, "no test decides"),
                     ({**good, "fail_to_pass": ["test_a"]}, "not a test id"),
                     ({**good, "hidden_test_command": "true"}, "hidden_test_command: no longer read")):
        with pytest.raises(TaskFormatError, match=msg):
            Task.from_dict(bad, base_dir=tmp_path)
    p = tmp_path / "tasks.jsonl"
    p.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    with pytest.raises(TaskFormatError, match=r"tasks.jsonl:3: duplicate task id 't'"):
        load_tasks(p)
    with pytest.raises(TaskFormatError, match=r"task file .*missing.jsonl does not exist"):
        load_tasks(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("row, msg", [
    ({"repo": "/etc/ssl"}, "outside the repos root"),
    ({"repo": "../"}, "outside the repos root"),
    ({"repo": "link"}, "outside the repos root"),  # a link inside the root pointing out of it
    ({"files": {".": "x"}}, "must name a file"),
    ({"files": {"a/./b": "x"}}, "must name a file"),
    ({"files": {"a/": "x"}}, "must name a file"),
    ({"files": {"a": "x", "a/b": "y"}}, "'a' is a file but 'a/b' puts a file inside it"),
    ({"hidden_files": {"t/x.py": "", "t//x.py": ""}}, "must name a file"),
], ids=["absolute", "dotdot", "symlink", "dot", "dot-part", "trailing-slash", "file-and-dir", "double-slash"])
def test_task_rows_a_policy_or_a_typo_could_abuse_are_refused(tmp_path, row, msg):
    """Issue #18 probes: `repo` as any absolute path (/etc/ssl), `files: {".": ...}`,
    `{"a": ..., "a/b": ...}` silently keeping one."""
    (tmp_path / "repos").mkdir()
    (tmp_path / "repos" / "link").symlink_to("/etc")
    good = {"id": "t", "instruction": "do it", "fail_to_pass": ["t_test.py::test_a"]}
    p = tmp_path / "repos" / "tasks.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "u", **row}) + "\n")
    with pytest.raises(TaskFormatError, match=r"tasks.jsonl:2: .*" + msg.replace("(", r"\(")) as e:
        load_tasks(p, repos_root=tmp_path / "repos")
    field = next(iter(row))
    assert f"{field}:" in str(e.value) or f"{field}[" in str(e.value), e.value  # names the field
    p.write_text('{"id": "t", "id": "u", "instruction": "i", "fail_to_pass": ["a.py::b"]}\n')
    with pytest.raises(TaskFormatError, match=r"tasks.jsonl:1: duplicate key 'id'"):
        load_tasks(p)


def test_non_utf8_file_names_come_back_with_replacement_characters(tools, workdir, tok):
    """Issue #18 probe: list_dir / search handed a lone surrogate to the tokenizer."""
    import os
    bad = os.path.join(os.fsencode(workdir), b"caf\xe9_\xff.py")
    with open(bad, "wb") as f:
        f.write(b"def apply_discount_v2(): pass\n")
    os.mkdir(os.path.join(os.fsencode(workdir), b"d\xfe"))
    for r in (call(tools, "list_dir"), call(tools, "search", query="apply discount", lines=10),
              call(tools, "run_shell", command="ls"), call(tools, "read_file", path="caf\udce9_\udcff.py")):
        r.output.encode("utf-8")  # would raise on a lone surrogate
        tok(r.output)  # and so would the tokenizer
    assert "caf\ufffd_\ufffd.py" in call(tools, "list_dir").output
    assert "d\ufffd/" in call(tools, "list_dir").output
    assert "caf\ufffd_\ufffd.py:1: def apply_discount_v2" in call(tools, "search", query="apply discount v2").output


def test_repo_tasks_and_hidden_file_writes_never_follow_symlinks(tmp_path):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "m.py").write_text("X = 1\n")
    (repo / ".git").mkdir()
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"id": "r", "instruction": "i", "fail_to_pass": ["a.py::b"], "repo": "repo",
                             "files": {"src/n.py": "Y = 2\n"}}) + "\n")
    (t,) = load_tasks(p)
    ws = Path(tempfile.mkdtemp())
    try:
        materialize(t, ws)
        assert sorted(x.relative_to(ws).as_posix() for x in ws.rglob("*")) == ["src", "src/m.py", "src/n.py"]
        outside = tmp_path / "outside"
        outside.mkdir()
        (ws / "tests").symlink_to(outside)
        write_files(ws, {"tests/hidden.py": "assert True\n"})
        assert not (outside / "hidden.py").exists() and (ws / "tests" / "hidden.py").is_file()
    finally:
        rmtree(ws)


def test_search_lines_is_deterministic(tmp_path):
    (tmp_path / "a.py").write_text("alpha beta\nbeta\n")
    (tmp_path / "b.py").write_text("beta gamma\n")
    assert [(p, n) for _, p, n, _ in search_lines(tmp_path, "beta", 5)] == [("a.py", 2), ("a.py", 1), ("b.py", 1)]


def test_task_file_with_invalid_utf8_names_file_and_line(tmp_path):
    import pytest

    from megatron_tg.agent.tasks import TaskFormatError, load_tasks

    p = tmp_path / "tasks.jsonl"
    p.write_bytes(b'\n{"id": "a", "instruction": "caf\xe9", "fail_to_pass": ["t.py::t"]}\n')
    with pytest.raises(TaskFormatError, match=rf"{p}:2: not valid UTF-8 at byte 31"):
        load_tasks(p)
