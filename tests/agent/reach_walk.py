"""A solution that walks every object it can reach from the builtins, ``sys.meta_path`` and
``sys.modules`` through edges that raise no audit event (dicts, containers, a function's
``__closure__``, ``__globals__`` and ``__dict__``, bound methods, partials, properties,
instances' ``__dict__`` and slots, class dicts), and lists each function of the grading
runner's (module ``tg_runner_*`` or ``__main__``) that closes over anything. The seventh
review walked ``@tg_def``'s closure to the runner's writer, its flag budget and its
attribution cache; the runner keeps its state in defaults (an audited read) instead.
``SOURCE`` raises at import with what it found: ``REACH visited N`` and one entry per door.
"""

SOURCE = r'''
import sys, builtins, types
def _full(c):
    try:
        c.cell_contents
        return True
    except ValueError:
        return False
def _walk():
    roots = [builtins.__dict__, sys.meta_path, sys.path_hooks, list(sys.modules.values())]
    seen, todo, hits = set(), [(r, "root") for r in roots], []
    n = 0
    while todo and n < 400000:
        o, via = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o)); n += 1
        t = type(o)
        if t in (str, bytes, int, float, bool, type(None), complex):
            continue
        if t is dict:
            todo.extend((v, via) for v in list(o.values())); continue
        if t in (list, tuple, set, frozenset):
            todo.extend((v, via) for v in list(o)); continue
        if t is types.FunctionType:
            mod = o.__module__ or ""
            cl = [c for c in (o.__closure__ or ()) if _full(c)]
            if (mod.startswith(("tg_runner", "__main__")) or "grading" in (o.__qualname__ or "")) and cl:
                hits.append(f"{mod}:{o.__qualname__} cells={[type(c.cell_contents).__name__ for c in cl]} via {via}")
            for c in cl:
                todo.append((c.cell_contents, f"{mod}:{o.__qualname__}"))
            todo.append((o.__globals__, via)); todo.append((o.__dict__, via))
            w = o.__dict__.get("__wrapped__")
            continue
        if t is types.MethodType:
            todo.append((o.__func__, via)); todo.append((o.__self__, via)); continue
        if t is types.ModuleType:
            todo.append((o.__dict__, "module " + o.__name__)); continue
        if isinstance(o, type):
            try:
                todo.append((dict(type.__dict__["__dict__"].__get__(o)), "class " + o.__qualname__))
            except Exception:
                pass
            continue
        for a in ("func", "args", "keywords", "fget", "fset", "__func__", "__self__", "__wrapped__"):
            try:
                v = object.__getattribute__(o, a)
            except Exception:
                continue
            todo.append((v, via))
        try:
            d = object.__getattribute__(o, "__dict__")
            todo.append((d, via + "/" + t.__name__))
        except Exception:
            pass
        for k in getattr(t, "__slots__", ()) if isinstance(getattr(t, "__slots__", ()), (tuple, list)) else ():
            try:
                todo.append((object.__getattribute__(o, k), via))
            except Exception:
                pass
    hits.append(f"visited {n}")
    return hits


raise RuntimeError('REACH ' + ' | '.join(_walk()))
'''
