"""Grading by calls (megatron_tg/agent/grading_calls.py): the tests run outside the sandbox
and reach the tested code only through calls that return plain data.

Every hostile solution of the seven independent reviews (tests/agent/hostile_review*.py and
the in-process attacks of test_grading_attacks.py) is graded again here on ``calc.add`` graded
by calls: each that does not implement ``add`` is a FAIL; the ones that do (a correct ``add``
beside a tampering attempt that, here, has nothing to act on) PASS, as they should. Then the
boundary itself: handles, exceptions, a tested side that hangs, dies or lies on the wire.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megatron_tg.agent.grading import Grader
from megatron_tg.agent.grading_calls import task_modules
from megatron_tg.agent.tasks import Task, TaskFormatError, builtin_tasks, write_files

from . import test_grading_attacks as attacks
from .hostile_review8 import ATTACKS as REVIEW8
from .hostile_review9 import ATTACKS as REVIEW9
from .test_grading import LIMITS, TASK, grade

CALLS = dataclasses.replace(TASK, grading="calls")
# Solutions of the reviews that hold a correct add (the attack was a side effect); by calls
# they pass: the reward is for add, and their tampering reaches nothing.
CORRECT_ADDS = {"r1:CORRECT", "r1:SIGNAL", "r1:CTYPES", "r1:GC_WALK", "r1:SETTRACE", "r1:HONEST",
                "r4:host-write-from-tests", "r4:non-utf8-name-in-metadata",
                "r6:live-racer-toctou-links-during-extract", "r7:pyc-files-are-not-counted-or-timed"}
# Graded on their own below or by the runner's tests (150,000 files: a bound on the change).
SKIPPED = {"r6:150k-empty-files-grading-cost", "r7:pyc-files-are-not-counted-or-timed"}


def _cases() -> dict:
    cases = {f"r1:{n}": ("files", {"calc.py": v}) for n, v in vars(attacks).items()
             if n.isupper() and isinstance(v, str) and "def add" in v}
    for n, (files, _) in attacks.REVIEW2.items():
        cases[f"r2:{n}"] = ("files", files)
    built = {"marshal-plugin": attacks.marshal_plugin, "sourceless-pyc": attacks.sourceless_pyc}
    for n, (files, _) in attacks.REVIEW2_LEFT_OPEN.items():
        cases[f"r2:{n}"] = ("built", (files, built.get(n)))
    for n, (files, _) in {**attacks.REVIEW3, **attacks.MEND_PROBES}.items():
        cases[f"r3:{n}"] = ("files", files)
    for r, review in ((4, attacks.REVIEW4), (5, attacks.REVIEW5), (6, attacks.REVIEW6), (7, attacks.REVIEW7)):
        for n, spec in review.items():
            cases[f"r{r}:{n}"] = ("spec", (r, spec))
    return {k: v for k, v in cases.items() if k not in SKIPPED}


CASES = _cases()


@pytest.fixture(scope="module")
def grader(sandbox):
    return Grader(sandbox, LIMITS)


@pytest.fixture
def calls_task(monkeypatch):
    monkeypatch.setattr(attacks, "TASK", CALLS)  # the reviews' harness grades attacks.TASK
    return CALLS


def _grade_case(grader, tmp_path, name):
    kind, val = CASES[name]
    if kind == "files":
        return grade(grader, val, task=CALLS)
    if kind == "built":
        files, build = val
        return grade(grader, files or {"calc.py": build()}, task=CALLS)
    review, spec = val
    if review == 4:
        setup = spec["setup"]
        g, host = attacks._grade_beside_a_host_victim(
            grader, tmp_path, spec["files"], b"tgrv4", host_mode=0o755,
            after_adopt=(lambda ws, host: setup(ws, grader.sandbox, str(host))) if setup else None)
        if spec["host_check"]:
            assert spec["host_check"](None, str(host)) is None
        return g
    ctx: dict = {"sandbox": grader.sandbox}

    def hook(fn):
        return (lambda ws, host: fn(ws, ctx.setdefault("host", str(host)) and ctx)) if fn else None
    g, host = attacks._grade_beside_a_host_victim(
        grader, tmp_path, spec["files"], f"tgrv{review}".encode(), host_mode=0o777,
        before_adopt=hook(spec["setup"]), after_adopt=hook(spec["after_adopt"]))
    if spec["host_check"]:
        assert spec["host_check"](None, {**ctx, "host": str(host)}) is None
    return g


@pytest.mark.parametrize("name", list(CASES))
def test_every_review_s_solution_is_graded_by_what_its_add_does(grader, calls_task, name, tmp_path):
    """FAIL unless the solution holds a correct ``add``; no host file changes, no process of
    the grade outlives it (the reviews' harness checks both)."""
    g = _grade_case(grader, tmp_path, name)
    assert g.passed is (name in CORRECT_ADDS), (name, g.reason, g.output[-2000:])
    assert g.flags == []  # nothing in-process to flag: the verdict is not where the code runs


def test_the_correct_adds_are_the_ones_named():
    assert CORRECT_ADDS - SKIPPED <= set(CASES) and len(CASES) > 120


def test_built_in_tasks_are_graded_by_calls_and_their_references_pass(grader):
    tasks = builtin_tasks()
    assert {t.grading for t in tasks} == {"calls"}
    for t in tasks:
        g = grade(grader, t.privileged["reference"], task=t)
        assert g.passed, (t.id, g.reason, g.output)
        g = grade(grader, {}, task=t)
        assert not g.passed and g.reason.startswith(f"{len(t.fail_to_pass)} of "), (t.id, g.reason)


def test_a_truthy_or_always_equal_object_is_no_answer(grader):
    palindrome = next(t for t in builtin_tasks() if t.id == "is_palindrome")
    truthy = "class _T:\n    def __bool__(self):\n        return True\n\n\ndef is_palindrome(s):\n    return _T()\n"
    g = grade(grader, {"solution.py": truthy}, task=palindrome)
    assert not g.passed and "has no truth value here" in g.output, g.output[-1500:]
    g = grade(grader, {"calc.py": attacks.ALWAYS_EQUAL}, task=CALLS)
    assert not g.passed and g.tests["tests/test_add.py::test_small"] == "failed"


def test_an_exception_arrives_as_its_builtin_class(grader):
    """``chunk`` must raise ValueError: a subclass of it counts (as ``except ValueError``
    catches it in-process); SystemExit raised by the tested code stops nothing on the test side."""
    chunk = next(t for t in builtin_tasks() if t.id == "chunk")
    ref = chunk.privileged["reference"]["solution.py"]
    sub = ("class _Bad(ValueError):\n    pass\n\n\n" + ref.replace("raise ValueError", "raise _Bad"))
    assert "raise _Bad" in sub
    g = grade(grader, {"solution.py": sub}, task=chunk)
    assert g.passed, (g.reason, g.output[-1500:])
    g = grade(grader, {"solution.py": ref.replace("raise ValueError", "raise SystemExit")}, task=chunk)
    assert not g.passed and g.tests == {"_hidden_test.py::test_hidden": "failed"}, g.reason


def test_an_object_s_methods_and_attributes_go_through_its_handle(grader):
    """shop_discount's test builds a Cart, calls its methods and sets an attribute."""
    shop = next(t for t in builtin_tasks() if t.id == "shop_discount")
    g = grade(grader, shop.privileged["reference"], task=shop)
    assert g.passed, (g.reason, g.output[-1500:])


def test_arguments_go_by_value(grader):
    """A solution that mutates its argument changes its own copy, never the test's list."""
    task = dataclasses.replace(CALLS, hidden_files={"tests/test_add.py": (
        "from calc import add\n\n\ndef test_small():\n    xs = [2, 3]\n    assert add(xs, [0]) == [2, 3, 0]\n"
        "    assert xs == [2, 3]\n\n\ndef test_negative():\n    assert add(-2, -3) == -5\n")})
    mutate = "def add(a, b):\n    if isinstance(a, list):\n        a.append(9)\n        return a[:2] + b\n    return a + b\n"
    g = grade(grader, {"calc.py": mutate}, task=task)
    assert g.passed, (g.reason, g.output[-1500:])


def test_a_tested_side_that_hangs_fails_within_the_wall_clock_limit(sandbox):
    import time

    grader = Grader(sandbox, dataclasses.replace(LIMITS, wall_s=5.0))
    t0 = time.monotonic()
    g = grade(grader, {"calc.py": "import time\n\n\ndef add(a, b):\n    time.sleep(3600)\n"}, task=CALLS)
    took = time.monotonic() - t0
    assert not g.passed and took < 5.0 + 15, (took, g.reason)


@pytest.mark.parametrize("lie", [
    "os.write(_fd, (5).to_bytes(4, 'big') + b'[1,2]')",  # a frame that is not a response
    "os.write(_fd, (9).to_bytes(4, 'big') + b'{\"ok\":5}')",  # a value of no known shape
    "os.write(_fd, (1 << 30).to_bytes(4, 'big'))",  # a frame too long
    "os.close(_fd)"])  # the channel closed
def test_a_tested_side_that_lies_on_the_wire_fails(grader, lie):
    """The tested code owns its process: it may write anything to the response pipe. What is
    not a well-formed response ends the channel and fails the tests (never a grader error)."""
    code = ("import json, os, sys\n_fd = json.load(open(sys.argv[1]))['resp_fd']\n\n\n"
            f"def add(a, b):\n    {lie}\n    return a + b\n")
    g = grade(grader, {"calc.py": code}, task=CALLS)
    assert not g.passed and g.tests["tests/test_add.py::test_small"] == "failed", (g.reason, g.output[-1500:])


def test_only_the_pristine_checkout_s_modules_are_asked_of_the_tested_side(tmp_path):
    """A module the policy adds (named like a library the test side's pytest may import) is
    never imported from the tested side: the names come from the pristine tree, and test
    support, links and non-identifiers are left out."""
    write_files(tmp_path, {"calc.py": "", "pkg/__init__.py": "", "tests/test_x.py": "", "conftest.py": "",
                           "not-a-name.py": "", "sub/deep.py": ""})
    (tmp_path / "link.py").symlink_to(tmp_path / "calc.py")
    assert task_modules(tmp_path, ["."]) == ["calc", "pkg", "sub"]
    assert task_modules(tmp_path, ["sub", "missing"]) == ["deep"]


def test_grading_is_validated_in_task_files():
    d = {"id": "t", "instruction": "x", "fail_to_pass": ["a.py::t"]}
    assert Task.from_dict(d).grading == "runner"
    assert Task.from_dict({**d, "grading": "calls"}).to_dict()["grading"] == "calls"
    with pytest.raises(TaskFormatError, match="grading: must be one of"):
        Task.from_dict({**d, "grading": "vibes"})
    json.dumps(Task.from_dict({**d, "grading": "calls"}).to_dict())


# ---------------------------------------------------------------- the eighth review, by calls
REVIEW8_CORRECT = {"directory-descriptors-exhaust-the-grader-s-fds",
                   "descriptors-held-below-the-limit-starve-a-concurrent-grade"}
"""Correct solutions beside a descriptor attack (tested with a lowered limit below)."""


@pytest.mark.parametrize("name", [n for n in REVIEW8 if n not in REVIEW8_CORRECT])
def test_the_eighth_review_s_solutions_are_graded_fail(grader, calls_task, name, tmp_path):
    """Written against grading by calls (8b16260): the tampering ones were FAIL already; the
    rle one passed on the task's weak hidden test (now it compares encodings); the costly ones
    (a 16 MiB message per call, a 16 MiB frame of empty lists, a set of colliding hashes) now
    end at the wire's bounds, within the wall-clock limit."""
    import time

    spec = REVIEW8[name]
    task = CALLS if spec["task"] is None else next(t for t in builtin_tasks() if t.id == spec["task"])
    monkey_task = attacks.TASK
    attacks.TASK = task
    try:
        ctx: dict = {"sandbox": grader.sandbox}

        def hook(fn):
            return (lambda ws, host: fn(ws, ctx.setdefault("host", str(host)) and ctx)) if fn else None
        t0 = time.monotonic()
        g, host = attacks._grade_beside_a_host_victim(
            grader, tmp_path, spec["files"], b"tgrv8", host_mode=0o777,
            before_adopt=hook(spec["setup"]), after_adopt=hook(spec["after_adopt"]))
        took = time.monotonic() - t0
    finally:
        attacks.TASK = monkey_task
    assert not g.passed, (name, g.reason, g.output[-2000:])
    assert took < grader.limits.wall_s and len(g.output) < 100_000, (took, len(g.output))


def test_more_directories_than_descriptors_are_walked_and_grades_beside_it_pass(grader, tmp_path):
    """The eighth review's EMFILE: the walk held a descriptor per pending directory, so a
    workspace with more subdirectories than the limit failed its own grade and, in the same
    process, honest grades beside it. Now the walk holds at most its depth: with the limit
    lowered to 256, a correct add beside 600 directories passes, and so do 8 grades of the
    correct add run at the same time."""
    import asyncio
    import resource
    import tempfile

    from megatron_tg.agent.sandbox import rmtree
    from megatron_tg.agent.tasks import materialize

    def workspace(extra_dirs: int) -> str:
        ws = tempfile.mkdtemp(prefix="tg-test-fds-")
        materialize(CALLS, ws)
        write_files(ws, {"calc.py": attacks.CORRECT})
        for i in range(extra_dirs):
            (tmp_path.__class__(ws) / "d" / str(i)).mkdir(parents=True)
        grader.sandbox.adopt(ws, ws)
        return ws

    spaces = [workspace(600)] + [workspace(0) for _ in range(8)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    async def all_grades():
        return await asyncio.gather(*(grader.grade(CALLS, ws) for ws in spaces))
    try:
        grades = asyncio.run(all_grades())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for ws in spaces:
            rmtree(ws)
    assert [g.passed for g in grades] == [True] * 9, [g.reason for g in grades]


def test_a_call_cannot_stop_a_loop_of_the_test_s(grader):
    """StopIteration raised by the tested code would end ``map()`` quietly (``all()`` of
    nothing is True): from a call it arrives as another exception, so the test fails."""
    task = dataclasses.replace(CALLS, hidden_files={"tests/test_add.py": (
        "from calc import add\n\n\ndef test_small():\n    assert all(map(lambda p: add(*p) == sum(p), [(2, 3), (1, 1)]))\n\n\n"
        "def test_negative():\n    assert add(-2, -3) == -5\n")})
    g = grade(grader, {"calc.py": "def add(a, b):\n    raise StopIteration\n"}, task=task)
    assert not g.passed and g.tests["tests/test_add.py::test_small"] == "failed", (g.reason, g.output[-1500:])
    g = grade(grader, {"calc.py": attacks.CORRECT}, task=task)
    assert g.passed, g.reason


def test_a_huge_message_is_cut_before_pytest_prints_it(grader):
    g = grade(grader, {"calc.py": "def add(a, b):\n    raise ValueError('x' * 3_000_000)\n"}, task=CALLS)
    assert not g.passed and len(g.output) < 10_000 and "xxxx" in g.output, len(g.output)


# ---------------------------------------------------------------- the ninth review, by calls
STALL = "import time\ntime.sleep(3600)\n\n\ndef add(a, b):\n    return a + b\n"


def _workspace(files):
    import tempfile

    from megatron_tg.agent.tasks import materialize

    ws = tempfile.mkdtemp(prefix="tg-test-r9-")
    materialize(CALLS, ws)
    write_files(ws, files)
    return ws


def test_a_cancelled_grade_leaves_no_process_running(grader):
    """The ninth review: a grade the caller cancels (``wait_for``) kept running ~30 s and its
    test side outlived the return. Now the cancel kills the test side and the sandbox before
    it returns."""
    import asyncio
    import time

    from megatron_tg.agent.sandbox import rmtree

    from .test_grading_attacks import _alive, _descendants
    ws = _workspace({"calc.py": STALL})
    grader.sandbox.adopt(ws, ws)
    before = _descendants(os.getpid())

    async def cancelled():
        task = asyncio.ensure_future(grader.grade(CALLS, ws))
        await asyncio.sleep(2.0)  # the tested side is stalled in its import by now
        grading = _descendants(os.getpid()) - before
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return grading, time.monotonic() - t0
    try:
        grading, took = asyncio.run(cancelled())
    finally:
        rmtree(ws)
    from megatron_tg.agent.grading_calls import ZYGOTE

    grading.discard(ZYGOTE.proc.pid)  # the grader's own fork server lives on, by design
    assert grading, "no process of the grade was seen"
    assert took < 5.0, took
    assert not [p for p in grading if _alive(p)], "a process of the cancelled grade is still running"


def test_stalled_grades_do_not_hold_up_honest_ones(grader):
    """The ninth review: six stalled grades held every worker of the loop's default pool (each
    grade's output read in a thread), and honest grades beside them waited ~28 s. Now the
    output is read on the loop: two correct grades started beside eight stalled ones finish
    in a few seconds, long before the stalled ones time out."""
    import asyncio
    import time

    from megatron_tg.agent.sandbox import rmtree

    stalled = [_workspace({"calc.py": STALL}) for _ in range(8)]
    honest = [_workspace({"calc.py": attacks.CORRECT}) for _ in range(2)]
    for ws in stalled + honest:
        grader.sandbox.adopt(ws, ws)

    async def group():
        slow = [asyncio.ensure_future(grader.grade(CALLS, ws)) for ws in stalled]
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        good = await asyncio.gather(*(grader.grade(CALLS, ws) for ws in honest))
        took = time.monotonic() - t0
        for t in slow:
            t.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        return good, took
    try:
        good, took = asyncio.run(group())
    finally:
        for ws in stalled + honest:
            rmtree(ws)
    assert [g.passed for g in good] == [True, True], [g.reason for g in good]
    assert took < grader.limits.wall_s / 2, took


REVIEW9_PASS = {"non-utf8-file-names-beside-a-correct-add", "deep-chain-of-unreadable-directories"}
"""Correct adds beside an attack on what carries the grade or on the walk: they pass."""
REVIEW9_GROUPS = {"stalled-group-holds-every-executor-worker", "two-waves-of-stalls-around-an-honest-grade",
                  "grade-cancelled-by-the-caller-while-the-tested-side-stalls"}
"""Tested above on their own (stalled grades beside honest ones; a cancelled grade)."""


@pytest.mark.parametrize("name", [n for n in REVIEW9 if n not in REVIEW9_GROUPS])
def test_the_ninth_review_s_solutions_are_graded_by_what_their_add_does(grader, calls_task, name, tmp_path):
    """Written against 3e80a3e's grading by calls: none passed without implementing the task.
    FAIL unless the add is correct; the reason and metadata encode, no host file changes, no
    process of the grade outlives it."""
    spec = REVIEW9[name]
    if spec["task"] is not None:  # the reviews' harness grades attacks.TASK
        attacks.TASK = next(t for t in builtin_tasks() if t.id == spec["task"])
    ctx: dict = {"sandbox": grader.sandbox}

    def hook(fn):
        return (lambda ws, host: fn(ws, ctx.setdefault("host", str(host)) and ctx)) if fn else None
    g, host = attacks._grade_beside_a_host_victim(
        grader, tmp_path, spec["files"], b"tgrv9", host_mode=0o777,
        before_adopt=hook(spec["setup"]), after_adopt=hook(spec["after_adopt"]))
    if spec["host_check"]:
        assert spec["host_check"](None, {**ctx, "host": str(host)}) is None
    assert g.passed is (name in REVIEW9_PASS), (name, g.reason, g.output[-2000:])
    json.dumps(g.metadata(), ensure_ascii=False).encode()
