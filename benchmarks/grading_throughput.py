"""Grading throughput on the built-in ``calc.add`` task: the grader before the diff-based
rewrite (commit 5508097, loaded from git into a temporary directory) against the current
one, run two ways (``grading: runner``, pytest in the sandbox under the in-process checks;
``grading: calls``, pytest outside it, the tested code reached through calls), in one run, on
the same sandbox, interleaved so that load on a shared machine hits all alike.

Both grade the correct solution (PASS) the same number of times, one at a time and
``--concurrency`` at a time; the figures are seconds per grade, grades per second, and the
CPU seconds of the sandboxed runner (``/usr/bin/time`` around it: on a loaded shared
machine the least noisy of the three).

    python benchmarks/grading_throughput.py [--rounds 8] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_tg.agent.grading import Grader  # noqa: E402
from megatron_tg.agent.sandbox import Limits, Sandbox, rmtree  # noqa: E402
from megatron_tg.agent.tasks import Task, materialize, write_files  # noqa: E402

BEFORE = "5508097"
TASK = Task(
    id="add", instruction="Implement add(a, b) in calc.py.",
    files={"calc.py": "def add(a, b):\n    raise NotImplementedError\n",
           "tests/conftest.py": "import pytest\n\n\n@pytest.fixture\ndef pair():\n    return (2, 3)\n",
           "tests/test_calc.py": "import calc\n\n\ndef test_importable():\n    assert callable(calc.add)\n"},
    hidden_files={"tests/test_add.py": "from calc import add\n\n\ndef test_small(pair):\n    assert add(*pair) == 5\n\n\n"
                                       "def test_negative():\n    assert add(-2, -3) == -5\n"},
    fail_to_pass=["tests/test_add.py::test_small", "tests/test_add.py::test_negative"],
    pass_to_pass=["tests/test_calc.py::test_importable"])
CALLS = dataclasses.replace(TASK, grading="calls")
CORRECT = "def add(a, b):\n    return a + b\n"
LIMITS = Limits(wall_s=60.0, cpu_s=60, memory_mb=1024, max_procs=32)


def old_grader_class(tmp: Path):
    """The Grader class of commit BEFORE (its grading.py and runner, from git)."""
    for name in ("grading.py", "grading_runner.py"):
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{BEFORE}:megatron_tg/agent/{name}"],
                             capture_output=True, text=True, check=True).stdout
        (tmp / ("old_grading.py" if name == "grading.py" else name)).write_text(src)
    spec = importlib.util.spec_from_file_location("old_grading", tmp / "old_grading.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_grading"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod.Grader


async def grade_many(grader, n: int, concurrency: int, task: Task = TASK) -> list[float]:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> float:
        async with sem:
            ws = tempfile.mkdtemp(prefix="tg-bench-")
            try:
                materialize(task, ws)
                write_files(ws, {"calc.py": CORRECT})
                grader.sandbox.adopt(ws, ws)
                t = time.perf_counter()
                g = await grader.grade(task, ws)
                dt = time.perf_counter() - t
                assert g.passed, g.reason
                return dt
            finally:
                rmtree(ws)

    return list(await asyncio.gather(*(one() for _ in range(n))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="grades per grader and mode (interleaved)")
    ap.add_argument("--concurrency", type=int, default=4, help="grades in flight in the concurrent mode")
    args = ap.parse_args()
    sandbox = Sandbox("bwrap", limits=LIMITS)
    runner_cpu: list[float] = []
    plain_run = sandbox.run

    async def timed_run(cmd, *a, **k):  # every grader starts its sandboxed side with "exec python"
        r = await plain_run(cmd.replace("exec python", "exec /usr/bin/time -f 'TGCPU %U %S' python", 1), *a, **k)
        m = re.search(r"TGCPU ([\d.]+) ([\d.]+)", r.output)
        if m:
            runner_cpu.append(float(m.group(1)) + float(m.group(2)))
        return r

    sandbox.run = timed_run
    names = ("before", "runner", "calls")
    with tempfile.TemporaryDirectory(prefix="tg-bench-old-") as tmp:
        graders = {"before": old_grader_class(Path(tmp))(sandbox, LIMITS), "runner": Grader(sandbox, LIMITS),
                   "calls": Grader(sandbox, LIMITS)}
        tasks = {"before": TASK, "runner": TASK, "calls": CALLS}
        for k, g in graders.items():  # warm-up: the sandbox self-test and first imports
            asyncio.run(grade_many(g, 1, 1, tasks[k]))
        seq = {k: [] for k in names}
        conc = {k: 0.0 for k in names}
        cpu = {k: [] for k in names}
        for _ in range(args.rounds):
            for k, g in graders.items():
                runner_cpu.clear()
                seq[k] += asyncio.run(grade_many(g, 1, 1, tasks[k]))
                cpu[k] += runner_cpu
        for k, g in graders.items():
            t = time.perf_counter()
            asyncio.run(grade_many(g, args.rounds, args.concurrency, tasks[k]))
            conc[k] = args.rounds / (time.perf_counter() - t)
    print(f"calc.add, correct solution; {args.rounds} grades per cell; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'':34s}{'before (' + BEFORE + ')':>18s}{'runner':>10s}{'calls':>10s}{'runner/b':>10s}{'calls/b':>10s}")

    def row(label, v, fmt):
        print(f"{label:34s}{v['before']:18{fmt}}{v['runner']:10{fmt}}{v['calls']:10{fmt}}"
              f"{v['runner'] / v['before']:10.2f}{v['calls'] / v['before']:10.2f}")
    row("median s per grade, one at a time", {k: statistics.median(v) for k, v in seq.items()}, ".3f")
    row("mean s per grade, one at a time", {k: statistics.mean(v) for k, v in seq.items()}, ".3f")
    row(f"grades/s, {args.concurrency} at a time", conc, ".2f")
    row("median sandboxed CPU s per grade", {k: statistics.median(v) for k, v in cpu.items()}, ".3f")
    med = {k: statistics.median(v) for k, v in seq.items()}
    for k in ("runner", "calls"):
        drop = 1 - min(med["before"] / med[k], conc[k] / conc["before"])
        print(f"throughput drop, {k} (worst of the two modes): {100 * drop:.0f} % (budget: 20 %)")


if __name__ == "__main__":
    main()
