"""The hidden tests served from memory (megatron_tg/agent/grading_sources.py): on disk in the
sandbox each hidden Python file is a stub, whatever reads it; pytest still runs the real
tests, whether its rewriter or the import system loads them (a hidden package, a helper, a
conftest), and a hidden file that does not compile is a collection error, as from disk."""

from __future__ import annotations

import pytest

from megatron_tg.agent.grading_sources import STUB
from megatron_tg.agent.tasks import Task

from .test_grading import CORRECT, TASK, WRONG, grade, grader  # noqa: F401  (the fixture)

# A hidden package: its __init__ and a helper are loaded by the import system, not pytest's
# rewriter; the hidden conftest and the test module by the rewriter.
PACKAGE_TASK = Task(
    id="add-hidden-package", instruction="Implement add(a, b) in calc.py.",
    files={"calc.py": "def add(a, b):\n    raise NotImplementedError\n"},
    hidden_files={"hidden/__init__.py": "WANT = {(2, 3): 5}\n",
                  "hidden/helpers.py": "from hidden import WANT\n\n\ndef check(add):\n"
                                       "    return all(add(*k) == v for k, v in WANT.items())\n",
                  "hidden/conftest.py": "import pytest\n\n\n@pytest.fixture\ndef neg():\n    return (-2, -3)\n",
                  "hidden/test_pkg.py": "from calc import add\nfrom hidden.helpers import check\n\n\n"
                                        "def test_table():\n    assert check(add)\n\n\n"
                                        "def test_neg(neg):\n    assert add(*neg) == -5\n"},
    fail_to_pass=["hidden/test_pkg.py::test_table", "hidden/test_pkg.py::test_neg"])


def test_hidden_packages_helpers_and_conftests_are_served(grader):
    g = grade(grader, {"calc.py": CORRECT}, task=PACKAGE_TASK)
    assert g.passed, (g.reason, g.flags, g.output[-2000:])
    g = grade(grader, {"calc.py": WRONG}, task=PACKAGE_TASK)
    assert not g.passed and set(g.tests.values()) == {"failed"}, (g.reason, g.output[-2000:])


def test_on_disk_each_hidden_test_is_a_stub(grader):
    """The test reads its own file (and its sibling) from disk inside the sandbox: only the
    stub is there; its own code, served from memory, runs. So any route from the tested code
    to the disk (open, a directory descriptor, a link, a callback or finalizer made of C
    callables that no check attributes, a child process) reads the stub: the fifth review's
    ``finalizer-opens-hidden-test`` is graded FAIL since (test_grading_attacks.py)."""
    probe = ("import os\n\n\ndef test_disk():\n    d = os.path.dirname(os.path.abspath(__file__))\n"
             "    for name in ('test_disk.py', 'test_other.py'):\n"
             "        with open(os.path.join(d, name)) as f:\n"
             f"            assert f.read() == {STUB!r}\n")
    task = Task(id="disk", instruction="-", files={"calc.py": CORRECT},
                hidden_files={"tests/test_disk.py": probe, "tests/test_other.py": "def test_other():\n    pass\n"},
                fail_to_pass=["tests/test_disk.py::test_disk", "tests/test_other.py::test_other"])
    g = grade(grader, {}, task=task)
    assert g.passed, (g.reason, g.flags, g.output[-2000:])


@pytest.mark.parametrize("bad", ["def test_x(:\n    pass\n", "from calc import add\nraise ImportError('no')\n"])
def test_a_hidden_test_that_does_not_load_is_a_collection_error(grader, bad):
    task = Task(id="bad", instruction="-", files={"calc.py": CORRECT}, hidden_files={"tests/test_bad.py": bad},
                fail_to_pass=["tests/test_bad.py::test_x"])
    g = grade(grader, {}, task=task)
    assert not g.passed and g.reason.startswith("the tests could not be collected: tests/test_bad.py"), g.reason


def test_a_hidden_test_larger_than_a_pipe_holds_is_served(grader):
    """The sources are written to the key pipe while the runner reads them."""
    body = f"DATA = {'x' * (1 << 18)!r}\n\n\ndef test_big():\n    assert len(DATA) == {1 << 18}\n"
    task = Task(id="big", instruction="-", files={"calc.py": CORRECT}, hidden_files={"tests/test_big.py": body},
                fail_to_pass=["tests/test_big.py::test_big"])
    g = grade(grader, {}, task=task)
    assert g.passed, (g.reason, g.flags, g.output[-2000:])
