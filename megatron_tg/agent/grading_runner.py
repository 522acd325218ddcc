"""The grader's pytest entry point, run *inside* the grading sandbox as
``python -I -B run.py CONFIG.json``. Standard library and pytest only: this file and its
sibling modules, loaded from beside it, are bound read-only into the sandbox on their own (the
package around them holds task files): :mod:`grading_sources` (the hidden tests from memory),
:mod:`grading_attribution` (whose code an event is), :mod:`grading_hook` (the audit hook and
the C wrappers), :mod:`grading_equality` and :mod:`grading_asserts` (the asserts' comparison
and the rewriting of the test files), :mod:`grading_namespaces` and :mod:`grading_items` (the
namespace and item checks). This file reads the key, writes the records and holds pytest's
plugin.

Everything here shares one interpreter with the tested code, so nothing in it is secret or
out of reach in principle; what it does is make each way in leave a mark before it works
(see docs/grading.md for the threat model and what stays open):

1. the per-run nonce and the hidden tests' sources (on disk only stubs: pytest loads them
   from memory, :mod:`grading_sources`) are read from an inherited pipe and the evidence
   pipe is made close-on-exec, before any workspace code can run (``-I``: no PYTHON* variables, no user
   site, no script directory on ``sys.path``; the workspace roots are *appended* after
   pytest and all of ``_pytest`` are imported, so no workspace module shadows them or the
   standard library);
2. a PEP 578 audit hook, reachable from no Python object, writes a ``flag`` record to the
   evidence pipe the moment code the policy wrote (a file its diff added or changed, or
   code compiled at run time) introspects frames or the heap, writes a code object,
   traces, opens (or links to) a test, runner or ``/proc`` file, signals another process,
   installs a signal handler, uses ctypes, starts a process, makes a second copy of a C
   module, or compiles source itself (under whatever file name);
3. the namespaces of builtins, pytest, ``_pytest``, pluggy and this runner are snapshotted
   before the run and compared as each test phase is reported and at the end: a
   patch there is a ``flag``, and so is the comparison's name in a test module's globals;
4. ``==`` / ``!=`` / ``in`` in the asserts of the task's test files go through a check
   that flags an operand whose ``__eq__`` the policy (or pytest: ``approx``) wrote claiming
   an equality with a builtin value that the builtin's own operator does not grant;
5. each test's outcome is written to the evidence pipe as pytest reports it, after the
   pipe's descriptor is checked to be the one the host gave (else exit status 3); the host
   reads the pipe only after every process of the sandbox is dead.
"""

import json
import os
import sys
import threading

EVIDENCE_REPLACED = 3  # the exit status when the evidence pipe is not the one the host gave
FLAGS_EXHAUSTED = 4  # the exit status when a flag is raised past the budget of distinct flags


def _sibling(name: str):
    """A runner module bound beside this file (the host binds each of them), loaded from its
    file: ``-I`` keeps this directory off ``sys.path``, and no workspace module may stand in."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(f"tg_runner_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[spec.name] = mod  # so that its namespace is watched like __main__'s
    return mod



def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        cfg = json.load(f)
    ev_fd = cfg["evidence_fd"]
    # The nonce and the hidden tests' sources (only stubs are on disk), drained from the
    # host's pipe and the pipe closed, before any workspace code runs.
    served = _sibling("grading_sources")
    nonce, hidden, rewritten = served.read_key(cfg["nonce_fd"])
    os.set_inheritable(ev_fd, False)  # subprocesses of the tests do not get it
    write, exit_, getident, dumps = os.write, os._exit, threading.get_ident, json.dumps

    # The evidence pipe as the host gave it: a descriptor the tested code points elsewhere
    # (dup2 of another file onto it, or closed and reopened) would take the records (and
    # the nonce with them) where the host does not read. Checked before every record is
    # written: the runner stops at once, with an exit status the host grades FAIL.
    fstat = os.fstat
    given = fstat(ev_fd)
    ev_id = (given.st_dev, given.st_ino)

    def emit(rec: dict) -> None:
        try:
            st = fstat(ev_fd)
            same = (st.st_dev, st.st_ino) == ev_id
        except OSError:
            same = False
        if not same:
            exit_(EVIDENCE_REPLACED)
        data = (nonce + " " + dumps(rec, separators=(",", ":")) + "\n").encode()
        while data:
            data = data[write(ev_fd, data):]

    import pytest  # noqa: F401  (and every _pytest module, before any workspace code)
    import importlib

    from _pytest.config import default_plugins, essential_plugins

    # What pytest.main would import anyway, imported now so that the snapshot below covers it.
    for name in essential_plugins + default_plugins:
        try:
            importlib.import_module(f"_pytest.{name}")
        except Exception:  # an optional plugin needing a missing package
            pass
    import _pytest.assertion.rewrite as rewrite
    import subprocess  # its namespace (the _fork_exec it binds) is watched: imported before the snapshot

    ws = cfg["workspace"].rstrip("/") + "/"
    solution = frozenset(os.path.join(ws, p) for p in cfg["solution_files"])
    protected = frozenset(os.path.join(ws, p) for p in cfg["protected_files"])
    runner_dir = os.path.dirname(os.path.abspath(__file__)) + "/"
    opaque = tuple(os.path.dirname(sys.modules[n].__file__) + "/" for n in ("pytest", "_pytest", "pluggy")) + (
        runner_dir,)

    # Where library code lives: the interpreter's own sys.path at start (stdlib, site-packages),
    # as named and resolved. Code anywhere else (/tmp, /var, a file the tested code wrote at run
    # time, "<string>") counts as the policy's.
    libs = tuple(sorted({q.rstrip("/") + "/" for p in sys.path if p and os.path.isabs(p)
                         for q in (p, os.path.realpath(p))}))

    a = _sibling("grading_attribution").build(ws, solution, protected, opaque, libs, runner_dir)
    classify, kind, disguised, culprit, busy = a.classify, a.kind, a.disguised, a.culprit, a.busy
    norm, realpath, main_thread = a.norm, a.realpath, a.main_thread
    runner_file = os.path.abspath(__file__)
    flagged: set[str] = set()

    def flag(reason: str) -> None:
        reason = str(reason)[:500]
        # bounded: a flood of flags cannot fill the host's buffer; and each reason once, so
        # that a walk repeating one (pytest rendering a traceback frame by frame) leaves room.
        # Fails closed: past 50 distinct reasons (or a set other code padded to 50: the tenth
        # review did, from main's frame) the run ends here with a status the host grades
        # FAIL, so a flag is never dropped; a set emptied by other code only repeats flags.
        if reason in flagged:
            return
        if len(flagged) >= 50:
            exit_(FLAGS_EXHAUSTED)
        flagged.add(reason)
        emit({"t": "flag", "reason": reason})

    def from_pytest(frame) -> bool:
        """A result may only come from this runner's plugin, called (through pluggy) by
        pytest on the main thread, with no frame of the policy's code anywhere below."""
        if getident() != main_thread or frame is None or frame.f_code.co_filename != runner_file:
            return False
        f = frame.f_back
        while f is not None:
            if kind(f.f_code.co_filename) == "solution":
                return False
            if f.f_back is None:
                return f.f_code.co_filename == runner_file
            f = f.f_back
        return False

    hooks = _sibling("grading_hook")
    hook = hooks.build(a, flag, emit, from_pytest, protected, libs, runner_dir)
    hooks.wrap_c_modules()

    # ---- what each test file defined: its top-level statements report each binding as they
    # run (grading_asserts.record_definitions), before code of the policy's can rebind it;
    # the item check compares what pytest is about to call with it.
    defined: dict[str, dict] = {}  # a test file's real path -> {name: the value its statement bound}
    classes: dict[int, tuple] = {}  # id(a class recorded, or nested in one) -> (the class, a copy of its dict)
    instrumented: dict[str, frozenset] = {}  # a test file's real path -> the names its code records
    cdict = type.__dict__["__dict__"].__get__

    def snap(cls, depth=0, _classes=classes, _cdict=cdict):
        d = dict(_cdict(cls))
        _classes[id(cls)] = (cls, d)
        todo = [(v, depth + 1) for v in d.values()]
        while todo:  # a loop, not a recursive call: a closure over ``snap`` would be one more cell
            v, n = todo.pop()
            if n <= 4 and issubclass(type(v), type) and id(v) not in _classes:
                vd = dict(_cdict(v))
                _classes[id(v)] = (v, vd)
                todo.extend((w, n + 1) for w in vd.values())

    # The builtin DEF_NAME: reachable from any code, so it closes over nothing. Reading a
    # function's ``__closure__`` raises no audit event (its ``__defaults__`` does), and a
    # closure over ``flag`` led on to ``emit``, the nonce and the attribution cache.
    def define(path, name, value, _busy=busy, _getframe=sys._getframe, _defined=defined, _snap=snap, _real=realpath,
               _getident=getident, _flag=flag, _culprit=culprit):
        me = _getident()
        added = me not in _busy
        _busy.add(me)  # the runner's own frame read: not judged
        try:
            code = _getframe(1).f_code
            fn = code.co_filename
            if not (type(path) is str and type(name) is str and code.co_name == "<module>"
                    and isinstance(fn, str) and _real(str.__str__(fn)) == path):
                _flag(f"the runner's record of a test file's definitions called by other code "
                      f"({_culprit(_getframe(1), deep=True) or fn!s:.200})")
                return
            _defined.setdefault(path, {})[name] = value
            if issubclass(type(value), type):
                _snap(value)
        finally:
            if added:
                _busy.discard(me)

    equality = _sibling("grading_equality")
    checked = equality.install(classify, protected, disguised, a.assert_run_by_policy, a.referents, define)
    _sibling("grading_asserts").install(protected, realpath, rewrite, instrumented, equality.CMP_NAME,
                                        equality.CMP_ARG, equality.DEF_NAME)
    served.install(hidden, rewritten, rewrite)  # compiled through the guard just installed; text dropped
    del hidden
    checks = _sibling("grading_namespaces").build(classify, protected, ws, equality.CMP_NAME)
    items = _sibling("grading_items").build(classify, protected, ws, a.code_of, a.code_file, norm, checked,
                                            equality.CMP_ARG, (defined, classes, instrumented, realpath))
    compare = checks.compare
    base = checks.snapshot()
    state = [None, None]  # the Config and the collected items, reachable only through (audited) defaults
    # What the runner itself saw of each test's call phase, around pytest's own call of the
    # test ("running" until it returns): a call reported passed must have returned without
    # raising here. Reports can be changed by plugins and patches between the call and its
    # report; this cannot, short of the audited ways into this file's defaults. ``ran``: the
    # python test functions pytest really called (its pytest_pyfunc_call), and ``needs``:
    # the items whose call is that (pytest's own Function.runtest, not a unittest case's).
    seen: dict[str, str] = {}
    ran: set[str] = set()
    needs: set[str] = set()
    from _pytest.python import Function
    function_runtest = Function.runtest
    try:
        from _pytest.subtests import SubtestReport as subtest_report
    except ImportError:  # pytest before 9: subtests were a plugin (not loaded here)
        subtest_report = ()

    class Plugin:
        @pytest.hookimpl(tryfirst=True)
        # The namespaces are compared before each record is written, and at the end. Not also
        # after each test: between a teardown's record and the next setup's nothing is
        # recorded, so a patch made and undone there cannot change a record.
        def pytest_runtest_logreport(self, report, _audit=sys.audit, _compare=compare, _base=base, _state=state,
                                     _seen=seen, _ran=ran, _needs=needs, _subtest=subtest_report):
            _compare(_base, f"during {report.nodeid} ({report.when})", _state[0])  # before its record
            outcome = "error" if report.failed and report.when != "call" else report.outcome
            if report.when == "call" and outcome == "passed":
                ran = _seen.get(report.nodeid)  # "running": a subtest's report, made during the call
                if ran not in ("ok", "running"):
                    _audit("tg.flag", f"{report.nodeid} reported passed, but "
                                      + ("its call raised" if ran == "raised" else "the runner never saw it run"))
                elif report.nodeid in _needs and report.nodeid not in _ran:
                    _audit("tg.flag", f"{report.nodeid} reported passed, but its test function was never called")
            # a subtest's report (pytest's subtests fixture, unittest's subTest) is one of many
            # for the call: "subtest", so that each test phase has exactly one record
            _audit("tg.emit", report.nodeid, "subtest" if isinstance(report, _subtest) else report.when, outcome)

        @pytest.hookimpl(wrapper=True, trylast=True)  # the innermost wrapper: next to the test itself
        def pytest_runtest_call(self, item, _audit=sys.audit, _seen=seen, _problem=items.item_problem,
                                _problems=items.item_problems, _state=state, _needs=needs,
                                _runtest=function_runtest, _function=Function):
            bad = _problem(item)
            if bad:
                _audit("tg.flag", bad)
            for bad in _problems(item, item.session, _state[1]):
                _audit("tg.flag", bad)
            nodeid = item.nodeid
            if isinstance(item, _function) and type(item).runtest is _runtest:
                _needs.add(nodeid)
            _seen[nodeid] = "running"
            try:
                out = yield
            except BaseException:
                _seen[nodeid] = "raised"
                raise
            # unittest cases keep their failure on the item until the report is made
            _seen[nodeid] = "raised" if getattr(item, "_excinfo", None) else "ok"
            return out

        @pytest.hookimpl(wrapper=True, trylast=True)  # innermost: pytest's own call of the function next
        def pytest_pyfunc_call(self, pyfuncitem, _ran=ran, _audit=sys.audit, _called=items.called_problem,
                               _gettrace=sys.gettrace, _getprofile=sys.getprofile):
            # what pytest calls next is pyfuncitem.obj: the function its test file defined
            bad = _called(pyfuncitem)
            if bad:
                _audit("tg.flag", bad)
            if _gettrace() is not None or _getprofile() is not None:
                _audit("tg.flag", f"a trace or profile function is set (calling {pyfuncitem.nodeid!s:.200})")
            _ran.add(pyfuncitem.nodeid)
            return (yield)

        @pytest.hookimpl(trylast=True)  # after every other plugin's say on the items
        def pytest_collection_finish(self, session, _state=state, _collected=items.collected, _audit=sys.audit):
            _state[1], unbound = _collected(session)
            for where in unbound:
                _audit("tg.flag", f"the runner's comparison not bound in {where} (replaced while it was defined)")

        @pytest.hookimpl(tryfirst=True)
        def pytest_collectreport(self, report, _audit=sys.audit):
            if report.failed:
                _audit("tg.emit", report.nodeid, "collect", "error")

        @pytest.hookimpl(tryfirst=True)
        def pytest_configure(self, config, _state=state):
            _state[0] = config

    sys.addaudithook(hook)
    sys.path.extend(r for r in cfg["roots"] if r)
    try:
        code = pytest.main(cfg["pytest_args"], plugins=[Plugin()])
    except BaseException as e:  # SystemExit / KeyboardInterrupt raised by the tested code
        emit({"t": "stopped", "reason": f"pytest stopped by {type(e).__name__}"})
        code = -1
    compare(base, "at the end", state[0])
    emit({"t": "done", "exit": int(code) if isinstance(code, int) else -1})
    sys.stdout.flush()
    exit_(0)  # no exit hook the tested code registered runs after the last record


if __name__ == "__main__":
    main()
