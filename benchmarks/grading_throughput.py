"""Grading throughput on the built-in ``calc.add`` task: the grader before the diff-based
rewrite (commit 5508097, loaded from git into a temporary directory) against the current
one, in one run, on the same sandbox, interleaved so that load on a shared machine hits
both alike.

Both grade the correct solution (PASS) the same number of times, one at a time and
``--concurrency`` at a time; the figures are seconds per grade, grades per second, and the
CPU seconds of the sandboxed runner (``/usr/bin/time`` around it: on a loaded shared
machine the least noisy of the three).

    python benchmarks/grading_throughput.py [--rounds 8] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
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


async def grade_many(grader, n: int, concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> float:
        async with sem:
            ws = tempfile.mkdtemp(prefix="tg-bench-")
            try:
                materialize(TASK, ws)
                write_files(ws, {"calc.py": CORRECT})
                grader.sandbox.adopt(ws, ws)
                t = time.perf_counter()
                g = await grader.grade(TASK, ws)
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

    async def timed_run(cmd, *a, **k):  # both graders start their runner with "exec python"
        r = await plain_run(cmd.replace("exec python", "exec /usr/bin/time -f 'TGCPU %U %S' python", 1), *a, **k)
        m = re.search(r"TGCPU ([\d.]+) ([\d.]+)", r.output)
        if m:
            runner_cpu.append(float(m.group(1)) + float(m.group(2)))
        return r

    sandbox.run = timed_run
    cpu = {}
    with tempfile.TemporaryDirectory(prefix="tg-bench-old-") as tmp:
        graders = {"before": old_grader_class(Path(tmp))(sandbox, LIMITS), "now": Grader(sandbox, LIMITS)}
        for g in graders.values():  # warm-up: the sandbox self-test and first imports
            asyncio.run(grade_many(g, 1, 1))
        seq = {k: [] for k in graders}
        conc = {k: 0.0 for k in graders}
        cpu = {k: [] for k in graders}
        for _ in range(args.rounds):
            for k, g in graders.items():
                runner_cpu.clear()
                seq[k] += asyncio.run(grade_many(g, 1, 1))
                cpu[k] += runner_cpu
        for k, g in graders.items():
            t = time.perf_counter()
            asyncio.run(grade_many(g, args.rounds, args.concurrency))
            conc[k] = args.rounds / (time.perf_counter() - t)
    print(f"calc.add, correct solution; {args.rounds} grades per cell; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'':34s}{'before (' + BEFORE + ')':>18s}{'now':>12s}{'now/before':>12s}")
    med = {k: statistics.median(v) for k, v in seq.items()}
    mean = {k: statistics.mean(v) for k, v in seq.items()}
    print(f"{'median s per grade, one at a time':34s}{med['before']:18.3f}{med['now']:12.3f}"
          f"{med['now'] / med['before']:12.2f}")
    print(f"{'mean s per grade, one at a time':34s}{mean['before']:18.3f}{mean['now']:12.3f}"
          f"{mean['now'] / mean['before']:12.2f}")
    print(f"{f'grades/s, {args.concurrency} at a time':34s}{conc['before']:18.2f}{conc['now']:12.2f}"
          f"{conc['now'] / conc['before']:12.2f}")
    c = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"{'median runner CPU s per grade':34s}{c['before']:18.3f}{c['now']:12.3f}{c['now'] / c['before']:12.2f}")
    drop = 1 - min(med["before"] / med["now"], conc["now"] / conc["before"])
    print(f"throughput drop (worst of the two modes): {100 * drop:.0f} % (budget: 20 %)")


if __name__ == "__main__":
    main()
