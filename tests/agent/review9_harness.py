"""Grades every solution of tests/agent/hostile_review9.py, by calls, and prints the results.

Not a test module. Run from the repository root (bubblewrap needed; root or not)::

    python -m tests.agent.review9_harness [--runs N] [NAME ...]

As tests/agent/review8_harness.py (a world-writable host victim beside the workspace, the
workspace built and adopted as the policy's tool calls would leave it, the victim checked
afterwards, the correct and wrong controls graded before and after), and also:

- the processes of a grade are looked for both by the grade's directory (the tested side's
  bwrap and subject.py) and as children of the grader's zygote (each grade's test side is a
  fork of it, whose command line is the zygote's);
- the verdict's reason and metadata are checked to encode as UTF-8 JSON (reported, not raised);
- an attack's "group" ``(n, m, delay[, n2])`` grades n copies of it at once, m correct solutions
  ``delay`` s later (and n2 more copies just before them), all in the same event loop; its "cancel_after" wraps the grade in ``asyncio.wait_for``.
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

from megatron_tg.agent import grading_calls
from megatron_tg.agent.grading import Grader
from megatron_tg.agent.sandbox import Sandbox, rmtree
from megatron_tg.agent.tasks import builtin_tasks, materialize, write_files

from .conftest import FAST
from .hostile_review9 import ATTACKS, CORRECT, WRONG
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


def _test_sides() -> dict[int, str]:
    """Live children of the grader's zygote: each grade's test side (a fork, the zygote's argv)."""
    z = grading_calls.ZYGOTE.proc
    if z is None or z.poll() is not None:
        return {}
    out = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == z.pid and fields[0] != "Z":
            out[int(p)] = "test side (zygote fork)"
    return out


def _ours() -> dict[int, str]:
    """This process's descendants matching a grade's directory (other graders on the host,
    a CI job's, are not counted), and the zygote's children."""
    parent = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                parent[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue

    def mine(pid):
        for _ in range(64):
            if pid == os.getpid():
                return True
            pid = parent.get(pid, 0)
            if pid <= 1:
                return False
        return False

    return {p: c for p, c in _procs("tg-grade-").items() if mine(p)}


def _left(before: set[int]) -> dict[int, str]:
    now = {**_ours(), **_test_sides()}
    return {p: c[:120] for p, c in now.items() if p not in before}


class Watch(threading.Thread):
    """Polls /proc for the test sides (the zygote's children): peak RSS, CPU."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.peak_rss, self.cpu = threading.Event(), 0, {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def run(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self.stop.is_set():
            for pid in _test_sides():
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
    ws = tempfile.mkdtemp(prefix="tg-r9-ws-")
    materialize(task, ws)
    write_files(ws, files)
    if spec and spec.get("setup"):
        spec["setup"](ws, ctx)
    return ws


def encodable(g) -> str:
    try:
        json.dumps({"reason": g.reason, "output": g.output, **g.metadata()}, ensure_ascii=False).encode()
        return "yes"
    except Exception as e:  # noqa: BLE001 -- reported, the point of the check
        return f"NO: {type(e).__name__}: {str(e)[:120]}"


async def grade_one(grader, task, files, spec=None, ctx=None):
    ws = await asyncio.to_thread(build, task, files, spec, ctx)
    try:
        await asyncio.to_thread(grader.sandbox.adopt, ws, ws)
        if spec and spec.get("after_adopt"):
            spec["after_adopt"](ws, ctx)
        t0 = time.monotonic()
        if spec and spec.get("cancel_after"):
            before = set(_ours()) | set(_test_sides())
            try:
                g = await asyncio.wait_for(grader.grade(task, ws), spec["cancel_after"])
            except asyncio.TimeoutError:
                g = None
            ctx["cancel"] = {"returned_after_s": round(time.monotonic() - t0, 1), "left_at_return": _left(before)}
            if g is None:
                for wait in (5, 40):
                    await asyncio.sleep(wait - (0 if wait == 5 else 5))
                    ctx["cancel"][f"left_{wait}s_later"] = _left(before)
                from megatron_tg.agent.grading_verdict import GradeResult
                g = GradeResult(False, {}, "(cancelled by the caller)")
        else:
            g = await grader.grade(task, ws)
        return g, time.monotonic() - t0, ws
    finally:
        if spec and spec.get("host_check"):
            ctx["host_check"] = spec["host_check"](ws, ctx)
        await asyncio.to_thread(rmtree, ws)


async def grade_attack(grader, name: str):
    spec = ATTACKS[name]
    task = task_for(spec["task"])
    host = tempfile.mkdtemp(prefix="tg-r9-host-")
    with open(os.path.join(host, "victim"), "w") as f:
        f.write("VICTIM\n")
    os.chmod(host, 0o777)
    os.chmod(os.path.join(host, "victim"), 0o666)
    ctx = {"sandbox": grader.sandbox, "host": host}
    before = set(_ours()) | set(_test_sides())
    fds_before = len(os.listdir("/proc/self/fd"))
    watch = Watch()
    watch.start()
    side, group = [], None
    try:
        if spec.get("group"):
            n_bad, n_good, delay, *wave = spec["group"]

            async def honest_later():  # its time: from its start, the harness's own build/adopt included
                await asyncio.sleep(delay)
                t0 = time.monotonic()
                g, dt, ws = await grade_one(grader, task, correct_files(task))
                return g, dt, ws, time.monotonic() - t0

            async def hostile_later():
                await asyncio.sleep(delay - 0.05)  # a second wave, just ahead of the honest grades
                return await grade_one(grader, task, spec["files"], spec, dict(ctx))

            bad = [asyncio.ensure_future(grade_one(grader, task, spec["files"], spec, dict(ctx))) for _ in range(n_bad)]
            bad += [asyncio.ensure_future(hostile_later()) for _ in range(wave[0] if wave else 0)]
            n_bad += wave[0] if wave else 0
            good = [asyncio.ensure_future(honest_later()) for _ in range(n_good)]
            res = await asyncio.gather(*bad, *good)
            group = {"hostile": [(r[0].passed, round(r[1], 1)) for r in res[:n_bad]],
                     "honest (passed, reason, grade() s, total s)": [
                         (r[0].passed, r[0].reason[:200], round(r[1], 1), round(r[3], 1)) for r in res[n_bad:]]}
            g, dt = res[0][0], res[0][1]
        else:
            main = asyncio.ensure_future(grade_one(grader, task, spec["files"], spec, ctx))
            if spec.get("concurrent"):
                while not main.done():
                    side.append(await grade_one(grader, task, correct_files(task)))
            g, dt, _ = await main
    finally:
        watch.stop.set()
        watch.join()
    deadline = time.monotonic() + 5
    while _left(before) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    left_cmd = _left(before)
    fds_after = len(os.listdir("/proc/self/fd"))
    host_ok = sorted(os.listdir(host)) == ["victim"] and open(os.path.join(host, "victim")).read() == "VICTIM\n"
    shutil.rmtree(host, ignore_errors=True)
    r = {"passed": g.passed, "reason": ascii(g.reason[:300]), "seconds": round(dt, 1),
         "test_side_peak_rss_mb": round(watch.peak_rss / 2**20), "test_side_cpu_s": round(sum(watch.cpu.values()), 1),
         "grader_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
         "host_unchanged": host_ok, "processes_left": left_cmd, "grader_fds_before_after": [fds_before, fds_after],
         "utf8_json": encodable(g), "output_chars": len(g.output), "output_tail": ascii(g.output[-300:])}
    for k in ("host_check", "cancel"):
        if k in ctx:
            r[k] = ctx[k]
    if side:
        r["concurrent_correct"] = [(s[0].passed, s[0].reason[:160], round(s[1], 1)) for s in side]
    if group:
        r["group"] = group
    return r


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
