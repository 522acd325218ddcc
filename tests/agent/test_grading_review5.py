"""The mends made because of the fifth hostile review (tests/agent/hostile_review5.py), each
with the honest code of its class: what the mend must keep passing."""

from __future__ import annotations

import pytest

from megatron_tg.agent.grading import verdict
from megatron_tg.agent.tasks import Task

from .test_grading import CORRECT, TASK, grade, grader  # noqa: F401  (the fixture)

NONCE = "n" * 32


def _records(*recs: str) -> bytes:
    return "".join(f"{NONCE} {r}\n" for r in recs).encode()


def _passing_run(task: Task = TASK) -> list[str]:
    return [f'{{"t": "result", "id": "{t}", "when": "{w}", "outcome": "passed"}}'
            for t in task.required_tests for w in ("setup", "call", "teardown")]


def test_a_second_record_for_a_phase_is_a_fail():
    """The verdict kept the last record of each phase, so a "passed" written after pytest's
    "failed" (by code that found the runner's writer) won; the runner writes one per phase."""
    done = '{"t": "done", "exit": 0}'
    assert verdict(TASK, _records(*_passing_run(), done), NONCE, [], "", []).passed
    late = '{"t": "result", "id": "tests/test_add.py::test_small", "when": "call", "outcome": "passed"}'
    recs = _passing_run()
    recs[1] = recs[1].replace('"passed"', '"failed"')
    g = verdict(TASK, _records(*recs, late, done), NONCE, [], "", [])
    assert not g.passed and g.reason == ("the evidence holds two records for one phase "
                                         "(tests/test_add.py::test_small call)"), g.reason


def test_subtest_records_are_many_and_the_worst_counts():
    sub = '{{"t": "result", "id": "tests/test_add.py::test_small", "when": "subtest", "outcome": "{}"}}'
    done = '{"t": "done", "exit": 0}'
    assert verdict(TASK, _records(*_passing_run(), sub.format("passed"), sub.format("passed"), done),
                   NONCE, [], "", []).passed
    g = verdict(TASK, _records(*_passing_run(), sub.format("failed"), sub.format("passed"), done), NONCE, [], "", [])
    assert not g.passed and g.tests["tests/test_add.py::test_small"] == "failed", g.reason


SUBTESTS = ("import unittest\n\nfrom calc import add\n\n\n"
            "def test_many(subtests):\n    for a in range(3):\n        with subtests.test(a=a):\n"
            "            assert add(a, 1) == a + 1\n\n\n"
            "class TestCase(unittest.TestCase):\n    def test_sub(self):\n        for a in range(3):\n"
            "            with self.subTest(a=a):\n                self.assertEqual(add(a, 2), a + 2)\n")
SUB_TASK = Task(id="add-subtests", instruction="-", files={"calc.py": "def add(a, b):\n    raise NotImplementedError\n"},
                hidden_files={"tests/test_sub.py": SUBTESTS},
                fail_to_pass=["tests/test_sub.py::test_many", "tests/test_sub.py::TestCase::test_sub"])


@pytest.mark.parametrize("solution, passes", [(CORRECT, True), ("def add(a, b):\n    return a + b if a != 1 else 0\n",
                                                                 False)], ids=["correct", "one-subtest-wrong"])
def test_tests_with_subtests_are_graded_by_their_worst_subtest(grader, solution, passes):
    """Each subtest is reported for the same test (many records of one phase), through
    pytest's ``subtests`` fixture and unittest's ``subTest``: recorded as "subtest"."""
    g = grade(grader, {"calc.py": solution}, task=SUB_TASK)
    assert g.passed is passes, (g.reason, g.flags, g.output[-2000:])
    if not passes:
        assert set(g.tests.values()) == {"failed"}, g.tests
