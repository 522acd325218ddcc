"""The grade: what a rollout carries (:class:`GradeResult`) and the verdict read from the
test run's records (:func:`verdict`), the same for both ways of running the tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from megatron_tg.agent.tasks import Task

OUTPUT_CHARS = 2000
SUBTEST = "subtest"  # the phase of a subtest's report: many per test, the worst kept
RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


@dataclass
class GradeResult:
    passed: bool
    tests: dict[str, str] = field(default_factory=dict)
    """Required test id -> "passed" | "failed" | "error" | "skipped" | "missing"."""
    reason: str = ""
    """Why the task did not pass (empty when it did)."""
    output: str = ""
    flags: list[str] = field(default_factory=list)
    """What the runner saw the solution tamper with (any flag fails the grade)."""
    ignored: list[str] = field(default_factory=list)
    """Paths of the policy's change not graded: test support, always from the pristine source."""

    def __post_init__(self) -> None:
        # Paths come from the policy's file names, which need not be UTF-8 (a lone surrogate
        # from os.fsdecode): escaped here, so that the grade's metadata always encodes.
        self.reason = printable(self.reason)
        self.ignored = [printable(p) for p in self.ignored]
        self.flags = [printable(f) for f in self.flags]
        self.output = printable(self.output)

    def metadata(self) -> dict[str, Any]:
        """What the rollout carries: ``tests_passed`` is what the judge's tests_pass reads."""
        counts = {k: sum(v == k for v in self.tests.values()) for k in ("passed", "failed", "error", "skipped",
                                                                         "missing")}
        return {"tests_passed": self.passed,
                "tests": {"reason": self.reason, "counts": counts, "results": self.tests,
                          "flags": self.flags[:20], "ignored": self.ignored[:50],
                          "output": self.output[-OUTPUT_CHARS:]}}


def printable(text: str) -> str:
    """``text`` with every character UTF-8 cannot encode (lone surrogates) written as its
    ``\\udcXX`` escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def verdict(task: Task, data: bytes | None, nonce: str, canaries: list, output: str,
            ignored: list[str]) -> GradeResult:
    """The grade from the runner's records (see module doc)."""
    missing = {t: "missing" for t in task.required_tests}

    def fail(reason: str, tests=None, flags=()) -> GradeResult:
        return GradeResult(False, tests or missing, reason, output, list(flags), ignored)

    if data is None:
        return fail("the test run wrote more evidence than the grader reads (or never closed it)")
    phases: dict[str, dict[str, str]] = {}
    flags, done, stopped, twice = [], False, None, None
    for line in data.decode("utf-8", "replace").splitlines():
        head, _, body = line.partition(" ")
        if head != nonce:
            return fail("the evidence holds a record the grader's runner did not write")
        try:
            rec = json.loads(body)
        except json.JSONDecodeError:
            return fail("the evidence holds a malformed record")
        # The runner writes objects with these keys; anything else was written by someone else
        # holding the nonce, and is refused like a forged record (never a grader crash).
        if type(rec) is not dict or (rec.get("t") == "result" and not all(
                type(rec.get(k)) is str for k in ("id", "when", "outcome"))):
            return fail("the evidence holds a malformed record")
        t = rec.get("t")
        if t == "flag":
            flags.append(str(rec.get("reason")))
        elif t == "result":
            # The runner writes one record per phase of a test (a subtest's each its own, as
            # "subtest"). A second record for a phase was written by whoever else holds the
            # nonce: kept, the last one would overwrite pytest's (a "passed" written after
            # the real "failed").
            ph = phases.setdefault(rec["id"], {})
            when, got = rec["when"], rec["outcome"]
            if when == SUBTEST:
                if RANK.get(got, 3) >= RANK.get(ph.get(when, "passed"), 3):
                    ph[when] = got
            elif when in ph:
                twice = twice or f"the evidence holds two records for one phase ({rec['id']} {when})"
            else:
                ph[when] = got
        elif t == "done":
            done = True
        elif t == "stopped":
            stopped = str(rec.get("reason"))

    def outcome(node: str) -> str:
        ph = phases.get(node)
        if not ph:
            return "missing"
        worst = max(ph.values(), key=lambda v: RANK.get(v, 3))
        if worst == "passed" and "call" not in ph:
            return "missing"
        return worst if worst in RANK else "error"

    results = {t: outcome(t) for t in task.required_tests}
    if flags:
        return fail(f"tampering detected: {flags[0]}", results, flags)
    if twice:
        return fail(twice, results)
    if not done:
        return fail(f"the test run did not finish ({stopped or 'stopped before its end'})", results)
    broken = sorted(n for n, ph in phases.items() if ph.get("collect") == "error")
    if broken:
        return fail(f"the tests could not be collected: {', '.join(broken[:5])}", results)
    for rel, ok, bad in canaries:
        if outcome(f"{rel}::{ok}") != "passed" or outcome(f"{rel}::{bad}") != "failed":
            return fail("the grader's canary tests did not come out as they must (the test run was tampered "
                        "with)", results)
    bad_tests = {t: v for t, v in results.items() if v != "passed"}
    if bad_tests:
        return fail(f"{len(bad_tests)} of {len(results)} required tests did not pass: "
                    + ", ".join(f"{t} ({v})" for t, v in list(bad_tests.items())[:5]), results)
    return GradeResult(True, results, "", output, [], ignored)
