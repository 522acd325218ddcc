"""The grading runner's namespace checks (part of the runner: bound read-only into the grading
sandbox beside it, loaded by it from there; standard library only): the namespaces (module and
class dicts) of builtins, pytest, ``_pytest``, pluggy, a few stdlib modules the runner relies
on and the runner's own, snapshotted before any workspace code runs and compared as each test
phase is reported (:func:`build`'s ``compare``), with the pytest hooks the policy wrote, the
runner's comparison shadowed in a test module's globals and a trace or profile function set.
pytest's items are checked by :mod:`grading_items`.

Everything here is reachable from the tested code, so its state is bound as default
arguments (reading or rewriting a runner function's ``__defaults__`` is an audited, flagged
event) and kept in tuples.
"""

import builtins
import itertools
import operator
import sys
import types

ROOT_NAMES = ("pytest", "_pytest", "pluggy")
MAX_MODULES = 20_000  # an honest run loads a few thousand; the check before each record walks them all
RUNNER_PREFIX = "tg_runner_"  # the runner's sibling modules, as run.py registers them
WATCHED_STDLIB = frozenset({"os", "posixpath", "json", "json.encoder", "ast", "threading", "subprocess",
                            "_posixsubprocess", "_signal", "signal", "_imp", "warnings", "linecache"})
# Rebound by pytest itself during a run (its state, not code).
VOLATILE = {"_pytest.assertion.util": ("_reprcompare", "_assertion_pass", "_config"), "builtins": ("_",),
            "threading": ("excepthook",), "_pytest.config.Config": ("_getini_unknown_type",),
            "_pytest.debugging.pytestPDB": ("_config", "_pluginmanager", "_saved", "_recursive_debug",
                                            "_wrapped_pdb_cls"),
            # warnings.catch_warnings (pytest's, around each test) rebinds these and puts back
            # the originals when it leaves
            "warnings": ("filters", "showwarning", "_showwarnmsg_impl")}
# A warning issued from a module creates that module's registry of warnings already shown
# (pytest's PytestReturnNotNoneWarning creates _pytest.python's): state, not a patch.
VOLATILE_ANYWHERE = frozenset({"_pytest_diamond_inheritance_warning_shown", "__warningregistry__"})


def build(classify, protected, ws, cmp_name):
    """The checks, bound to the runner's view of the run: ``classify(filename)`` says whose
    code a file is; ``cmp_name`` is the builtin the rewritten asserts outside functions call."""
    # ---- the namespaces the policy must not patch: (name, module, dict, keys, values, class),
    # immutable, so the per-test check reachable through pytest cannot be fed a new baseline.
    # The values themselves are kept (alive), and compared by identity (``operator.is_``, at
    # C speed): ``id()`` is an audited event (``builtins.id``), so a map over ``id`` ran this
    # file's audit hook once per name, which tripled the check's cost; and an id compared
    # later could be the address of a new object put where a freed original was.
    def snapshot():
        out = []
        # The runner's own modules too (``__main__`` and its siblings): their code looks its
        # builtins and helpers up by name when it writes a record, so a name put into their
        # globals (a ``str`` that answers "passed") would change what they write.
        mods = [builtins] + [m for n, m in list(sys.modules.items())
                             if m is not None and (n.split(".")[0] in ROOT_NAMES or n in WATCHED_STDLIB
                                                   or n == "__main__" or n.startswith(RUNNER_PREFIX))]
        for m in mods:
            d = getattr(m, "__dict__", None)
            if d is None:
                continue
            out.append((m.__name__, m, d, tuple(d), tuple(d.values()), None))
            for k, v in list(d.items()):
                if isinstance(v, type) and getattr(v, "__module__", None) == m.__name__:
                    cd = v.__dict__
                    out.append((f"{m.__name__}.{k}", None, cd, tuple(cd), tuple(cd.values()), v))
        return tuple(out)

    def library_class(t, _classify=classify, _modules=sys.modules, _cdict=type.__dict__["__dict__"].__get__,
                             _mdict=types.ModuleType.__dict__["__dict__"].__get__, _module=types.ModuleType) -> bool:
        """Whether class ``t`` is a library's (a module subclass: importlib's lazy modules, a
        package's own; a class typing puts in sys.modules): its class dict's ``__module__``
        names a loaded module whose file is not the policy's."""
        m = _modules.get(_cdict(t).get("__module__"))  # a mappingproxy: its own C get
        if not isinstance(m, _module):
            return False
        f = dict.get(_mdict(m), "__file__")
        return isinstance(f, str) and _classify(str.__str__(f)) != "solution"

    def odd_entry(t, _lib=library_class, _cdict=type.__dict__["__dict__"].__get__,
                  _mro=type.__dict__["__mro__"].__get__, _fn=types.FunctionType, _heap=1 << 9) -> bool:
        """Whether objects of class ``t`` (found in sys.modules) answer attribute lookups with
        code of the policy's or with C callables put on a class made at run time."""
        for c in _mro(t):
            if not c.__flags__ & _heap:
                continue  # a static C type's own slots
            if not _lib(c):
                return True
            d = _cdict(c)
            for special in ("__getattr__", "__getattribute__"):
                v = d.get(special)
                if v is not None and type(v) is not _fn:
                    return True
        return False

    def foreign_hooks(config, _classify=classify, _known=set(), _fn=types.FunctionType, _m=types.MethodType):
        """pytest hooks whose code the policy wrote (a plugin it registered, or one of ours
        whose function it replaced). A plain function or a bound method of one, once found
        clean, is not looked at again (``in`` on such objects compares by identity; reading
        every hook's ``__code__`` at every phase was a third of this check's cost)."""
        out = []
        for name, caller in list(vars(config.pluginmanager.hook).items()):
            for impl in getattr(caller, "get_hookimpls", lambda: [])():
                f = impl.function
                plain = type(f) is _fn or (type(f) is _m and type(f.__func__) is _fn)
                if plain and f in _known:
                    continue
                fn = getattr(f, "__code__", None)
                if fn is None or _classify(fn.co_filename) == "solution":
                    out.append(name)
                elif plain:
                    _known.add(f)
        return out

    def state_of(entries, _modules=sys.modules, _values=operator.methodcaller("values"),
                 _chain=itertools.chain.from_iterable):
        """What the detailed comparison below looks at in ``entries`` (their dicts' keys and
        values, their modules in ``sys.modules``), as flat tuples."""
        dicts = tuple(e[2] for e in entries)
        return (tuple(map(len, dicts)), tuple(_chain(dicts)), tuple(_chain(map(_values, dicts))),
                tuple(map(_modules.get, [e[0] for e in entries])))

    def same_state(a, b, _is=operator.is_) -> bool:
        return a[0] == b[0] and all(map(_is, a[1], b[1])) and all(map(_is, a[2], b[2])) and all(map(_is, a[3], b[3]))

    def changes(entries, where, _audit=sys.audit, _volatile=VOLATILE, _modules=sys.modules, _module=types.ModuleType,
                _any_volatile=VOLATILE_ANYWHERE, _is=operator.is_) -> bool:
        """Flag what in ``entries`` changed since the snapshot; whether anything was."""
        found = False
        for name, mod, d, keys, vals, cls in entries:
            changed = []
            if mod is not None and name != "builtins" and name in _modules and _modules[name] is not mod:
                changed.append("(the module in sys.modules)")
            if len(d) != len(keys) or not all(map(_is, d, keys)) or not all(map(_is, d.values(), vals)):
                was = dict(zip(keys, vals))
                now = dict(d)
                skip = _volatile.get(name, ())
                for k in set(was) | set(now):
                    if (k in was and k in now and was[k] is now[k]) or k in skip or k in _any_volatile:
                        continue
                    if k not in was and (isinstance(d.get(k), _module) if cls is None else not (
                            k.startswith("__") or any(k in b.__dict__ for b in cls.__mro__[1:]))):
                        continue  # a new name nothing looked up before (pytest adds some; so does an import)
                    changed.append(k)
            if changed:
                found = True
                _audit("tg.flag", f"{name}: {', '.join(sorted(changed)[:5])} patched ({where})")
        return found

    def compare(before, where, config=None, _audit=sys.audit, _volatile=VOLATILE, _modules=sys.modules,
                _hooks=foreign_hooks, _protected=protected, _ws=ws, _changes=changes, _state=state_of,
                _same=same_state, _last=[None], _cmp=cmp_name, _gettrace=sys.gettrace, _getprofile=sys.getprofile,
                _module=types.ModuleType, _mdict=types.ModuleType.__dict__["__dict__"].__get__,
                _max_modules=MAX_MODULES, _fn=types.FunctionType, _tname=type.__dict__["__qualname__"].__get__,
                _libclass=library_class, _odd_entry=odd_entry):
        """Flag what changed since ``before``. Most of it (the namespaces pytest does not rebind
        itself) is compared as one flat state, at C speed, with the last state found clean:
        only where that differs is each namespace looked at in detail (an import adds names,
        which are no patch; the detail is always against ``before``, so a state found clean is
        clean whatever it was compared with). The names pytest rebinds are always detailed.
        A trace or profile function set on this thread (pytest sets none) sees every frame of
        the tests and can rewrite their locals (3.11 writes a tracer's ``f_locals`` back):
        flagged whoever installed it, which may have been done with no frame of the policy's
        on the stack (a C callable run by pytest's collection)."""
        if _gettrace() is not None or _getprofile() is not None:
            _audit("tg.flag", f"a trace or profile function is set ({where})")
        if len(_modules) > _max_modules:  # a check per record over every module: bounded
            _audit("tg.flag", f"{len(_modules)} modules loaded (more than {_max_modules}) ({where})")
        for name, m in list(_modules.items())[:_max_modules]:
            # Read through ModuleType's own __dict__ descriptor, never by attribute lookup: a
            # module the policy put in sys.modules answers a lookup of a missing __file__ with
            # its own __getattr__, run here with only the runner's frames on the stack (the
            # tenth review's frame capture). Library code walks sys.modules the same way
            # (inspect.getmodule, from pytest's traceback rendering), so a module whose
            # __getattr__ or __dir__ is not a plain function, or an entry that is no module,
            # is flagged: its lookups run C callables under whichever code asks.
            if not isinstance(m, _module):
                # typing puts classes there (typing.io); a class of the policy's, or one whose
                # attribute lookup is not a plain function, answers as the module above would
                if m is not None and _odd_entry(type(m)):
                    _audit("tg.flag", f"sys.modules[{str(name)[:60]!r}] is a {_tname(type(m))!s:.60}, not a module, "
                                      f"whose attribute lookup is the solution's ({where})")
                continue
            if type(m) is not _module and not _libclass(type(m)):
                _audit("tg.flag", f"sys.modules[{str(name)[:60]!r}] is of a module class the solution made ({where})")
                continue
            d = _mdict(m)
            if type(d) is not dict:
                continue
            for special in ("__getattr__", "__dir__"):
                v = dict.get(d, special)
                if v is not None and type(v) is not _fn:
                    _audit("tg.flag", f"sys.modules[{str(name)[:60]!r}].{special} is a {_tname(type(v))!s:.60}, "
                                      f"not a function: a lookup would run it with no frame of its own ({where})")
            f = dict.get(d, "__file__")
            if type(f) is str and f in _protected and _cmp in d:
                _audit("tg.flag", f"the runner's comparison shadowed in {f[len(_ws):]}'s globals ({where})")
        if config is not None:
            bad = _hooks(config)
            if bad:
                _audit("tg.flag", f"pytest hooks registered by the solution: {', '.join(sorted(set(bad))[:5])} ({where})")
        _changes(tuple(e for e in before if e[0] in _volatile), where)
        steady = tuple(e for e in before if e[0] not in _volatile)
        try:
            now = _state(steady)
        except RuntimeError:  # a namespace changed size while it was read (another thread)
            now = None
        if now is not None and _last[0] is not None and _last[0][0] is before and _same(now, _last[0][1]):
            return
        if not _changes(steady, where) and now is not None:
            _last[0] = (before, now)

    return types.SimpleNamespace(snapshot=snapshot, compare=compare)


__all__ = ["MAX_MODULES", "ROOT_NAMES", "RUNNER_PREFIX", "VOLATILE", "VOLATILE_ANYWHERE", "WATCHED_STDLIB", "build"]
