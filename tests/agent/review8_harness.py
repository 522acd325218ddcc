"""Grades every solution of tests/agent/hostile_review8.py, by calls, and prints the results.

Not a test module. Run from the repository root (bubblewrap needed; root or not)::

    python -m tests.agent.review8_harness [--runs N] [NAME ...]

Each grade is done as tests/agent/test_grading_attacks.py's ``_grade_beside_a_host_victim``
does it: a host directory holding a world-writable victim file beside the workspace, the
workspace built and adopted as the policy's tool calls would leave it, then checked after the
grade (the victim unchanged, no process of the grade left: the test side's driver.py and the
tested side's subject.py are looked for by the grade's base directory). The correct and wrong
controls are graded before and after. For each grade it prints the verdict, the reason, the
wall time, the test side's peak RSS and CPU seconds (polled from /proc while the grade runs)
and the grader process's peak RSS. An attack with ``concurrent`` is graded while correct
solutions of the same task are graded in the same process and event loop (a GRPO group), and
their verdicts are printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import shutil
import tempfile
import threading
import time

from megatron_tg.agent.grading import Grader
from megatron_tg.agent.sandbox import Sandbox, rmtree
from megatron_tg.agent.tasks import builtin_tasks, materialize, write_files

from .conftest import FAST
from .hostile_review8 import ATTACKS, CORRECT, WRONG
from .test_grading import LIMITS, TASK


def task_for(name: str | None):
    if name is None:
        return dataclasses.replace(TASK, grading="calls")
    t = {t.id: t for t in builtin_tasks()}[name]
    return dataclasses.replace(t, grading="calls")


def correct_files(task) -> dict[str, str]:
    if task.id == "add":
        return {"calc.py": CORRECT}
    return dict(task.privileged["reference"])


def _procs(pattern: str) -> dict[int, str]:
    out = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if pattern in cmd:
            out[int(p)] = cmd
    return out


class Watch(threading.Thread):
    """Polls /proc for the test side (driver.py under a tg-grade- directory): peak RSS, CPU."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.peak_rss, self.cpu = threading.Event(), 0, {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def run(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self.stop.is_set():
            for pid in _procs("/driver.py"):
                try:
                    with open(f"/proc/{pid}/statm") as f:
                        self.peak_rss = max(self.peak_rss, int(f.read().split()[1]) * page)
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    self.cpu[pid] = (int(fields[11]) + int(fields[12])) / self.tick
                except (OSError, IndexError, ValueError):
                    pass
            time.sleep(0.05)


def build(task, files, spec=None, ctx=None) -> str:
    ws = tempfile.mkdtemp(prefix="tg-r8-ws-")
    materialize(task, ws)
    write_files(ws, files)
    if spec and spec.get("setup"):
        spec["setup"](ws, ctx)
    return ws


async def grade_one(grader, task, files, spec=None, ctx=None):
    ws = await asyncio.to_thread(build, task, files, spec, ctx)
    try:
        await asyncio.to_thread(grader.sandbox.adopt, ws, ws)
        if spec and spec.get("after_adopt"):
            spec["after_adopt"](ws, ctx)
        t0 = time.monotonic()
        g = await grader.grade(task, ws)
        return g, time.monotonic() - t0, ws
    finally:
        if spec and spec.get("host_check"):
            ctx["host_check"] = spec["host_check"](ws, ctx)
        await asyncio.to_thread(rmtree, ws)


async def grade_attack(grader, name: str):
    spec = ATTACKS[name]
    task = task_for(spec["task"])
    host = tempfile.mkdtemp(prefix="tg-r8-host-")
    with open(os.path.join(host, "victim"), "w") as f:
        f.write("VICTIM\n")
    os.chmod(host, 0o777)
    os.chmod(os.path.join(host, "victim"), 0o666)
    ctx = {"sandbox": grader.sandbox, "host": host}
    before = set(_procs("tg-grade-"))
    fds_before = len(os.listdir("/proc/self/fd"))
    watch = Watch()
    watch.start()
    side = []
    try:
        main = asyncio.ensure_future(grade_one(grader, task, spec["files"], spec, ctx))
        if spec.get("concurrent"):
            # honest rollouts of the same group, graded while the hostile one is read
            while not main.done():
                side.append(await grade_one(grader, task, correct_files(task)))
        g, dt, _ = await main
    finally:
        watch.stop.set()
        watch.join()
    deadline = time.monotonic() + 5
    while (left := set(_procs("tg-grade-")) - before) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    left_cmd = {p: c[:160] for p, c in _procs("tg-grade-").items() if p in left}
    fds_after = len(os.listdir("/proc/self/fd"))
    host_ok = sorted(os.listdir(host)) == ["victim"] and open(os.path.join(host, "victim")).read() == "VICTIM\n"
    shutil.rmtree(host, ignore_errors=True)
    json.dumps(g.metadata(), ensure_ascii=False).encode()
    return {"passed": g.passed, "reason": g.reason[:300], "seconds": round(dt, 1),
            "driver_peak_rss_mb": round(watch.peak_rss / 2**20), "driver_cpu_s": round(sum(watch.cpu.values()), 1),
            "grader_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "host_unchanged": host_ok, "processes_left": left_cmd, "grader_fds_before_after": [fds_before, fds_after], "host_check": ctx.get("host_check"),
            "concurrent_correct": [(s[0].passed, s[0].reason[:160], round(s[1], 1)) for s in side],
            "output_chars": len(g.output)}


async def controls(grader):
    out = {}
    for tid in (None, "rle", "shop_discount", "is_palindrome", "chunk"):
        task = task_for(tid)
        g, dt, _ = await grade_one(grader, task, correct_files(task))
        out[f"{task.id}:correct"] = (g.passed, g.reason[:120], round(dt, 1))
    task = task_for(None)
    g, dt, _ = await grade_one(grader, task, {"calc.py": WRONG})
    out["add:wrong"] = (g.passed, g.reason[:120], round(dt, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--no-controls", action="store_true")
    ap.add_argument("names", nargs="*")
    args = ap.parse_args()
    grader = Grader(Sandbox("bwrap", limits=FAST), LIMITS)
    names = args.names or list(ATTACKS)
    if not args.no_controls:
        print("controls before:", asyncio.run(controls(grader)), flush=True)
    for name in names:
        for run in range(args.runs):
            r = asyncio.run(grade_attack(grader, name))
            print(f"{name} [{run + 1}/{args.runs}]: {json.dumps(r)}", flush=True)
    if not args.no_controls:
        print("controls after:", asyncio.run(controls(grader)), flush=True)


if __name__ == "__main__":
    main()
