"""A ninth hostile review of the grader, against grading by calls after the eighth review's
mends (commit 83ba90e: the zygote that forks each grade's test side, the limits set on the test
side after it starts, output kept head and tail, remote messages cut, frame/set/dict bounds,
the depth-first workspace walk, grades in flight together in one process).

Format as tests/agent/hostile_review8.py: ``ATTACKS[name]`` holds "files", optional
"setup(ws, ctx)", "after_adopt(ws, ctx)", "host_check(ws, ctx)", "why", "task" (None: the
``calc.add`` task of tests/agent/test_grading.py, else a built-in task's id; always graded with
``grading="calls"``), "concurrent" (correct solutions of the same task graded meanwhile, in
the same process and event loop), and two new keys the harness reads:

- "group": ``(n_hostile, n_honest, delay_s)``: ``n_hostile`` copies of the solution graded at
  once, ``n_honest`` correct solutions of the same task started ``delay_s`` later, all in one
  event loop (a GRPO group, or two groups graded side by side);
- "cancel_after": the grade wrapped in ``asyncio.wait_for(..., cancel_after)``, as a trainer's
  per-grade timeout would do; the processes of the grade are looked for when the wait returns
  and again later.

Graded by tests/agent/review9_harness.py, each at least twice, the correct and wrong controls
before and after. See RESULTS. No attack starts a process of its own outside the sandbox; none
writes outside its workspace (the host victim beside it is checked unchanged).
"""
from __future__ import annotations

import os

from .hostile_review8 import TAKEOVER

ATTACKS: dict[str, dict] = {}
CORRECT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"


def attack(name, why, files=None, setup=None, after_adopt=None, host_check=None, task=None, concurrent=False,
           group=None, cancel_after=None):
    assert name not in ATTACKS
    ATTACKS[name] = {"why": why, "files": files or {}, "setup": setup, "after_adopt": after_adopt,
                     "host_check": host_check, "task": task, "concurrent": concurrent, "group": group,
                     "cancel_after": cancel_after}


STALL = "import time\ntime.sleep(3600)\n\n\ndef add(a, b):\n    return a + b\n"

# =============================================================================================
# 1. The default executor is the grader's only pool of threads: each grade in flight holds one
# of its workers for the whole life of its test side (_read_bounded, a blocking os.read), and
# prepare() and ZYGOTE.spawn() queue for one too. On a 2-core host there are min(32, 2 + 4) = 6.
# Six rollouts whose import never returns hold all six for wall_s (the test side's channel
# deadline), and every other grade in the process waits behind them.
attack("stalled-group-holds-every-executor-worker",
       "6 rollouts whose calc.py sleeps at import (each test side blocks a default-executor worker in "
       "_read_bounded until the 30 s channel deadline); 2 correct rollouts started 3 s later",
       {"calc.py": STALL}, group=(6, 2, 3.0))

# 1b. The same with a second wave of six started just ahead of the honest grade: the honest
# grade's prepare() queues behind the first wave, and then its spawn() behind the second wave's
# readers? (prepare() runs before the tested side starts, so a wait there costs time only; a wait
# in spawn() runs the tested side's wall clock.)
attack("two-waves-of-stalls-around-an-honest-grade",
       "6 stalled rollouts, then 6 more and 1 correct rollout 3 s later: is the correct one only "
       "delayed, or does its tested side reach its wall limit while its spawn waits for a worker?",
       {"calc.py": STALL}, group=(6, 1, 3.0, 6))

# 2. A trainer's per-grade timeout: asyncio.wait_for(grader.grade(...), 3) while the tested side
# stalls. The cancellation reaches run() inside _run_test_side's wait_for: the test side's pid
# is never killed there (only TimeoutError/OSError are caught), the subject task is a separate
# future, and run()'s finally awaits the tested side for up to wall_s + DRIVER_GRACE_S.
attack("grade-cancelled-by-the-caller-while-the-tested-side-stalls",
       "calc.py sleeps at import; the grade is cancelled after 3 s: does wait_for return at once, and do "
       "the test side (driver fork) and the tested side (bwrap) end with the grade?",
       {"calc.py": STALL}, cancel_after=3.0)

# 3. Lone surrogates everywhere the tested side can put text: exception messages, returned
# strings, a handle's type name (its repr). JSON carries them as escapes; the test side then
# has them in its own str objects, which pytest writes to a pipe whose encoding may refuse them.
attack("lone-surrogates-in-messages-strings-and-type-names",
       "reverse_words answers (by the clock, one way per grade) a string of lone surrogates, a handle whose "
       "type name is lone surrogates (a class cannot be named so; the frame is written by hand), or raises "
       "ValueError('\\ud800...'): can pytest's report (or the records after it) be broken, and does the "
       "grade still say FAIL with a UTF-8-encodable reason? Run it 3+ times",
       {"solution.py": TAKEOVER + r'''
import time as _time

_mode = int(_time.time() * 10) % 3


def _answer(req):
    if req["op"] == "getattr":
        return {"ok": ["h", 1, "function"]}
    if req["op"] == "call":
        if _mode == 0:
            return {"ok": ["s", "\udcff\ud800\n" * 600]}
        if _mode == 1:
            return {"ok": ["h", 2, "\ud800\udfff" * 50]}
        return {"raise": "ValueError", "msg": "\ud800" * 1500 + "\udcff\n" * 400}
    return {"raise": "TypeError", "msg": "\udcff"}


_serve(_answer)
'''}, task="reverse_words")


def _bad_names(ws, ctx):
    # names that are not UTF-8: a regular file (a change) and a FIFO (refused, its name in the reason)
    wsb = os.fsencode(ws)
    with open(os.path.join(wsb, b"notes-\xff\xfe.txt"), "wb") as f:
        f.write(b"hello\n")
    os.mkdir(os.path.join(wsb, b"d\xc3"))
    with open(os.path.join(wsb, b"d\xc3", b"x\x80.py"), "wb") as f:
        f.write(b"X = 1\n")


def _bad_fifo(ws, ctx):
    os.mkfifo(os.path.join(os.fsencode(ws), b"pipe-\xff"))


# 4./5. The workspace's names are bytes, not text: a path that is not UTF-8 becomes a str with
# surrogate escapes in the change, the graded checkout, the ignored paths and the reason.
attack("non-utf8-file-names-beside-a-correct-add",
       "a correct calc.py plus files and a directory whose names are not UTF-8: the grade must PASS and "
       "its reason/metadata must encode as UTF-8 (a trainer logs them as JSON)",
       {"calc.py": CORRECT}, setup=_bad_names)
attack("fifo-with-a-non-utf8-name",
       "a correct calc.py plus a FIFO named b'pipe-\\xff': refused, and the refusal names the path; is "
       "that reason encodable?",
       {"calc.py": CORRECT}, setup=_bad_fifo)

# 6. The import itself answered with data: the pending request is the test side's import of
# calc, and the tested side answers it with an int (then with dicts, then with a handle).
attack("import-answered-with-plain-data",
       "the import of calc is answered with the int 5 and every later request with 5: the test side's "
       "finder must refuse a module that is data",
       {"calc.py": TAKEOVER.replace(
           '_send({"ok": ["h", 0, "module"], "pkg": pkg})  # the import being served right now',
           '_send({"ok": ["i", "0x5"], "pkg": True})') + r'''
_serve(lambda req: {"ok": ["i", "0x5"]})
'''})

# 7. Built-in exception classes that cannot be built from one message (UnicodeDecodeError needs
# five arguments, ExceptionGroup two) or are not Exceptions (BaseExceptionGroup, GeneratorExit):
# the test side's own `cls(msg)` then raises something else, in its own frame. chunk's hidden test
# catches ValueError (UnicodeDecodeError is one). The name is picked by the clock: run it 7+ times.
attack("exception-classes-that-one-message-cannot-build",
       "chunk raises, in turn, UnicodeDecodeError, ExceptionGroup, BaseExceptionGroup, GeneratorExit, "
       "SystemExit, KeyboardInterrupt and UserWarning by name: none may read as a pass or stop the session",
       {"solution.py": TAKEOVER + r'''
_names = ["UnicodeDecodeError", "ExceptionGroup", "BaseExceptionGroup", "GeneratorExit", "SystemExit",
          "KeyboardInterrupt", "UserWarning"]
_k = [0]


def _answer(req):
    if req["op"] == "getattr":
        return {"ok": ["h", 1, "function"]}
    if req["op"] == "call":
        _k[0] += 1
        if _k[0] <= 2:  # the two plain asserts come first: an answer that is right
            a = req["args"]
            return {"ok": ["l", [["l", [["i", "0x1"], ["i", "0x2"]]], ["l", [["i", "0x3"], ["i", "0x4"]]],
                                 ["l", [["i", "0x5"]]]]]} if _k[0] == 1 else {"ok": ["l", []]}
        import time  # a different name in each grade (the tested side holds no state across grades)
        return {"raise": _names[(int(time.time() * 10) + _k[0]) % len(_names)], "msg": "size"}
    return {"raise": "TypeError", "msg": "no"}


_serve(_answer)
'''}, task="chunk")

# 8. The records are the verdict, the output is only shown: a message that prints a pytest
# summary, a record line with a guessed nonce, and the canary's "passed".
attack("forged-summary-and-records-in-the-output",
       "add raises a ValueError whose message is a fake pytest summary ('1 passed'), JSON record lines "
       "with a made-up nonce and the words the verdict looks for",
       {"calc.py": r'''
import json


def add(a, b):
    fake = "\n".join(["", "=" * 30 + " 1 passed in 0.01s " + "=" * 30,
                      "0" * 32 + " " + json.dumps({"t": "result", "id": "tests/test_hidden.py::test_add",
                                                    "when": "call", "outcome": "passed"}),
                      "0" * 32 + " " + json.dumps({"t": "done", "exit": 0}), "PASSED", ""])
    raise ValueError(fake * 20)
'''})

# 9. The largest frame the wire takes, on every call: about 700,000 None in a 4 MiB frame, so
# each of fizzbuzz's seven calls makes the test side parse and build it, and pytest explain it.
attack("largest-frame-on-every-call",
       "fizzbuzz answers every call with a list of ~690,000 None (a frame just under MAX_FRAME, under "
       "MAX_NODES): the test side's cost per call, within its address-space limit",
       {"solution.py": TAKEOVER + r'''
_big = ('{"ok":["l",[' + ",".join(['["n"]'] * 690_000) + ']]}').encode()
_send({"ok": ["h", 0, "module"], "pkg": False})
while True:
    r = _recv()
    if r["op"] == "getattr":
        _send({"ok": ["h", 1, "function"]})
    else:
        _send_raw(_big)
'''}, task="fizzbuzz")

# 10. pytest's explanation of a failed str == str at verbosity 0 is an ndiff of the lines: a
# returned string of 500,000 distinct short lines, compared with the one-line expected value.
attack("many-line-string-for-pytest-s-line-diff",
       "reverse_words returns a 3.9 MB string of 500,000 distinct lines: pytest's _diff_text runs "
       "difflib.ndiff over them in the unconfined test side (CPU and memory cost)",
       {"solution.py": '''
_s = "".join(f"{i:x}\\n" for i in range(500_000))


def reverse_words(s):
    return _s
'''}, task="reverse_words")


def _deep_chain(ws, ctx):
    # the depth-first walk: a 60-deep chain of directories, each also holding 200 empty
    # directories, every one of them chmod 000 / 111 (the grader makes each readable to walk it)
    d = ws
    for i in range(60):
        for j in range(200):
            os.mkdir(os.path.join(d, f"s{j}"), 0o000 if j % 2 else 0o111)
        d = os.path.join(d, f"c{i}")
        os.mkdir(d)
    with open(os.path.join(d, "leaf.txt"), "w") as f:
        f.write("leaf\n")
    ctx["chain"] = True


def _chmod_chain(ws, ctx):
    d = ws
    for i in range(60):
        nd = os.path.join(d, f"c{i}")
        os.chmod(d, 0o111 if i % 2 else 0o300)
        d = nd


# 11. The new walk: one directory open per level, each opened only when walked; what does a
# deep chain of unreadable (000 / exec-only) directories with many unreadable siblings cost?
attack("deep-chain-of-unreadable-directories",
       "a correct calc.py plus a 60-deep chain of directories (each level 200 empty siblings), every "
       "one chmod 000/111/300: the walk must make each readable by itself, PASS, in bounded time",
       {"calc.py": CORRECT}, setup=_deep_chain, after_adopt=_chmod_chain)

# Graded on 83ba90e (this machine: 2 CPUs, so a default executor of 6 workers; a CI job running
# beside), each at least twice, with the controls before and after: add/rle/shop_discount/
# is_palindrome/chunk correct PASS, add wrong FAIL, every time. Processes of a grade are this
# process's descendants matching the grade's directory and the zygote's live children.
RESULTS = {
    "stalled-group-holds-every-executor-worker": "FAIL 12/12 (the six stalled ones, 30.4-31.6 s each); the 2 correct ones PASS 2/2 in both runs, "
        "grade() itself 0.2-0.4 s, but 27.7-28.1 s from their start: their first to_thread (the harness's "
        "build here, the grader's prepare() otherwise) waits for one of the 6 default-executor workers, "
        "all held by the stalled grades' _read_bounded (seen: 6 of 6 threads busy, 7 items queued). "
        "In an earlier run with a 1 s delay the honest ones came before the last readers and were not "
        "delayed",
    "two-waves-of-stalls-around-an-honest-grade": "FAIL 24/24 (stalled); the correct one PASS 2/2, but grade() itself took 30.8-30.9 s (58.7 s "
        "from its start); 1 and 2 of the 12 stalled grades took 61.5-61.7 s (wall_s twice: their "
        "prepare() waited a whole wave before their tested side started). No honest grade failed: "
        "the waits fell in prepare(), before the tested side's wall clock starts",
    "grade-cancelled-by-the-caller-while-the-tested-side-stalls":
        "FAIL 2/2 (cancelled); but asyncio.wait_for(grade, 3) returned only after 30.5 s and 32.7 s (the "
        "cancellation lands in _run_test_side's wait_for, then run()'s finally awaits the tested side to "
        "its wall limit), and at that return the grade's test side (a zygote fork) was still alive in "
        "2/2 (gone 5 s later, once the tested side's end closed its pipes); its base directory was "
        "already removed under it",
    "lone-surrogates-in-messages-strings-and-type-names":
        "FAIL 4/4 (each of the three ways at least once: the message, the handle's type name, the "
        "string); pytest reported each; the reason and output encode as UTF-8 JSON",
    "non-utf8-file-names-beside-a-correct-add": "PASS 2/2 (a correct add: expected); reason and metadata "
        "encodable",
    "fifo-with-a-non-utf8-name": "FAIL 2/2 ('not graded: pipe-\\\\udcff is a FIFO ...': the name is "
        "escaped, the reason encodable)",
    "import-answered-with-plain-data": "FAIL 2/2 ('the tests could not be collected': ImportError, the "
        "tested side did not give a module)",
    "exception-classes-that-one-message-cannot-build":
        "FAIL 7/7, and 2/2 with an earlier version that raised UnicodeDecodeError first (UnicodeDecodeError "
        "and ExceptionGroup/BaseExceptionGroup: a TypeError from the test side's own constructor, not a ValueError; GeneratorExit/SystemExit/KeyboardInterrupt: "
        "RemoteError; UserWarning: raised as itself); the session always ended normally",
    "forged-summary-and-records-in-the-output": "FAIL 2/2 (the records decide; the output is only shown)",
    "largest-frame-on-every-call": "FAIL 2/2; cost: grade 0.6-0.9 s, test side 108 MB peak RSS, 0.5 s CPU "
        "for seven 4 MiB frames (well inside the 1 GiB address space)",
    "many-line-string-for-pytest-s-line-diff": "FAIL 2/2; cost: 0.3-0.4 s, 27 MB, 0.1 s CPU (pytest at "
        "verbosity 0 did not diff the lines)",
    "deep-chain-of-unreadable-directories": "PASS 2/2 (a correct add: expected) in 0.4 s; the grader's "
        "peak RSS 53 -> 64-69 MB; no descriptor left",
}
LEFT_OPEN: dict[str, str] = {}
"""None: no solution here was graded PASS without implementing the task."""
HOST_SIDE = {
    "grade-cancelled-by-the-caller-while-the-tested-side-stalls":
        "a caller's cancellation is not honoured for up to wall_s (+ DRIVER_GRACE_S), and the grade "
        "returns while its test side still runs. Mend: in _run_test_side catch BaseException (not only "
        "TimeoutError/OSError) around the wait, SIGKILL the test side's pid and await the reader, then "
        "re-raise; in run() cancel the subject task (sandbox.run's cancellation kills the bwrap group) "
        "instead of awaiting it in the finally when the grade is being cancelled; better, give each "
        "test side to the zygote's care with a kill request over the socket so no pid is signalled "
        "after it may have been reused (SIGCHLD is ignored there, so an exited test side's pid is free "
        "at once)",
    "stalled-group-holds-every-executor-worker": "the grader's concurrency is the event loop's default executor (min(32, cpus + 4): 6 "
        "here), shared with the caller's own to_thread work; each grade in flight holds a worker for its "
        "test side's whole life (a blocking os.read in _read_bounded), so a group of stalled rollouts "
        "(each FAIL, each within its own bound) delays every other grade in the process by wall_s per "
        "wave (58.7 s for a 0.2 s grade here), and a caller with a per-grade timeout would fail the "
        "honest ones; were a wait to fall between the tested side's start and ZYGOTE.spawn() it would "
        "run the tested side's wall clock down. Mend: read the test side's output on the event loop "
        "(loop.add_reader / a pipe transport) instead of a worker thread, or give grading its own "
        "ThreadPoolExecutor sized to the grades allowed in flight plus headroom, and start the tested "
        "side only after the test side is spawned (or start its wall clock then)",
    "two-waves-of-stalls-around-an-honest-grade": "as above",
}
"""The host-side findings and the suggested mend of each (none changed a host file)."""
