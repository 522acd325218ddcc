"""The grading runner's rewriting of the task's test files (part of the runner: bound read-only
into the grading sandbox beside it, loaded by it from there; standard library only), done in
pytest's assertion rewriting of each protected file, before pytest's own:

1. ``==`` / ``!=`` / ``in`` / ``not in`` in ``assert`` statements become calls of the runner's
   comparison (:mod:`grading_equality`). It is not looked up by name where it matters: each
   module-level test function (and method) with an assert gets a keyword-only parameter,
   ``cmp_arg``, whose default is the comparison, bound when the function is defined, and its
   asserts (and those of the functions nested in it, through the closure) call that local;
   the runner checks every such default by identity once the tests are collected. Only
   asserts outside functions (module or class bodies) look up the builtin ``cmp_name``.
2. each module-level statement reports the names it bound, with their values, to the builtin
   ``def_name`` (:func:`record_definitions`): what pytest calls is checked against them.
"""

import ast


def bound_names(stmt) -> list:
    """The names a module-level statement binds for certain once it has run: a ``def``'s,
    a ``class``'s, plain assignment targets and ``from m import n`` names (not ``*``, not
    ``__future__``: nothing may come before a future import)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    targets = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and (not isinstance(stmt, ast.AnnAssign) or stmt.value):
        targets = [stmt.target]
    elif isinstance(stmt, ast.ImportFrom) and stmt.module != "__future__":
        return [a.asname or a.name for a in stmt.names if a.name != "*"]
    out = []
    while targets:
        t = targets.pop()
        if isinstance(t, ast.Name):
            out.append(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            targets.extend(t.elts)
        elif isinstance(t, ast.Starred):
            targets.append(t.value)
    return out


def record_definitions(mod, path: str, def_name: str) -> frozenset:
    """After each module-level statement of a test file, a call of the builtin ``def_name``
    with the file's path, each name the statement bound and its value: what the test file
    itself defined, before any other code can rebind it (the policy's code can run during
    pytest's collection, after the module has run, and swap what an item calls). Returns
    the names recorded."""
    body, names = [], set()
    for stmt in mod.body:
        body.append(stmt)
        for n in bound_names(stmt):
            names.add(n)
            call = ast.Call(ast.Name(def_name, ast.Load()), [ast.Constant(path), ast.Constant(n), ast.Name(n, ast.Load())],
                            [])
            body.append(ast.fix_missing_locations(ast.copy_location(ast.Expr(call), stmt)))
    mod.body = body
    return frozenset(names)


def install(protected, realpath, rewrite, instrumented, cmp_name, cmp_arg, def_name) -> None:
    """Wrap ``rewrite.rewrite_asserts`` (pytest's) so that the test files among ``protected``
    (real paths) are rewritten as above first; ``instrumented[path]`` gets the names each one
    records."""
    CMP_NAME, CMP_ARG = cmp_name, cmp_arg
    ops = {ast.Eq: "==", ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in"}

    class CompareGuard(ast.NodeTransformer):
        def __init__(self, name: str):
            self.name = name

        def visit_Compare(self, node):
            self.generic_visit(node)
            if len(node.ops) != 1 or type(node.ops[0]) not in ops:
                return node
            # An operand the test builds itself in the assert (``pytest.approx(...)``) is the
            # test's own: exempt from the check above.
            made = [isinstance(e, ast.Call) and isinstance(e.func, (ast.Name, ast.Attribute)) and
                    (e.func.id if isinstance(e.func, ast.Name) else e.func.attr) == "approx"
                    for e in (node.left, node.comparators[0])]
            call = ast.Call(ast.Name(self.name, ast.Load()),
                            [ast.Constant(ops[type(node.ops[0])]), node.left, node.comparators[0],
                             ast.Constant(made[0]), ast.Constant(made[1])], [])
            return ast.fix_missing_locations(ast.copy_location(call, node))

    class Guard(ast.NodeTransformer):
        """Asserts inside functions call the function's own ``CMP_ARG`` (a parameter of the
        outermost function, a closure cell in those nested in it); elsewhere the builtin."""
        depth = 0

        def visit_FunctionDef(self, node):
            self.depth += 1
            self.generic_visit(node)
            self.depth -= 1
            if self.depth == 0 and any(isinstance(n, ast.Assert) for n in ast.walk(node)):
                node.args.kwonlyargs.append(ast.copy_location(ast.arg(CMP_ARG), node))
                node.args.kw_defaults.append(ast.copy_location(ast.Name(CMP_NAME, ast.Load()), node))
                ast.fix_missing_locations(node)
            return node

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Lambda(self, node):
            self.depth += 1
            self.generic_visit(node)
            self.depth -= 1
            return node

        def visit_Assert(self, node):
            node.test = CompareGuard(CMP_ARG if self.depth else CMP_NAME).visit(node.test)
            return node

    def rewrite_asserts(mod, source, module_path=None, config=None, _orig=rewrite.rewrite_asserts,
                        _protected=protected, _guard=Guard, _real=realpath, _record=record_definitions,
                        _instrumented=instrumented, _def=def_name):
        if module_path is not None and _real(str(module_path)) in _protected:
            _guard().visit(mod)
            path = _real(str(module_path))
            names = _record(mod, path, _def)
            _instrumented[path] = _instrumented.get(path, frozenset()) | names
        return _orig(mod, source, module_path, config)

    rewrite.rewrite_asserts = rewrite_asserts


__all__ = ["bound_names", "install", "record_definitions"]
