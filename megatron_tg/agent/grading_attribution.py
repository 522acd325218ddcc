"""The grading runner's attribution: whose code is responsible for an event (part of the
runner: bound read-only into the grading sandbox beside it, loaded by it from there; standard
library only). A code object's file says whose it is (``classify``: the policy's, trusted --
pytest, this runner, the task's tests -- or a library's, looked through to its caller); a
frame walk finds the first frame of the policy's (``culprit``); every thread start goes
through the runner, which records who started it (``thread_origin``); and the runner's own
reads of frames, code objects and the heap mark the thread ``busy``, so that the audit hook
(:mod:`grading_hook`) does not judge them.

Everything here is reachable from the tested code, so its state is bound as default
arguments (reading or rewriting a runner function's ``__defaults__`` is an audited, flagged
event).
"""

import os
import sys
import threading
import types

import _thread

# Standard-library functions that take a frame and give back only names or line numbers
# (logging's caller lookup, typing's/enum's/namedtuple's module name): not an introspection.
# Recognised by their code objects (benign_sinks), never by name: a function of the same name
# in a namespace of the same name is anybody's.
BENIGN_SINKS = (("logging", "Logger", "findCaller"), ("typing", None, "_caller"), ("collections", None, "namedtuple"),
                ("enum", "EnumType", "_create_"), ("enum", "EnumType", "__new__"), ("enum", "EnumType", "_convert_"))
IMPORT_FRAMES = ("<frozen importlib", "<frozen zipimport")


def benign_sinks() -> tuple:
    """The code objects of BENIGN_SINKS, looked up in the modules pytest has imported."""
    import collections
    import enum
    import logging
    import typing

    mods = {"logging": logging, "typing": typing, "collections": collections, "enum": enum}
    out = []
    for mod, cls, name in BENIGN_SINKS:
        owner = getattr(mods[mod], cls) if cls else mods[mod]
        fn = type.__dict__["__dict__"].__get__(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            out.append(code)
    return tuple(out)



def build(ws, solution, protected, opaque, libs, runner_dir):
    """The attribution of the run: ``ws`` the workspace (with a trailing slash), ``solution`` and
    ``protected`` the real paths of the policy's and of the task's test files, ``opaque`` the
    directories of pytest, pluggy and this runner, ``libs`` the interpreter's library trees."""
    getident = threading.get_ident
    kinds: dict[str, str] = {}

    def classify(filename, _protected=protected, _opaque=opaque, _solution=solution, _ws=ws, _libs=libs,
                 _isfile=os.path.isfile, _norm=os.path.normpath):
        """"solution" (code the policy wrote), "trusted" (pytest, this runner, the task's
        tests: their frames decide) or "library" (stdlib, other packages, the repository's
        unchanged files: looked through to their caller). Pure: only immutable defaults.
        "/ws/./x.py" and "/ws/tests/../x.py" name the solution's x.py as well: a code object
        keeps the spelling it was loaded under, so the name is normalised first."""
        filename = str.__str__(filename) if isinstance(filename, str) else "?"
        if filename.startswith("/"):
            filename = _norm(filename)
        if filename in _protected or filename.startswith(_opaque):
            return "trusted"
        if filename in _solution:
            return "solution"
        if filename.startswith("<frozen "):
            return "library"  # code compiled at run time under such a name: "compile" is flagged
        if filename.startswith(_ws) or filename.startswith(_libs):
            if not _isfile(filename):
                return "solution"  # a made-up name: code compiled at run time, not a file there
            return "library"  # the repository's own unchanged source, the stdlib, packages
        return "solution"

    def kind(filename: str) -> str:
        k = kinds.get(filename)
        if k is None:
            k = kinds[filename] = classify(filename)
        return k

    sinks = benign_sinks()
    norm, realpath = os.path.normpath, os.path.realpath
    same_file: dict[tuple[str, str], bool] = {}

    def is_sink(code, _sinks=sinks) -> bool:
        for c in _sinks:
            if c is code:
                return True
        return False

    def disguised(code, g, _same=same_file, _mdict=type(sys).__dict__["__dict__"].__get__) -> bool:
        """Code claiming a library file (or a frozen module) that runs in a namespace which is
        not that module's: code compiled under the library's name and executed elsewhere (a
        dict of the solution's, or one with no ``__file__`` at all). The policy's."""
        name = getattr(code, "co_filename", None)
        name = str.__str__(name) if isinstance(name, str) else "?"
        if kind(name) != "library":
            return False
        if type(g) is not dict:
            return True
        if name.startswith("<frozen "):
            mod = dict.get(g, "__name__")
            if type(mod) is str and name == f"<frozen {str.__str__(mod)}>":
                return False
            # _collections_abc calls itself collections.abc: its own namespace all the same
            real = sys.modules.get(name[len("<frozen "):-1])
            return not (type(real) is type(sys) and _mdict(real) is g)
        f = dict.get(g, "__file__")
        if not isinstance(f, str):
            return True
        f = str.__str__(f)
        r = _same.get((name, f))
        if r is None:
            r = _same[(name, f)] = not (norm(f) == norm(name) or realpath(f) == realpath(name))
        return r

    def culprit(frame, deep=False):
        """The first frame that is not library code, unless a benign stdlib sink is crossed:
        (file, line) when it is the policy's code, else None. ``deep``: a trusted frame
        (pytest's, a test's) does not end the walk, any frame of the policy's below it is the
        culprit: pytest functions that call what they are given (call_fixture_func) would
        otherwise launder a call."""
        while frame is not None:
            code = frame.f_code
            k = kind(code.co_filename)
            if k == "library" and disguised(code, frame.f_globals):
                k = "solution"
            if k == "solution":
                return f"{code.co_filename[len(ws):] if code.co_filename.startswith(ws) else code.co_filename}:" \
                       f"{frame.f_lineno}"
            if k == "trusted" and not deep:
                return None
            if is_sink(code):
                return None
            frame = frame.f_back
        return None

    def benign(frame):
        """Whether a benign stdlib sink (logging's caller lookup and the like) is on the stack."""
        while frame is not None:
            if is_sink(frame.f_code):
                return True
            frame = frame.f_back
        return False

    busy: set[int] = set()
    getframe, getpid = sys._getframe, os.getpid
    main_thread = getident()

    # ---- who started each thread. An event in a worker thread has only library frames on
    # that thread's stack (ThreadPoolExecutor, threading.Thread(target=a stdlib function)),
    # so it is attributed to the code that started the thread: every start goes through
    # start_new_thread below, which records the starter (None: no code of the policy's on the
    # starting stack, in a thread not started by it). A thread it did not start (a fresh
    # _thread module, native code) has no record and counts as the policy's.
    origins: dict[int, str | None] = {}
    start_lock = threading.Lock()
    real_start = _thread.start_new_thread

    # Installed as _thread.start_new_thread, so reachable from any code: it closes over
    # nothing (an unaudited read of its __closure__ led to culprit, kind and their cache).
    def start_new_thread(function, args, kwargs=None, _real=real_start, _origins=origins, _lock=start_lock,
                         _busy=busy, _getident=getident, _culprit=culprit, _getframe=getframe,
                         _main=main_thread):
        me = _getident()
        added = me not in _busy
        _busy.add(me)  # this frame read is the runner's own: not judged
        try:
            starter = _culprit(_getframe(1))
        finally:
            if added:
                _busy.discard(me)
        if starter is None and me != _main:
            starter = _origins.get(me, "a thread of unknown origin")
        with _lock:  # the new thread's events wait for its record (thread_origin)
            ident = _real(function, args) if kwargs is None else _real(function, args, kwargs)
            _origins[ident] = starter
        return ident

    def thread_origin(_origins=origins, _lock=start_lock):
        """None on the main thread or a thread started by trusted code; else who started it."""
        me = getident()
        if me == main_thread:
            return None
        if me not in _origins:
            with _lock:
                pass
        return _origins.get(me, "code that started a thread without the runner seeing it")

    _thread.start_new_thread = start_new_thread
    threading._start_new_thread = start_new_thread
    import_frames = IMPORT_FRAMES
    cwfr = sys.modules["importlib._bootstrap"]._call_with_frames_removed.__code__

    def frame_kind(f) -> str:
        k = kind(f.f_code.co_filename)
        return "solution" if k == "library" and disguised(f.f_code, f.f_globals) else k

    def real_caller(caller):
        """(the frame responsible for the call the hook judges, whether it is the import
        system's). importlib's _call_with_frames_removed(f, *args) calls what it is given: it
        is the import system's only when importlib itself called it, else its caller's."""
        if caller is None or not caller.f_code.co_filename.startswith(import_frames):
            return caller, False
        if caller.f_code is cwfr:
            up = caller.f_back
            if up is not None and not up.f_code.co_filename.startswith(import_frames):
                return up, False
        return caller, True

    def caller_frame(_busy=busy, _getframe=sys._getframe):
        """The frame that raised the event being judged (the hook's caller)."""
        me = getident()
        added = me not in _busy
        _busy.add(me)
        try:
            return _getframe(2)
        finally:
            if added:
                _busy.discard(me)

    def code_of(fn, _busy=busy, _fn=types.FunctionType, _m=types.MethodType,
                _code=types.FunctionType.__dict__["__code__"].__get__,
                _func=types.MethodType.__dict__["__func__"].__get__):
        """``fn``'s code object (a function's, or a bound method's function's; None for any
        other object), read without this hook judging the read itself. Read through the
        types' own descriptors, never by attribute lookup: the hook ignores events while the
        thread is busy, and a lookup on an object of the policy's (``__getattr__``, a
        property) would run its code in that window."""
        if type(fn) is _m:
            fn = _func(fn)
        if type(fn) is not _fn:
            return None
        me = getident()
        added = me not in _busy
        _busy.add(me)
        try:
            return _code(fn)
        finally:
            if added:
                _busy.discard(me)

    def code_file(fn) -> str | None:
        name = getattr(code_of(fn), "co_filename", None)
        return str.__str__(name) if isinstance(name, str) else None

    def withheld(code) -> bool:
        """A test function's or this runner's code: what the tested code must not read. A
        function a test defines inside itself or a helper it hands to the solution (memoize
        reads its argument's code) is the solution's to inspect."""
        name = getattr(code, "co_filename", None)
        if not isinstance(name, str):
            return False
        name = str.__str__(name)
        if name.startswith(runner_dir):
            return True
        if not (name in protected or norm(name) in protected):
            return False
        qual = str(getattr(code, "co_qualname", ""))
        return "<locals>" not in qual and qual.rpartition(".")[2].startswith("test")

    def assert_run_by_policy(_busy=busy, _getframe=sys._getframe):
        """Where the policy's code called the module-level test function (or method) whose
        assert is running, or None (any frame of the policy's below it, however many of
        pytest's are between): a solution that calls a hidden test itself with guesses and
        catches the failure has an oracle. Called by the comparison (frame 2 is the
        function running the assert); a function a test defines inside itself and hands to
        the solution is not a test."""
        me = getident()
        added = me not in _busy
        _busy.add(me)  # the runner's own frame walk: not judged
        try:
            f = _getframe(2)
            if "<locals>" in f.f_code.co_qualname or kind(f.f_code.co_filename) != "trusted":
                return None
            # Past trusted frames too (culprit's deep walk): pytest functions that call what
            # they are given (CallInfo.from_call, pytest.raises(E, fn)) would hide the caller.
            return culprit(f.f_back, deep=True)
        finally:
            if added:
                _busy.discard(me)

    def referents(x, _busy=busy, _get=__import__("gc").get_referents):
        """What ``x`` holds (a mappingproxy's mapping), read by the runner: not judged."""
        me = getident()
        added = me not in _busy
        _busy.add(me)
        try:
            return _get(x)
        finally:
            if added:
                _busy.discard(me)

    return types.SimpleNamespace(
        classify=classify, kind=kind, disguised=disguised, culprit=culprit, benign=benign, busy=busy,
        getframe=getframe, getpid=getpid, main_thread=main_thread, thread_origin=thread_origin, frame_kind=frame_kind,
        real_caller=real_caller, caller_frame=caller_frame, code_of=code_of, code_file=code_file, withheld=withheld,
        assert_run_by_policy=assert_run_by_policy, referents=referents, norm=norm, realpath=realpath)


__all__ = ["BENIGN_SINKS", "IMPORT_FRAMES", "benign_sinks", "build"]
