"""The grading runner's item checks (part of the runner: bound read-only into the grading
sandbox beside it, loaded by it from there; standard library only): pytest's collected items,
what each is when collection finishes (its class, its test function's code, its module, its
file, its marks, no ``runtest`` of its own), the test modules' globals and the comparison bound
into each test function (see :mod:`grading_equality`), checked before each call pytest is about
to make (``item_problems``), so that an item edited, added or swapped after collection is a
flag; and what pytest is about to call, compared by identity with what the test file bound
(``called_problem``).

Everything here is reachable from the tested code, so its state is bound as default
arguments (reading or rewriting a runner function's ``__defaults__`` is an audited, flagged
event) and kept in tuples.
"""

import functools
import operator
import sys
import types

_fdict = types.FunctionType.__dict__["__dict__"].__get__
_mfunc = types.MethodType.__dict__["__func__"].__get__
_mself = types.MethodType.__dict__["__self__"].__get__
_pfunc = functools.partial.__dict__["func"].__get__


def inner_of(fn, _fn=types.FunctionType, _m=types.MethodType, _partial=functools.partial):
    """What ``fn`` wraps: a bound method's function, a function's ``__wrapped__``
    (``functools.wraps``), a partial's function; None for anything else. Read through the
    types' own descriptors: an attribute lookup on an object of the policy's would run its
    code inside the grader's checks."""
    t = type(fn)
    if t is _m:
        return _mfunc(fn)
    if t is _fn:
        d = _fdict(fn)
        return dict.get(d, "__wrapped__") if isinstance(d, dict) else None
    if t is _partial:
        return _pfunc(fn)
    return None


def _python_items():
    """The item classes pytest makes for a test function of a ``.py`` test file: its own
    ``Function`` and, for ``unittest.TestCase`` methods, ``TestCaseFunction``; exactly these,
    no subclass (a subclass's ``runtest`` decides what "ran" means)."""
    from _pytest.python import Class, Function, Module
    out = [Function]
    parents = [Module, Class]
    try:
        from _pytest.unittest import TestCaseFunction, UnitTestCase
        out.append(TestCaseFunction)
        parents.append(UnitTestCase)
    except ImportError:  # pragma: no cover - every pytest this runs with has them
        pass
    return tuple(out), tuple(parents)


def build(classify, protected, ws, code_of, code_file, norm, checked, cmp_arg, defs):
    """The checks, bound to the runner's view of the run: ``classify(filename)`` says whose
    code a file is; ``code_of(fn)`` reads a function's code without the audit hook judging
    the read; ``checked`` is the comparison every test function must have bound; ``defs``
    what the test files defined (the runner's records, see ``called_problem``)."""
    item_classes, parent_classes = _python_items()

    def kind_problem(item, _classes=item_classes, _parents=parent_classes, _protected=protected, _ws=ws,
                     _norm=norm, _name=type.__dict__["__name__"].__get__):
        """Why an item under a node id of one of the task's ``.py`` test files is not one
        pytest's own collection of that file makes, or None: its class not exactly pytest's
        ``Function`` (or unittest's ``TestCaseFunction``), or a parent that is not exactly a
        ``Module``/``Class`` of pytest's. A swapped item (the seventh review's: a plugin's
        own ``Item``, a ``Function`` subclass whose ``runtest`` does nothing, made during
        collection under the test's node id) is flagged by its class, whatever it does."""
        nodeid = item.nodeid
        head = str.__str__(nodeid).partition("::")[0] if isinstance(nodeid, str) else ""
        files = {_ws + head}
        path = getattr(item, "path", None)
        if path is not None:
            files.add(_norm(str(path)))
        if not any(f in _protected and f.endswith(".py") for f in files):
            return None
        t = type(item)
        if t not in _classes:
            return f"{nodeid!s:.200}: an item of class {_name(t)!s:.60} under a test file's node id"
        p = getattr(item, "parent", None)
        for _ in range(8):
            if p is None or _name(type(p)) in ("Session", "Package", "Dir", "Directory"):
                break
            if type(p) not in _parents:
                return f"{nodeid!s:.200}: its parent is a {_name(type(p))!s:.60}, not pytest's module or class"
            p = getattr(p, "parent", None)
        return None
    def item_problem(item, _module=types.ModuleType, _code_file=code_file, _norm=norm, _protected=protected,
                     _code_of=code_of, _same_as_defined=lambda item: called_problem(item) is None
                     and type(expected_call(item.nodeid)) is tuple, _kind=kind_problem):
        """Why the function pytest is about to call is not the test its file defines, or None:
        an item of another class under a test file's node id, the module's class swapped (it
        hands pytest whatever it likes), or the function's code (through bound methods and
        ``functools.wraps``) not from the item's own test file or another test file, or
        another test's code put under this test's name."""
        bad = _kind(item)
        if bad:
            return bad
        mod = getattr(item, "module", None) if hasattr(item, "originalname") else None
        if mod is None:
            return None  # not a python test function (a doctest, a plugin's own item)
        if type(mod) is not _module:
            return f"{item.nodeid}: its test module is a {type(mod).__name__!s:.60}, not a module"
        fn, own, innermost = item.obj, _norm(str(item.path)), None
        for _ in range(16):
            name = _code_file(fn)
            if name is not None:
                innermost = (_norm(name), fn)
            nxt = inner_of(fn)
            if nxt is None or nxt is fn:
                break
            fn = nxt
        if innermost is None or not (innermost[0] == own or innermost[0] in _protected):
            return f"{item.nodeid}: runs code from {innermost[0] if innermost else 'no file'}, not its test file"
        cname = getattr(_code_of(innermost[1]), "co_name", "")
        if cname != item.originalname and str(cname).startswith("test") and not _same_as_defined(item):
            return f"{item.nodeid}: runs the code of {cname!s:.80}"
        return None


    def test_modules(_modules=sys.modules, _protected=protected, _module=types.ModuleType,
                     _mdict=types.ModuleType.__dict__["__dict__"].__get__):
        """The loaded modules of the task's test files (hidden tests, conftest, test helpers).
        Read through the module type's own descriptor: a lookup would run a policy module's
        ``__getattr__`` inside the check."""
        out = []
        for m in list(_modules.values()):
            if type(m) is not _module:
                continue
            d = _mdict(m)
            f = dict.get(d, "__file__") if type(d) is dict else None
            if type(f) is str and f in _protected:
                out.append(m)
        return out

    def functions_of(d, _fn=types.FunctionType):
        """The plain functions in a namespace and in the classes defined there (methods,
        static and class methods), as (qualified name, function)."""
        for k, v in list(d.items()):
            if type(v) is _fn:
                yield k, v
            elif isinstance(v, type):
                for n, w in list(type.__dict__["__dict__"].__get__(v).items()):
                    w = getattr(w, "__func__", w) if isinstance(w, (staticmethod, classmethod)) else w
                    if type(w) is _fn:
                        yield f"{k}.{n}", w

    def unbound_fn(fn, _code_of=code_of, _checked=checked, _arg=cmp_arg) -> bool:
        """Whether test function ``fn``'s asserts would not call the runner's comparison: the
        default bound when it was defined is another object (a solution that replaced the
        builtin while the test module was being imported, or rewrote the default since)."""
        code = _code_of(fn)
        if code is None:
            return False
        if _arg not in code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]:
            return False
        d = fn.__kwdefaults__
        return type(d) is not dict or d.get(_arg) is not _checked

    def unbound_comparison(m, _unbound=unbound_fn):
        """The test functions (and methods) of module ``m`` not bound to the comparison."""
        return [name for name, fn in functions_of(m.__dict__) if _unbound(fn)]

    def written_by_policy(v, _classify=classify, _fn=types.FunctionType, _m=types.MethodType,
                          _partial=functools.partial, _modules=sys.modules, _code_of=code_of):
        """Whether ``v`` (a value put into a test module's globals) is code the policy wrote:
        a function (bound or in a partial) from its files, or a class whose module is one of
        them. Other objects are data (a test may rebind a global to a mock)."""
        for _ in range(8):
            if type(v) is _m:
                v = v.__func__
            elif type(v) is _partial:
                v = v.func
            else:
                break
        if type(v) is _fn:
            return _classify(_code_of(v).co_filename) == "solution"
        if isinstance(v, type):
            m = _modules.get(str(type.__dict__["__dict__"].__get__(v).get("__module__", "")))
            f = getattr(m, "__file__", None)
            return type(f) is not str or _classify(f) == "solution"
        return False

    def item_state(item, _code_of=code_of):
        """What an item is: its class, its test function's innermost code, its module, its
        path, its marks, and whether it carries a ``runtest`` (or ``obj``) of its own.
        Compared by identity (code objects compare equal by content)."""
        fn = getattr(item, "obj", None)
        for _ in range(16):
            nxt = inner_of(fn)
            if nxt is None or nxt is fn:
                break
            fn = nxt
        own = getattr(item, "__dict__", {})
        return (type(item), _code_of(fn), getattr(item, "module", None), str(getattr(item, "path", "")),
                tuple(getattr(item, "own_markers", ())), "runtest" in own)

    def collected(session, _state=item_state, _modules=test_modules, _unbound=unbound_comparison, _ws=ws):
        """At the end of collection: each item's state by node id, the items list itself,
        each test module's globals, and (flags) test functions not bound to the comparison."""
        items = session.items
        states = {}
        for it in list(items):
            states[it.nodeid] = (it, _state(it))
        mods = tuple((m, dict(m.__dict__)) for m in _modules())
        unbound = [f"{m.__file__[len(_ws):]}: {n}" for m, _ in mods for n in _unbound(m)]
        return (items, tuple(items), states, mods), unbound

    def item_problems(item, session, seen, _state=item_state, _same=operator.is_, _policy=written_by_policy,
                      _ws=ws, _unbound_fn=unbound_fn):
        """Why the item pytest is about to call is not the one collected: the items list
        replaced or changed, the item not collected, its state changed since (function,
        module, marks, a runtest of its own), or a test module's global rebound to code the
        policy wrote."""
        out = []
        if seen is None:
            return out
        items, as_collected, states, mods = seen
        now = session.items
        if now is not items or type(now) is not list:
            out.append(f"pytest's collected items were replaced (by a {type(now).__name__!s:.40})")
        elif len(now) != len(as_collected) or not all(map(_same, now, as_collected)):
            out.append("pytest's collected items were changed after collection")
        fn = getattr(item, "obj", None)
        fn = getattr(fn, "__func__", fn)
        if type(fn) is types.FunctionType and _unbound_fn(fn):  # its bound comparison rewritten in place
            out.append(f"{item.nodeid!s:.200}: the runner's comparison not bound in its test function")
        rec = states.get(item.nodeid)
        if rec is None or rec[0] is not item:
            out.append(f"{item.nodeid!s:.200}: an item pytest did not collect")
        else:
            was, cur = rec[1], _state(item)
            names = ("class", "test function", "module", "path", "marks", "own runtest")
            changed = [n for n, a, b in zip(names, was, cur)
                       if not (a is b or (type(a) in (str, bool) and a == b)
                               or (type(a) is tuple and len(a) == len(b) and all(map(_same, a, b))))]
            if changed:
                out.append(f"{item.nodeid!s:.200}: its {', '.join(changed)} changed after collection")
        for m, before in mods:
            d = m.__dict__
            for k, v in list(d.items()):
                if (k not in before or before[k] is not v) and _policy(v):
                    out.append(f"{m.__file__[len(_ws):]}: {k!s:.60} rebound to the solution's code")
        return out

    defined, classes, instrumented, realpath = defs

    def expected_call(nodeid, _defined=defined, _classes=classes, _instrumented=instrumented, _real=realpath,
                      _ws=ws, _cdict=type.__dict__["__dict__"].__get__, _mro=type.__dict__["__mro__"].__get__,
                      _wrapped=(staticmethod, classmethod),
                      _sfunc=staticmethod.__dict__["__func__"].__get__, _cfunc=classmethod.__dict__["__func__"].__get__):
        """(the class or None, the function) that the item ``nodeid`` names, as its test file
        defined them (the runner's records), or None when the file did not record the name
        (a test made otherwise: ``globals()[name] = ...``, an import), or the string
        ``"unrecorded"`` when the file's code should have recorded it and did not."""
        head = str.__str__(nodeid).partition("[")[0]
        parts = head.split("::")
        if len(parts) < 2:
            return None
        path = _real(_ws + parts[0])
        names = _instrumented.get(path)
        if names is None:
            return None
        ns, cls = _defined.get(path, {}), None
        for i, part in enumerate(parts[1:-1]):
            if i == 0 and part in names and part not in ns:
                return "unrecorded"
            v = ns.get(part)
            rec = _classes.get(id(v)) if issubclass(type(v), type) else None
            if rec is None or rec[0] is not v:
                return None
            cls, ns = v, rec[1]
        last = parts[-1]
        if cls is None:
            if last in names and last not in ns:
                return "unrecorded"
            return (None, ns[last]) if last in ns else None
        for c in _mro(cls):  # a method: where its class (or a base) defines it, as recorded
            if last in _cdict(c):
                rec = _classes.get(id(c))
                if rec is None or rec[0] is not c or last not in rec[1]:
                    return None
                fn = rec[1][last]
                if type(fn) is staticmethod:
                    fn = _sfunc(fn)
                elif type(fn) is classmethod:
                    fn = _cfunc(fn)
                return cls, fn
        return None

    def called_problem(item, _expected=expected_call, _m=types.MethodType):
        """Why what pytest is about to call for ``item`` (``item.obj``) is not the test
        function its file defined under the name the node id gives (a bound method of an
        instance of the item's class, for a method), or None. Decided by identity with the
        object the file's own statement bound, so that neither a wrapper whose
        ``__wrapped__`` is the real test nor another pristine function passes."""
        exp = _expected(item.nodeid)
        if exp is None:
            return None
        if type(exp) is str:
            return f"{item.nodeid!s:.200}: its test file's definition was never recorded"
        cls, fn = exp
        obj = item.obj
        got = _mfunc(obj) if type(obj) is _m else obj
        if got is not fn:
            return f"{item.nodeid!s:.200}: pytest is about to call another object than the test its file defines"
        if cls is not None and type(obj) is _m:
            me = _mself(obj)
            if not (me is cls or type(me) is cls):
                return f"{item.nodeid!s:.200}: its test method is bound to another object than an instance of its class"
        return None

    return types.SimpleNamespace(item_problem=item_problem, collected=collected, item_problems=item_problems,
                                 called_problem=called_problem)


__all__ = ["build", "inner_of"]
