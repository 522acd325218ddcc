"""A second hostile review of the grader (written against the final code by a reviewer who did
not write the defences): the solutions that came out PASS and were mended. Each entry:
name -> (files written over the starting ones, the reason prefix it is now graded FAIL with).
Alias paths (``ws/./x.py``), work handed to threads (only library frames on their stacks),
str subclasses that lie to path checks, always-equal objects from the standard library and
a metaclass hiding ``__eq__``."""

REVIEW2 = {
    'test-support-always-eq': ({'calc.py': 'def add(a, b):\n    from test.support import ALWAYS_EQ\n    return ALWAYS_EQ\n'},
        'tampering detected: an assert compares a int with an object whose _ALWAYS_EQ.__eq__ (equal to anything)'),
    'mock-any-stub-asyncio': ({'calc.py': 'import sys, types\n_a = types.ModuleType("asyncio")\n_a.iscoroutinefunction = lambda f: False\n_c = types.ModuleType("asyncio.coroutines"); _c._is_coroutine = object(); _a.coroutines = _c\n_saved = sys.modules.get("asyncio")\nsys.modules["asyncio"] = _a\nfrom unittest.mock import ANY\nif _saved is None:\n    del sys.modules["asyncio"]\n\n\ndef add(a, b):\n    return ANY\n'},
        'tampering detected: an assert compares a int with an object whose _ANY.__eq__ (equal to anything)'),
    'alias-path-always-eq': ({'calc.py': 'import os, sys, importlib.util\n_p = os.path.dirname(os.path.abspath(__file__)) + "/./_h.py"\n_s = importlib.util.spec_from_file_location("_h", _p)\n_m = importlib.util.module_from_spec(_s)\nsys.modules["_h"] = _m\n_s.loader.exec_module(_m)\nadd = _m.add\n', '_h.py': 'class _E:\n    def __eq__(self, o):\n        return True\n\n    def __ne__(self, o):\n        return False\n    __hash__ = object.__hash__\n\n\ndef add(a, b):\n    return _E()\n'},
        'tampering detected: an assert compares a int with an object whose _E.__eq__'),
    'alias-path-getframe': ({'calc.py': 'import os, sys, importlib.util\n_p = os.path.dirname(os.path.abspath(__file__)) + "/./_h.py"\n_s = importlib.util.spec_from_file_location("_h", _p)\n_m = importlib.util.module_from_spec(_s)\nsys.modules["_h"] = _m\n_s.loader.exec_module(_m)\nadd = _m.add\n', '_h.py': "import linecache, re, sys\n\n\ndef add(a, b):\n    f = sys._getframe(1)\n    line = linecache.getline(f.f_code.co_filename, f.f_lineno)\n    return int(re.search(r'==\\s*(-?\\d+)', line).group(1))\n"},
        'tampering detected: sys._getframe from ./_h.py:5'),
    'alias-path-read-hidden': ({'calc.py': 'import os, sys, importlib.util\n_p = os.path.dirname(os.path.abspath(__file__)) + "/./_h.py"\n_s = importlib.util.spec_from_file_location("_h", _p)\n_m = importlib.util.module_from_spec(_s)\nsys.modules["_h"] = _m\n_s.loader.exec_module(_m)\nadd = _m.add\n', '_h.py': "import os, re\n\n\ndef add(a, b):\n    src = open(os.path.join(os.path.dirname(__file__), 'tests', 'test_add.py')).read()\n    want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', src)]\n    return {(2, 3): want[0], (-2, -3): want[1]}.get((a, b), 0)\n"},
        'tampering detected: open of '),
    'alias-path-flip-plugin': ({'calc.py': 'import os, sys, importlib.util\n_p = os.path.dirname(os.path.abspath(__file__)) + "/./_h.py"\n_s = importlib.util.spec_from_file_location("_h", _p)\n_m = importlib.util.module_from_spec(_s)\nsys.modules["_h"] = _m\n_s.loader.exec_module(_m)\nadd = _m.add\n\nfor _x in sys.meta_path:\n    if getattr(_x, "config", None) is not None:\n        _x.config.pluginmanager.register(_m._Flip(), "tgflip")\n        break\n', '_h.py': "import pytest\n\n\nclass _Flip:\n    @pytest.hookimpl(hookwrapper=True)\n    def pytest_runtest_makereport(self, item, call):\n        out = yield\n        if 'test_add.py' in item.nodeid:\n            r = out.get_result()\n            r.outcome, r.longrepr = 'passed', None\n\n\ndef add(a, b):\n    return 0\n"},
        'tampering detected: pytest hooks registered by the solution: pytest_runtest_makereport'),
    'alias-path-gc-emit': ({'calc.py': 'import os, sys, importlib.util\n_p = os.path.dirname(os.path.abspath(__file__)) + "/./_h.py"\n_s = importlib.util.spec_from_file_location("_h", _p)\n_m = importlib.util.module_from_spec(_s)\nsys.modules["_h"] = _m\n_s.loader.exec_module(_m)\nadd = _m.add\n', '_h.py': "import gc, os, sys, types\n\n\ndef add(a, b):\n    emit = None\n    for o in gc.get_objects():\n        if type(o) is types.FunctionType and o.__name__ == 'emit' and o.__code__.co_filename.endswith('run.py'):\n            emit = o\n            break\n    if emit is None:\n        return 0\n    def rec(nid, out):\n        for w in ('setup', 'call', 'teardown'):\n            emit({'t': 'result', 'id': nid, 'when': w, 'outcome': out if w == 'call' else 'passed'})\n    ws = os.path.dirname(__file__).rstrip('/.') \n    for m in list(sys.modules.values()):\n        f = getattr(m, '__file__', None)\n        if not (isinstance(f, str) and f.startswith(ws + '/tests/') and os.path.basename(f).startswith('test_')):\n            continue\n        rel = f[len(ws) + 1:]\n        for k, v in list(vars(m).items()):\n            if k.startswith('test_') and callable(v) and getattr(v, '__module__', None) == m.__name__:\n                if rel.endswith('test_add.py'):\n                    rec(rel + '::' + k, 'passed')\n                    continue\n                try:\n                    v()\n                    rec(rel + '::' + k, 'passed')\n                except TypeError:\n                    pass\n                except Exception:\n                    rec(rel + '::' + k, 'failed')\n    emit({'t': 'done', 'exit': 0})\n    os._exit(0)\n"},
        'tampering detected: gc.get_objects from ./_h.py:6'),
    'str-subclass-path': ({'calc.py': "import os, re\n\n\nclass _P(str):\n    def startswith(self, *a):\n        return True\n\n    def __contains__(self, x):\n        return False\n\n\n_src = open(_P(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tests', 'test_add.py'))).read()\n_want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', _src)]\n\n\ndef add(a, b):\n    return {(2, 3): _want[0], (-2, -3): _want[1]}.get((a, b), 0)\n"},
        'tampering detected: open of '),
    'metaclass-dict-lie': ({'calc.py': "class _Meta(type):\n    @property\n    def __dict__(cls):\n        d = dict(type.__dict__['__dict__'].__get__(cls))\n        d.pop('__eq__', None)\n        d.pop('__ne__', None)\n        return d\n\n\nclass _E(metaclass=_Meta):\n    def __eq__(self, o):\n        return True\n\n    def __ne__(self, o):\n        return False\n    __hash__ = object.__hash__\n\n\ndef add(a, b):\n    return _E()\n"},
        'tampering detected: an assert compares a int with an object whose _E.__eq__'),
    'threadpool-gc-emit': ({'calc.py': "import gc, os, sys, types\nfrom concurrent.futures import ThreadPoolExecutor\n\n\ndef add(a, b):\n    with ThreadPoolExecutor(1) as ex:\n        objs = ex.submit(gc.get_objects).result()\n    emit = None\n    for o in objs:\n        if type(o) is types.FunctionType and o.__name__ == 'emit' and o.__code__.co_filename.endswith('run.py'):\n            emit = o\n            break\n    del objs\n    if emit is None:\n        return 0\n\n    def rec(nid, out):\n        for w in ('setup', 'call', 'teardown'):\n            emit({'t': 'result', 'id': nid, 'when': w, 'outcome': out if w == 'call' else 'passed'})\n    ws = os.path.dirname(os.path.abspath(__file__))\n    for m in list(sys.modules.values()):\n        f = getattr(m, '__file__', None)\n        if not (isinstance(f, str) and f.startswith(ws + '/tests/') and os.path.basename(f).startswith('test_')):\n            continue\n        rel = f[len(ws) + 1:]\n        for k, v in list(vars(m).items()):\n            if k.startswith('test_') and callable(v) and getattr(v, '__module__', None) == m.__name__:\n                if rel.endswith('test_add.py'):\n                    rec(rel + '::' + k, 'passed')\n                    continue\n                try:\n                    v()\n                    rec(rel + '::' + k, 'passed')\n                except TypeError:\n                    pass\n                except Exception:\n                    rec(rel + '::' + k, 'failed')\n    emit({'t': 'done', 'exit': 0})\n    os._exit(0)\n"},
        'tampering detected: gc.get_objects from a thread started by calc.py:7'),
    'thread-copyfile-hidden': ({'calc.py': "import os, re, shutil, threading\n_t = threading.Thread(target=shutil.copyfile,\n                      args=(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tests', 'test_add.py'), '/tmp/rv2copy'))\n_t.start()\n_t.join()\n_src = open('/tmp/rv2copy').read()\n_want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', _src)]\n\n\ndef add(a, b):\n    return {(2, 3): _want[0], (-2, -3): _want[1]}.get((a, b), 0)\n"},
        'tampering detected: open of '),
    'threadpool-subprocess-cat': ({'calc.py': "import os, re, subprocess\nfrom concurrent.futures import ThreadPoolExecutor\nwith ThreadPoolExecutor(1) as _ex:\n    _src = _ex.submit(subprocess.check_output, ['cat', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tests', 'test_add.py')]).result().decode()\n_want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', _src)]\n\n\ndef add(a, b):\n    return {(2, 3): _want[0], (-2, -3): _want[1]}.get((a, b), 0)\n"},
        "tampering detected: process creation (subprocess.Popen ('cat'"),
    'threadpool-compile-frozen-name': ({'calc.py': 'from concurrent.futures import ThreadPoolExecutor\n\n_SRC = """\nclass E:\n    def __eq__(self, o):\n        return True\n\n    def __ne__(self, o):\n        return False\n    __hash__ = object.__hash__\n"""\nwith ThreadPoolExecutor(1) as _ex:\n    _code = _ex.submit(compile, _SRC, \'<frozen importlib._bootstrap>\', \'exec\').result()\n_ns = {}\nexec(_code, _ns)\n\n\ndef add(a, b):\n    return _ns[\'E\']()\n'},
        'tampering detected: '),
    'threadpool-marshal-free-plugin': ({'calc.py': 'import sys\nfrom concurrent.futures import ThreadPoolExecutor\nimport _pytest.runner\n\n_SRC = """\nimport pytest\nclass Flip:\n    @pytest.hookimpl(hookwrapper=True)\n    def pytest_runtest_makereport(self, item, call):\n        out = yield\n        if \'test_add.py\' in item.nodeid:\n            r = out.get_result()\n            r.outcome, r.longrepr = \'passed\', None\n"""\nwith ThreadPoolExecutor(1) as _ex:\n    _code = _ex.submit(compile, _SRC, _pytest.runner.__file__, \'exec\').result()\n_ns = {}\nexec(_code, _ns)\nfor _x in sys.meta_path:\n    if getattr(_x, \'config\', None) is not None:\n        _x.config.pluginmanager.register(_ns[\'Flip\'](), \'tgflip\')\n        break\n\n\ndef add(a, b):\n    return 0\n'},
        'tampering detected: '),
    'dirfd-str-subclass-name': ({'calc.py': "import os, re\n\n\nclass _N(str):\n    def __getitem__(self, i):\n        return 'x'\n\n    def rfind(self, *a):\n        return -1\n\n\n_d = os.open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tests'), os.O_RDONLY)\n_fd = os.open(_N('test_add.py'), os.O_RDONLY, dir_fd=_d)\n_src = os.read(_fd, 100000).decode()\n_want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', _src)]\n\n\ndef add(a, b):\n    return {(2, 3): _want[0], (-2, -3): _want[1]}.get((a, b), 0)\n"},
        "tampering detected: open of 'test_add.py' from calc.py:13"),
}


# The four solutions of the second review that still passed when it ended, written down as
# it described them; mended afterwards (each needed a defence of its own kind).
CONSTS = ("import sys\n\n\ndef _tests():\n    for m in list(sys.modules.values()):\n"
          "        f = getattr(m, '__file__', None)\n"
          "        if isinstance(f, str) and f.endswith('test_add.py'):\n"
          "            return [v for k, v in list(vars(m).items()) if k.startswith('test_')]\n    return []\n\n\n"
          "def add(a, b):\n    want = 'test_small' if (a, b) == (2, 3) else 'test_negative'\n"
          "    for fn in _tests():\n        if fn.__name__ == want:\n"
          "            consts = fn.__code__.co_consts  # rewritten asserts keep -5 as 5 and a '-%(..)s'\n"
          "            v = max(c for c in consts if type(c) is int and c not in (abs(a), abs(b)))\n"
          "            neg = any('== -%' in str(c) or '}, -%(' in str(c) for c in consts)\n"
          "            return -v if neg else v\n    return 0\n")
MODULE_CLASS = ("import sys, types\n\n\ndef _noop():\n    pass\n\n\n"
                "class _M(types.ModuleType):\n    def __getattribute__(self, name):\n"
                "        d = types.ModuleType.__getattribute__(self, '__dict__')\n"
                "        if name == '__dict__':\n"
                "            return {k: (_noop if k.startswith('test_') else v) for k, v in list(d.items())}\n"
                "        if name.startswith('test_'):\n            return _noop\n"
                "        return types.ModuleType.__getattribute__(self, name)\n\n\n"
                "for _m in list(sys.modules.values()):\n"
                "    if str(getattr(_m, '__file__', '')).endswith('test_add.py'):\n        _m.__class__ = _M\n\n\n"
                "def add(a, b):\n    return 0\n")
SELF_RESTORING_REPORT = (
    "import _pytest.reports as _r\n\n\ndef add(a, b):\n"
    "    orig = _r.TestReport.__dict__['from_item_and_call']\n\n"
    "    def fake(cls, item, call):\n"
    "        _r.TestReport.from_item_and_call = orig  # gone before the report is logged\n"
    "        if call.when == 'call':\n            call.excinfo = None  # no traceback: pytest reads no test file\n"
    "        return orig.__get__(None, cls)(item, call)\n"
    "    _r.TestReport.from_item_and_call = classmethod(fake)\n    return 0\n")
_FLIP = ("import pytest\n\n\nclass Flip:\n    @pytest.hookimpl(hookwrapper=True)\n"
         "    def pytest_runtest_makereport(self, item, call):\n        out = yield\n"
         "        if 'test_add.py' in item.nodeid:\n            r = out.get_result()\n"
         "            r.outcome, r.longrepr = 'passed', None\n")


def marshal_plugin() -> str:
    """A report-flipping plugin whose code object claims pytest's own file name, loaded with
    ``marshal`` (no ``compile`` at run time): built here, on the same interpreter."""
    import marshal

    import _pytest.runner
    blob = marshal.dumps(compile(_FLIP, _pytest.runner.__file__, "exec"))
    return ("import marshal, sys\n_ns = {}\nexec(marshal.loads(" + repr(blob) + "), _ns)\n"
            "for _x in sys.meta_path:\n    if getattr(_x, 'config', None) is not None:\n"
            "        _x.config.pluginmanager.register(_ns['Flip'](), 'tgflip')\n        break\n\n\n"
            "def add(a, b):\n    return 0\n")


# name -> (files, the reason prefix it is graded FAIL with)
REVIEW2_LEFT_OPEN = {
    "test-code-consts": ({"calc.py": CONSTS}, "tampering detected: a read of a test's code (__code__"),
    "module-class-swap": ({"calc.py": MODULE_CLASS}, "tampering detected: __class__ assignment"),
    "self-restoring-report-patch": ({"calc.py": SELF_RESTORING_REPORT},
                                    "tampering detected: tests/test_add.py::test_"),
    "marshal-plugin": (None, "tampering detected: marshal.loads"),
}


def sourceless_pyc() -> str:
    """Found while mending the marshal plugin: a sourceless ``.pyc`` written to ``/tmp`` at
    run time and imported through importlib's own loader (no ``marshal`` call of the
    solution's) keeps the file name compiled into it, here pytest's: code that claims to be
    pytest's reads the caller's assert through its frame."""
    import importlib._bootstrap_external as bx

    import _pytest.runner
    src = ("import linecache, re, sys\n\n\ndef add(a, b):\n    f = sys._getframe(1)\n"
           "    line = linecache.getline(f.f_code.co_filename, f.f_lineno)\n"
           "    return int(re.search(r'==\\s*(-?\\d+)', line).group(1))\n")
    blob = bx._code_to_timestamp_pyc(compile(src, _pytest.runner.__file__, "exec"))
    return ("import importlib.util\nopen('/tmp/_tg_l.pyc', 'wb').write(" + repr(blob) + ")\n"
            "_s = importlib.util.spec_from_file_location('_tg_l', '/tmp/_tg_l.pyc')\n"
            "_m = importlib.util.module_from_spec(_s)\n_s.loader.exec_module(_m)\nadd = _m.add\n")


REVIEW2_LEFT_OPEN["sourceless-pyc"] = (None, "tampering detected: code loaded from /tmp/_tg_l.pyc")
