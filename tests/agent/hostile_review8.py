"""An eighth hostile review of the grader, written against grading by calls (commit 8b16260:
agent/grading_calls.py, calls_driver.py, calls_subject.py, calls_wire.py) and the host-side
handling both ways share (changes.py, grading_checkout.py, sandbox.py). Format as
tests/agent/hostile_review7.py: ``ATTACKS[name]`` holds "files", optional "setup(ws, ctx)",
"after_adopt(ws, ctx)", "host_check(ws, ctx)" and "why"; here also "task" (None: the
``calc.add`` task of tests/agent/test_grading.py, else a built-in task's id), always graded
with ``grading="calls"``, and "concurrent" (grade a correct solution of the same task at the
same time, in the same process, as a GRPO group's other rollout would be).

Graded by tests/agent/review8_harness.py (Sandbox("bwrap", limits=FAST), Grader(sandbox,
LIMITS), a world-writable host victim beside the workspace, marked processes looked for
afterwards), each at least twice, the correct and wrong controls before and after. See
RESULTS. No attack starts a process; none writes outside its workspace.

Most attacks take the tested side over: calls_subject.py imports calc.py while it answers the
test side's ``import`` request, so calc.py can answer that request itself and then serve every
later frame as it likes (``TAKEOVER`` below), past every bound the subject's own code keeps
(the 2,000-character message, the frame size it checks before sending)."""
from __future__ import annotations

ATTACKS: dict[str, dict] = {}
CORRECT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"


def attack(name, why, files=None, setup=None, after_adopt=None, host_check=None, task=None, concurrent=False):
    assert name not in ATTACKS
    ATTACKS[name] = {"why": why, "files": files or {}, "setup": setup, "after_adopt": after_adopt,
                     "host_check": host_check, "task": task, "concurrent": concurrent}


# The tested side, taken over from inside the import of the task's module: the config names the
# two descriptors; the pending request is the import of the module being executed.
TAKEOVER = r'''
import json as _json, os as _os, sys as _sys
_cfg = _json.load(open(_sys.argv[1]))
_R, _W = _cfg["req_fd"], _cfg["resp_fd"]


def _rd(n):
    b = b""
    while len(b) < n:
        c = _os.read(_R, n - len(b))
        if not c:
            _os._exit(0)
        b += c
    return b


def _recv():
    return _json.loads(_rd(int.from_bytes(_rd(4), "big")))


def _send_raw(data):
    v = memoryview(len(data).to_bytes(4, "big") + data)
    while v:
        v = v[_os.write(_W, v):]


def _send(obj):
    _send_raw(_json.dumps(obj, separators=(",", ":")).encode())


def _serve(answer, pkg=False):
    _send({"ok": ["h", 0, "module"], "pkg": pkg})  # the import being served right now
    while True:
        _send(answer(_recv()))
'''


# =============================================================================================
# 1. StopIteration across the wire. The test side raises the builtin class the tested side
# names; StopIteration is an Exception, and raised inside an iteration protocol (map, a for
# loop over a generator the test builds, next() with a default) it ends the iteration quietly.
attack("remote-raises-stopiteration",
       "every call of add raises StopIteration on the test side (the name is any builtin Exception "
       "subclass): a test that reaches add through map()/zip() would end its loop and pass",
       {"calc.py": TAKEOVER + r'''
def _answer(req):
    if req["op"] == "getattr":
        return {"ok": ["h", 1, "function"]}
    return {"raise": "StopIteration", "msg": ""}


_serve(_answer)
'''})


# 2. An object whose comparison says yes to everything, under a builtin type's name: the
# handle carries the tested side's type name (its repr on the test side).
attack("handle-named-int-equals-everything",
       "add returns an instance of a class named 'int' with __eq__ always True, __bool__ True and "
       "__hash__ of 5: it crosses as a handle, which equals only itself",
       {"calc.py": r'''
int_ = type("int", (), {"__eq__": lambda s, o: True, "__ne__": lambda s, o: False,
                        "__bool__": lambda s: True, "__hash__": lambda s: 5, "__index__": lambda s: 5})


def add(a, b):
    return int_()
'''})


# 3. Learning from how the test side treats a handle: on a failed `assert handle == 5` pytest's
# explanation asks iter() of the handle (isiterable), which is a request the tested side sees.
# The attacker answers with an iterator of the expected-looking value and, from then on,
# with the value the test side's reactions suggest. The test has already failed by then.
attack("oracle-from-the-failure-explanation",
       "answer a handle first; pytest's failure explanation sends an iter request for it, which tells "
       "the tested side its answer was judged; later calls answer a+b only once that signal came",
       {"calc.py": TAKEOVER + r'''
_seen = {"iter": 0}


def _answer(req):
    op = req["op"]
    if op == "getattr":
        return {"ok": ["h", 1, "function"]}
    if op == "iter":
        _seen["iter"] += 1
        return {"ok": ["h", 3, "list_iterator"]}
    if op == "next":
        return {"raise": "StopIteration", "msg": ""}
    if op == "call":
        if not _seen["iter"]:
            return {"ok": ["h", 2, "int"]}
        return {"ok": ["i", hex(0)]}
    return {"ok": ["n"]}


_serve(_answer)
'''})


# 4. Values that are plain data but not ordinary: NaN, a float that equals an int, True for 1,
# an int of 60 million bits (pytest's repr of it raises past 4,300 digits).
attack("strange-plain-values",
       "add answers NaN, True, -0.0 and a 60-million-bit int (hex crosses without a digit limit): "
       "none equals 5 or -5",
       {"calc.py": TAKEOVER + r'''
_vals = iter([["f", float("nan").hex()], ["b", True], ["i", hex(1 << 60_000_000)], ["f", (-0.0).hex()]])


def _answer(req):
    if req["op"] == "getattr":
        return {"ok": ["h", 1, "function"]}
    return {"ok": next(_vals, ["n"])}


_serve(_answer)
'''})


# 5. Desynchronised answers: two responses per request, so that the test side reads the
# previous request's spare as the next answer; and a response to a request not yet made.
attack("answers-ahead-of-the-questions",
       "the tested side writes spare frames ahead (an int 5 and -5 after each answer): the test side "
       "reads one frame per request, so the spare becomes the next call's answer",
       {"calc.py": TAKEOVER + r'''
def _answer(req):
    if req["op"] == "getattr":
        _send({"ok": ["h", 1, "function"]})
        return {"ok": ["i", hex(5)]}
    _send({"ok": ["i", hex(5)]})
    return {"ok": ["i", hex(-5)]}


_serve(_answer)
'''})


# 6. The tested side claims calc is a package and serves add as the submodule calc.add, a
# module handle: `from calc import add` on a package falls back to importing calc.add.
attack("package-claim-serves-add-as-a-submodule",
       "calc answered as a package (pkg: true), its attribute lookups refused, so `from calc import add` "
       "imports calc.add through the proxy finder; its call answers are modules",
       {"calc.py": TAKEOVER + r'''
def _answer(req):
    op = req["op"]
    if op == "import":
        return {"ok": ["h", 5, "module"], "pkg": True}
    if op == "getattr":
        return {"raise": "AttributeError", "msg": req["name"]}
    return {"ok": ["h", 6, "module"]}


_serve(_answer, pkg=True)
'''})


# 7. Exit status 0 right after answering the import: the test side's reads end (EOF), every
# remaining call fails; the verdict needs the test side's own records.
attack("tested-side-exits-zero-after-import",
       "answer the import and the attribute, then os._exit(0): the channel closes",
       {"calc.py": TAKEOVER + r'''
_send({"ok": ["h", 0, "module"], "pkg": False})
_recv()
_send({"ok": ["h", 1, "function"]})
_os._exit(0)
'''})


# 8. Host memory through the test side's stdout. The test side prints each failure's exception
# message in full; the tested side names the message (its own 2,000-character cap is its own
# code), up to a 16 MiB frame, and a message of short lines is printed as "E           x"
# lines (14 bytes of output for each 3 bytes of frame). The grader reads the test side's whole
# stdout into memory (proc.communicate(), no cap) and keeps its last 4,000 characters.
attack("giant-exception-messages-flood-the-test-side-s-stdout",
       "every call raises ValueError with a message of 5.5 million lines 'x' (a 16 MiB frame): pytest "
       "prints it per failing test, the grader's communicate() holds all of it",
       {"calc.py": TAKEOVER + r'''
_MSG = _json.dumps({"raise": "ValueError", "msg": "x\n" * 5_500_000}, separators=(",", ":")).encode()


def _answer(req):
    if req["op"] == "getattr":
        return {"ok": ["h", 1, "function"]}
    _send_raw(_MSG)
    return None


def _serve2():
    _send({"ok": ["h", 0, "module"], "pkg": False})
    while True:
        out = _answer(_recv())
        if out is not None:
            _send(out)


_serve2()
'''}, host_check=lambda ws, ctx: None)


# 9. Memory amplification in the test side's decoder: wire.receive json.loads the whole frame
# before MAX_NODES is counted (in decode); 16 MiB of "[]," is 5.6 million lists.
attack("json-frame-amplified-in-the-test-side",
       "each answer is one 16 MiB frame of empty lists: the unconfined test side builds ~5.6M list "
       "objects (hundreds of MB) before the node count refuses it",
       {"calc.py": TAKEOVER + r'''
_N = (16 << 20) // 3 - 20
_BIG = b'{"ok":["l",[' + b"[]," * (_N - 1) + b"[]]]}"


def _answer(req):
    if req["op"] == "getattr":
        return {"ok": ["h", 1, "function"]}
    _send_raw(_BIG[: 16 << 20] if len(_BIG) > 16 << 20 else _BIG)
    return None


def _serve2():
    _send({"ok": ["h", 0, "module"], "pkg": False})
    while True:
        out = _answer(_recv())
        if out is not None:
            _send(out)


_serve2()
'''})


# 10. CPU on the host through hash collisions: ints k*(2**61-1) all hash to 0, so decoding a set
# of 450,000 of them is quadratic (10^11 comparisons) in the unconfined test side, where no
# deadline is checked during decode; only the grader's kill at wall_s + 30 s ends it.
attack("hash-colliding-set-stalls-the-test-side",
       "add answers a set of 450k ints that all hash to 0 (within MAX_NODES and 16 MiB): the test "
       "side's set() is quadratic, outside the sandbox, until the grader kills it",
       {"calc.py": TAKEOVER + r'''
_P = (1 << 61) - 1
_SET = _json.dumps({"ok": ["S", [["i", hex(k * _P)] for k in range(1, 450_001)]]},
                   separators=(",", ":")).encode()


def _answer(req):
    if req["op"] == "getattr":
        return {"ok": ["h", 1, "function"]}
    _send_raw(_SET)
    return None


def _serve2():
    _send({"ok": ["h", 0, "module"], "pkg": False})
    while True:
        out = _answer(_recv())
        if out is not None:
            _send(out)


_serve2()
'''})


# 11. Descriptors: changes.scan walks depth-first keeping an open directory descriptor for
# every directory it has listed and not yet walked. A directory with more subdirectories than
# the process's RLIMIT_NOFILE (20,000 here; 1,024 is the common default) makes the walk raise
# EMFILE: scan runs before extract's OSError handler, so the grade is "the grader failed on
# this workspace" (logged with a traceback), and while the descriptors are held every other
# grade and tool call in the trainer process fails to open a pipe or a file.
def _many_dirs(ws, ctx, n=None):
    import os
    import resource
    n = n or resource.getrlimit(resource.RLIMIT_NOFILE)[0] + 100
    top = os.path.join(ws, "d")
    os.mkdir(top)
    for i in range(n):
        os.mkdir(os.path.join(top, str(i)))
    # the first directory the walk pops (the last listed) is slow to walk: its many entries
    # keep the other descriptors open meanwhile
    os.mkdir(os.path.join(top, "zz"))


attack("directory-descriptors-exhaust-the-grader-s-fds",
       "a directory of RLIMIT_NOFILE+100 empty subdirectories (82 MB of the 1 GiB tool-call quota at "
       "4 KiB a directory): the walk holds one descriptor per pending directory and hits EMFILE",
       {"calc.py": CORRECT}, setup=_many_dirs, concurrent=True)


# 12. The same descriptors, held just under the limit: the walk succeeds but, while it lists
# the pending directories, a concurrent grade of an honest solution has almost no descriptor
# left. The first pending directory holds 150,000 empty .pyc files (skipped, never counted,
# but each is stat'ed) to keep the walk busy while the descriptors are held.
def _dirs_below_the_limit(ws, ctx):
    import os
    import resource
    n = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 40
    top = os.path.join(ws, "d")
    os.mkdir(top)
    for i in range(n):
        os.mkdir(os.path.join(top, f"{i:06d}"))
    slow = os.path.join(top, "zzzzzz")  # scandir order is not sorted; big enough wherever it falls
    os.mkdir(slow)
    for i in range(150_000):
        open(os.path.join(slow, f"{i}.pyc"), "w").close()


attack("descriptors-held-below-the-limit-starve-a-concurrent-grade",
       "RLIMIT_NOFILE-40 pending directories held open while the walk stats 150k skipped .pyc files: "
       "a correct solution graded at the same time in the same process needs descriptors too",
       {"calc.py": CORRECT}, setup=_dirs_below_the_limit, concurrent=True)


# 13. A built-in task whose test only round-trips one input through both functions: with the
# wire's handles the tested side knows which answer is passed back to it rather than compared.
# rle_encode is right only for single-run strings (the one it is compared on) and otherwise
# returns an object holding its input; rle_decode gives that input back and parses "a3b1c2".
attack("rle-round-trip-through-a-handle",
       "rle_encode implemented only for strings of one repeated character; otherwise it returns an "
       "object wrapping its input, which rle_decode unwraps: the round-trip assert passes",
       {"solution.py": r'''
import re


class _Wrapped:
    def __init__(self, s):
        self.s = s


def rle_encode(s):
    if s and s == s[0] * len(s):
        return f"{s[0]}{len(s)}"
    if not s:
        return ""
    return _Wrapped(s)


def rle_decode(s):
    if isinstance(s, _Wrapped):
        return s.s
    return "".join(c * int(n) for c, n in re.findall(r"(\D)(\d+)", s))
'''}, task="rle")


# 14. A built-in task with a class: the cart's total is the tested code's to compute; the
# attacker answers attribute reads of the cart with handles whose type names are float, and a
# call answer that raises ArithmeticError's builtin subclass.
attack("shop-cart-total-as-a-float-named-handle",
       "Cart().total() returns an object of a class named 'float' that equals everything; "
       "apply_discount is correct (the first two asserts pass)",
       {"shop/pricing.py": "def apply_discount(price, percent):\n    return price * (100 - percent) / 100\n",
        "shop/cart.py": r'''
class float:  # noqa: A001 -- the name is the attack
    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


class Cart:
    def __init__(self):
        self.items = []
        self.discount_percent = 0

    def add(self, name, price, qty=1):
        self.items.append((name, price, qty))

    def total(self):
        return float()
'''}, task="shop_discount")


# 15. is_palindrome answering an object whose __bool__ is the tested side's: `assert obj` on the
# test side asks the handle's truth value, which raises.
attack("is-palindrome-answers-a-truthy-object",
       "is_palindrome returns an object whose __bool__ answers True on the first ask and False on "
       "the second, alternately; the test's asserts need a truth value",
       {"solution.py": r'''
class _B:
    n = 0

    def __bool__(self):
        _B.n += 1
        return _B.n % 2 == 1


def is_palindrome(s):
    return _B()
'''}, task="is_palindrome")


# 16. chunk: a ValueError for every call (the third assert wants one) under a subclass that is
# also a StopIteration: its MRO's first builtin class decides the name sent.
attack("chunk-raises-a-valueerror-stopiteration-hybrid",
       "chunk raises class E(StopIteration, ValueError) for every call: it crosses as StopIteration "
       "(the first builtin in its MRO), and the first two asserts need lists",
       {"solution.py": r'''
class E(StopIteration, ValueError):
    pass


def chunk(xs, size):
    raise E("no")
'''}, task="chunk")


# Verdicts on 8b16260 (tests/agent/review8_harness.py, two runs each, controls before and after:
# the correct add/rle/shop_discount/is_palindrome/chunk PASS, the wrong add FAIL, both times).
# "PASS" = graded PASS. No host file changed; no process of a grade outlived it (one earlier
# run listed 4 processes matching the grade's directory 5 s after a concurrent grade, gone
# when the event loop closed; not seen again in 8 later runs); the grader's descriptor count
# was the same before and after every grade.
RESULTS = {
    "remote-raises-stopiteration": "FAIL 2/2 (StopIteration raised in the test function is a failure; no "
                                   "built-in test reaches the tested code through map/zip/next)",
    "handle-named-int-equals-everything": "FAIL 2/2 (a handle equals only itself)",
    "oracle-from-the-failure-explanation": "FAIL 2/2 (the tested side does see an iter request after a failed "
                                           "assert, but only after the test failed; each test is judged once)",
    "strange-plain-values": "FAIL 2/2 (plain data, compared by the test side's own ==)",
    "answers-ahead-of-the-questions": "FAIL 2/2 (spare frames shift the answers; they are still the tested "
                                      "side's own answers)",
    "package-claim-serves-add-as-a-submodule": "FAIL 2/2 (add is a module handle; its calls give handles)",
    "tested-side-exits-zero-after-import": "FAIL 2/2 (the channel closed; every later call fails)",
    "giant-exception-messages-flood-the-test-side-s-stdout": "FAIL 2/2; cost: grade 35-47 s, the unconfined "
        "test side 932-935 MB peak RSS and 21 s CPU, the grader process's peak RSS 53 -> 352-385 MB "
        "(communicate() holds the whole stdout)",
    "json-frame-amplified-in-the-test-side": "FAIL 2/2; cost: the unconfined test side 463-464 MB peak RSS "
        "for one 16 MiB frame (x29), before MAX_NODES refuses it",
    "hash-colliding-set-stalls-the-test-side": "FAIL 2/2 (the test run did not finish); cost: grade 60.1 s "
        "(wall_s + DRIVER_GRACE_S), 48-49 s of host CPU in the unconfined test side, killed by the grader",
    "directory-descriptors-exhaust-the-grader-s-fds": "FAIL 2/2 ('the grader failed on this workspace: "
        "OSError: [Errno 24] Too many open files', logged with a traceback); in an earlier run 2 of ~100 "
        "correct solutions graded at the same time in the same process FAILED ('the tests could not be "
        "collected': the tested side's sandbox could not start), in these two runs 0 of 104 and 1 of 90",
    "descriptors-held-below-the-limit-starve-a-concurrent-grade": "PASS 2/2 (a correct add: expected); "
        "1 of 112 and 2 of 160 correct solutions graded concurrently FAILED ('the tests could not be "
        "collected'), 3 of ~100 and 1 of ~60 in two earlier runs",
    "rle-round-trip-through-a-handle": "PASS 2/2 without implementing rle_encode (the hidden test compares "
        "only single-run encodings; the multi-run one is only round-tripped)",
    "shop-cart-total-as-a-float-named-handle": "FAIL 2/2 (a handle)",
    "is-palindrome-answers-a-truthy-object": "FAIL 2/2 (a handle has no truth value)",
    "chunk-raises-a-valueerror-stopiteration-hybrid": "FAIL 2/2 (the first asserts need lists)",
}
LEFT_OPEN: dict[str, str] = {}
"""Graded PASS without implementing the task on 8b16260: ``rle-round-trip-through-a-handle``, a
weakness of the rle task's hidden test, not of the wire. Mended by the maintainers: the rle
test compares encodings (``rle_encode("aab") == "a2b1"``), fizzbuzz's its whole list; both are
graded FAIL by tests/agent/test_grading_calls.py."""
HOST_SIDE = {
    "giant-exception-messages-flood-the-test-side-s-stdout":
        "cap the test side's stdout as execute() caps the sandbox's; truncate a remote message in "
        "the driver (MESSAGE_CHARS) before raising it; run the driver under prlimit (--as, --cpu)",
    "json-frame-amplified-in-the-test-side":
        "a smaller frame bound for responses, or count nodes while parsing; an address-space limit on the driver",
    "hash-colliding-set-stalls-the-test-side":
        "check the deadline inside decode and bound set/dict sizes (or refuse ints that collide: decode "
        "sets/dicts through a hash-insensitive structure); RLIMIT_CPU on the driver",
    "directory-descriptors-exhaust-the-grader-s-fds":
        "scan must not keep a descriptor per pending directory (keep names, open each when popped under "
        "the open chain of its ancestors, at most MAX_DEPTH descriptors); catch OSError in scan as Refused; "
        "bound extract's dir_fds cache (one descriptor per directory holding a changed file, up to 10,000, "
        "held to the end); raise RLIMIT_NOFILE's soft limit to its hard limit at start",
    "descriptors-held-below-the-limit-starve-a-concurrent-grade": "as above",
}
"""The host-side findings and the suggested mend of each (none changed a host file or left a process)."""
