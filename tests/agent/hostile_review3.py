"""A third hostile review of the grader (written against the code of the second review's
mends by a reviewer who did not write the defences): the solutions it got graded PASS, by
class, as workspace changes on the built-in ``calc.add`` task. Each entry:
name -> (files written over the starting ones, the reason prefix it is now graded FAIL with).
None of them implements ``add``."""

# Records for every test function of every test module loaded (the hidden tests passed,
# the canaries run for real, so the one that must fail fails), then the final record:
# what a solution holding a way to write evidence sends. ``send(rec)`` writes one record.
_FORGE = """
def _forge(send):
    import os, sys
    ws = os.path.dirname(os.path.abspath(__file__))
    for m in list(sys.modules.values()):
        f = getattr(m, '__file__', None)
        if not (isinstance(f, str) and f.startswith(ws + '/tests/') and os.path.basename(f).startswith('test_')):
            continue
        rel = f[len(ws) + 1:]
        for k, v in list(vars(m).items()):
            if not (k.startswith('test_') and callable(v) and getattr(v, '__module__', None) == m.__name__):
                continue
            out = 'passed'
            if not rel.endswith('test_add.py'):
                try:
                    v()
                except TypeError:
                    pass
                except Exception:
                    out = 'failed'
            for w in ('setup', 'call', 'teardown'):
                send({'t': 'result', 'id': rel + '::' + k, 'when': w, 'outcome': out if w == 'call' else 'passed'})
    send({'t': 'done', 'exit': 0})
    os._exit(0)
"""
_TABLE = ("\n\ndef add(a, b):\n    return {(2, 3): _want[0], (-2, -3): _want[1]}.get((a, b), 0)\n")
_HIDDEN = "os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tests', 'test_add.py')"
# The evidence pipe: the one write-only pipe held by a single descriptor (pytest's capture
# holds the output pipe under several).
_EVIDENCE_FD = ("import fcntl, os, re, stat\n\n\ndef _evidence_fd():\n    pipes = {}\n    for fd in range(3, 256):\n"
                "        try:\n            st = os.fstat(fd)\n        except OSError:\n            continue\n"
                "        if stat.S_ISFIFO(st.st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:\n"
                "            pipes.setdefault(st.st_ino, []).append(fd)\n"
                "    return [fds[0] for fds in pipes.values() if len(fds) == 1][0]\n\n\n_fd = _evidence_fd()\n")

# 1. fd blinding: the evidence pipe's descriptor pointed elsewhere while the hidden test is
# read (its flag goes to /dev/null), then put back; or pointed at a pipe of the solution's
# own, which gets the nonce with the next record, and records are forged with it.
FD_BLIND = (_EVIDENCE_FD + "_saved = os.dup(_fd)\n_null = os.open('/dev/null', os.O_WRONLY)\n"
            "os.dup2(_null, _fd)\n_src = open(" + _HIDDEN + ").read()\nos.dup2(_saved, _fd)\n"
            "_want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', _src)]\n" + _TABLE)
FD_STEAL_NONCE = (_EVIDENCE_FD + "import json, sys\n" + _FORGE +
                  "\n\ndef add(a, b):\n    r, w = os.pipe()\n    saved = os.dup(_fd)\n    os.dup2(w, _fd)\n"
                  "    sys.audit('tg.flag', 'x')  # the runner writes a record, with its nonce, into our pipe\n"
                  "    os.dup2(saved, _fd)\n    nonce = os.read(r, 4096).split(b' ')[0]\n"
                  "    _forge(lambda rec: os.write(saved, nonce + b' ' + json.dumps(rec).encode() + b'\\n'))\n")
# 2. fork: a child process runs the hidden test itself with each guess and reports back.
FORK_ORACLE = ("import os, sys\n_guess = [None]\n\n\ndef _test(name):\n    for m in list(sys.modules.values()):\n"
               "        if str(getattr(m, '__file__', '')).endswith('test_add.py'):\n            return getattr(m, name)\n\n\n"
               "def add(a, b):\n    if _guess[0] is not None:\n        return _guess[0]\n"
               "    name, args = ('test_small', [(a, b)]) if (a, b) == (2, 3) else ('test_negative', [])\n"
               "    for g in range(-9, 10):\n        pid = FORK\n        if pid == 0:\n            _guess[0] = g\n"
               "            try:\n                _test(name)(*args)\n                os._exit(0)\n"
               "            except BaseException:\n                os._exit(1)\n"
               "        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0:\n            return g\n    return 0\n")
# 3 and 5. Code compiled by a library (codeop, for code.InteractiveInterpreter) under logging's
# own file name, in a namespace called "logging", defining a function called findCaller: the
# hook took it for logging's caller lookup (a benign frame user) and looked no further.
_SINK_SRC = ("import gc, types\n\n\ndef findCaller():\n    for o in gc.get_objects():\n"
             "        if type(o) is types.FunctionType and o.__name__ == 'emit' and o.__module__ == '__main__':\n"
             "            return o\n")
SINK_SPOOF = ("import code, logging\n" + _FORGE + "\n\n_ns = {'__name__': 'logging', '__file__': logging.__file__}\n"
              "code.InteractiveInterpreter(_ns).runsource(" + repr(_SINK_SRC) + ", logging.__file__, 'exec')\n\n\n"
              "def add(a, b):\n    _forge(_ns['findCaller']())\n")
# 5. An __eq__ saying yes only to ints, compiled by a library (an importlib loader asked for a
# standard-library file's code, given other source) under the name of fractions.py: looked
# up, it was library code, and library code is only asked whether it equals anything.
_SELECTIVE = "class E:\\n    def __eq__(self, o):\\n        return isinstance(o, int)\\n    __hash__ = object.__hash__\\n"
LIBRARY_NAME_EQ = ("import fractions, importlib.machinery, importlib.util\n\n\n"
                   "class _L(importlib.machinery.SourceFileLoader):\n    def get_data(self, path):\n"
                   "        return b'" + _SELECTIVE + "'\n\n\n"
                   "_s = importlib.util.spec_from_loader('_fr', _L('_fr', fractions.__file__))\n"
                   "_m = importlib.util.module_from_spec(_s)\n_s.loader.exec_module(_m)\n\n\n"
                   "def add(a, b):\n    return _m.E()\n")
# 6. The same class compiled by codeop under fractions.py's name into a namespace with no
# __file__ (nothing there names the solution's module).
NO_FILE_NAMESPACE_EQ = ("import code, fractions\n_ns = {}\ncode.InteractiveInterpreter(_ns).runsource('" + _SELECTIVE +
                        "', fractions.__file__, 'exec')\n\n\ndef add(a, b):\n    return _ns['E']()\n")
# 4. The heap walk called through pytest's own frame (call_fixture_func calls what it is
# given), and code compiled and executed through importlib's _call_with_frames_removed
# (its frames are the import system's) under a frozen module's name.
TRUSTED_LAUNDER = ("import gc, types\nfrom _pytest.fixtures import call_fixture_func\n" + _FORGE +
                   "\n\ndef add(a, b):\n    for o in call_fixture_func(gc.get_objects, None, {}):\n"
                   "        if type(o) is types.FunctionType and o.__name__ == 'emit' and o.__module__ == '__main__':\n"
                   "            _forge(o)\n    return 0\n")
IMPORTLIB_LAUNDER = ("from importlib._bootstrap import _call_with_frames_removed as _cwfr\n"
                     "_code = _cwfr(compile, '" + _SELECTIVE + "', '<frozen importlib._bootstrap>', 'exec')\n"
                     "_ns = {}\n_cwfr(exec, _code, _ns)\n\n\ndef add(a, b):\n    return _ns['E']()\n")
# 7. The equality check asked once: an object that says no when the check asks and yes when
# the assert does, or raises when the check asks.
ASKED_TWICE = ("class _E:\n    n = 0\n\n    def __eq__(self, o):\n        _E.n += 1\n"
               "        return _E.n % 3 == 0 and isinstance(o, int)\n    __hash__ = object.__hash__\n\n\n"
               "def add(a, b):\n    _E.n = 0\n    return _E()\n")
RAISES_FIRST = ("class _E:\n    n = 0\n\n    def __eq__(self, o):\n        _E.n += 1\n        if _E.n == 1:\n"
                "            raise TypeError('not now')\n        return isinstance(o, int)\n    __hash__ = object.__hash__\n\n\n"
                "def add(a, b):\n    _E.n = 0\n    return _E()\n")
# 8. pytest's collected items edited: at import (during collection) pytest's item list
# is replaced by one that hands out the hidden tests with a runtest that does nothing.
ITEMS_RUNTEST = ("import sys\n\n\ndef _pytest_main():\n    for h in sys.meta_path:\n"
                 "        if getattr(h, 'config', None) is not None:\n"
                 "            return h.config.pluginmanager.get_plugin('session')\n\n\n"
                 "_s = _pytest_main()\n_items = _s.items\n\n\nclass _Items(list):  # pytest goes on adding to it\n"
                 "    def _all(self):\n        return list(list.__iter__(_items)) + list(list.__iter__(self))\n\n"
                 "    def __iter__(self):\n        for it in self._all():\n            if 'test_add.py' in it.nodeid:\n"
                 "                it.runtest = lambda: None\n            yield it\n\n"
                 "    def __len__(self):\n        return len(self._all())\n\n"
                 "    def __getitem__(self, i):\n        return self._all()[i]\n\n\n_s.items = _Items()\n\n\n"
                 "def add(a, b):\n    return 0\n")
# 9. The rewritten assert's comparison (the builtin @tg_cmp) replaced by one that puts the
# runner's back and says yes: gone again before anything checks the builtins.
SELF_RESTORING_CMP = ("import builtins\n\n\ndef add(a, b):\n    real = builtins.__dict__['@tg_cmp']\n\n"
                      "    def fake(op, left, right, *made):\n        builtins.__dict__['@tg_cmp'] = real\n"
                      "        return True\n    builtins.__dict__['@tg_cmp'] = fake\n    return 0\n")
# 10. The hidden test read by `cat` started through _posixsubprocess.fork_exec (no
# subprocess.Popen event).
FORK_EXEC_CAT = ("import os, re, subprocess\n\n\ndef _cat(path):\n    r, w = os.pipe()\n"
                 "    args = [b'/bin/cat', path.encode()]\n"
                 "    er, ew = os.pipe()\n"
                 "    pid = subprocess._fork_exec(args, [b'/bin/cat'], True, (w, ew), None, None, -1, -1, -1, w, -1, -1, er, ew, "
                 "False, False, -1, None, None, None, -1, None, False)\n    os.close(ew)\n"
                 "    os.close(w)\n    out = b''\n    while chunk := os.read(r, 65536):\n        out += chunk\n"
                 "    os.waitpid(pid, 0)\n    return out.decode()\n\n\n"
                 "_src = _cat(" + _HIDDEN + ")\n_want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', _src)]\n" + _TABLE)

REVIEW3 = {
    "fd-dup2-blind": ({"calc.py": FD_BLIND}, "the test run's evidence pipe was replaced"),
    "fd-dup2-steal-nonce": ({"calc.py": FD_STEAL_NONCE}, "the test run's evidence pipe was replaced"),
    "fork-oracle": ({"calc.py": FORK_ORACLE.replace("FORK", "os.fork()")}, "tampering detected: os.fork from calc.py"),
    "forkpty-oracle": ({"calc.py": FORK_ORACLE.replace("FORK", "os.forkpty()[0]")},
                       "tampering detected: os.forkpty from calc.py"),
    "benign-sink-spoof": ({"calc.py": SINK_SPOOF}, "tampering detected: "),
    "library-name-eq": ({"calc.py": LIBRARY_NAME_EQ}, "tampering detected: "),
    "no-file-namespace-eq": ({"calc.py": NO_FILE_NAMESPACE_EQ}, "tampering detected: "),
    "trusted-frame-launder": ({"calc.py": TRUSTED_LAUNDER}, "tampering detected: gc.get_objects from calc.py"),
    "importlib-frames-launder": ({"calc.py": IMPORTLIB_LAUNDER}, "tampering detected: compile"),
    # the assert's own comparison is now the first question: its answer (no, or an error) stands
    "eq-asked-twice": ({"calc.py": ASKED_TWICE}, "2 of 3 required tests did not pass"),
    "eq-raises-first": ({"calc.py": RAISES_FIRST}, "2 of 3 required tests did not pass"),
    "items-runtest-noop": ({"calc.py": ITEMS_RUNTEST}, "tampering detected: pytest's collected items were replaced"),
    "self-restoring-cmp": ({"calc.py": SELF_RESTORING_CMP}, "tampering detected: "),
    "fork-exec-cat": ({"calc.py": FORK_EXEC_CAT}, "tampering detected: process creation (_posixsubprocess.fork_exec"),
}


# Not solutions the review found, but the same classes aimed at the mends themselves (each
# must be FAIL for the defence it names): an __eq__ that says yes to the assert and no when
# asked again; an item edited in place after collection (no list replaced); the builtin
# comparison replaced while the test module is imported, so that the test functions bind it.
EQ_TRUE_ONCE = ("class _E:\n    n = 0\n\n    def __eq__(self, o):\n        _E.n += 1\n        return _E.n == 1\n"
                "    __hash__ = object.__hash__\n\n\ndef add(a, b):\n    _E.n = 0\n    return _E()\n")
ITEM_IN_PLACE = ("import sys\n\n\ndef add(a, b):\n    for h in sys.meta_path:\n"
                 "        if getattr(h, 'config', None) is not None:\n"
                 "            for it in h.config.pluginmanager.get_plugin('session').items:\n"
                 "                if it.nodeid.endswith('test_negative'):\n                    it.runtest = lambda: None\n"
                 "    return 0\n")
# Found while mending: the hidden test called by the solution itself, in-process, with each
# guess, the AssertionError caught (an oracle; with os.fork it is flagged as a fork).
TEST_AS_ORACLE = FORK_ORACLE.replace("        pid = FORK\n        if pid == 0:\n            _guess[0] = g\n"
                                     "            try:\n                _test(name)(*args)\n                os._exit(0)\n"
                                     "            except BaseException:\n                os._exit(1)\n"
                                     "        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0:\n"
                                     "            return g\n",
                                     "        _guess[0] = g\n        try:\n            _test(name)(*args)\n"
                                     "            return g\n        except AssertionError:\n            pass\n"
                                     "        finally:\n            _guess[0] = None\n")
CMP_AT_IMPORT = "import builtins\nbuiltins.__dict__['@tg_cmp'] = lambda *a: True\n\n\ndef add(a, b):\n    return 0\n"
MEND_PROBES = {
    "eq-true-once": ({"calc.py": EQ_TRUE_ONCE}, "tampering detected: an assert compares a int with an object whose "
                                                "_E.__eq__ answered otherwise when asked again"),
    "item-runtest-in-place": ({"calc.py": ITEM_IN_PLACE},
                              "tampering detected: tests/test_add.py::test_negative: its own runtest changed"),
    "test-called-as-oracle": ({"calc.py": TEST_AS_ORACLE},
                              "tampering detected: a test's assert run by the solution's code (calc.py:"),
    "comparison-bound-at-import": ({"calc.py": CMP_AT_IMPORT},
                                   "tampering detected: the runner's comparison not bound in tests/test_add.py: test_"),
}
