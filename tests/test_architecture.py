"""The import structure of ``megatron_tg/``: no module imports another in a circle, and every
import follows the layer order of ``docs/architecture.md`` (parsed from its ``layers`` block,
so the document and this test cannot drift apart).

Imports are read from the source (``ast``), not by importing it: top-level and function-local
``import`` / ``from ... import``, ``importlib.import_module("literal")`` and
``__import__("literal")``; those under ``if TYPE_CHECKING:`` are kept apart. An import of
``a.b.c`` is an edge to the module ``a.b.c`` (or, for ``from a.b import c`` where ``c`` is not a
module, to ``a.b``); the package ``__init__`` files Python runs on the way are not edges. A child
importing its own parent package (``from . import x`` inside a package) is no circle.

``python tests/test_architecture.py [ROOT]`` prints the circles and the layer violations it
finds, and the package's size (packages, modules, lines, the modules over 400 lines); ROOT is a
directory holding a ``megatron_tg/`` (default: this checkout), e.g. an older commit's tree from
``git archive``.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_tg"
DOC = ROOT / "docs" / "architecture.md"


@dataclass
class ImportGraph:
    modules: dict[str, Path]
    runtime: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    type_only: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def combined(self) -> dict[str, set[str]]:
        return {m: self.runtime.get(m, set()) | self.type_only.get(m, set()) for m in self.modules}


def find_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _dynamic_import(node: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("x")`` / ``import_module("x")`` /
    ``__import__("x")``; None for anything else (a name built at run time is not read)."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imports_of(source: str, module: str, is_package: bool) -> tuple[set[str], set[str]]:
    """(runtime, TYPE_CHECKING-only) absolute names a module's source imports: ``a.b`` for
    ``import a.b``, ``a.b.c`` for ``from a.b import c`` (``c`` a module or a name in ``a.b``)."""
    runtime: set[str] = set()
    type_only: set[str] = set()
    here = module.split(".") if is_package else module.split(".")[:-1]

    def relative(level: int, name: str | None) -> str:
        base = here[:len(here) - (level - 1)] if level > 1 else here
        return ".".join(base + ([name] if name else []))

    def visit(node: ast.AST, tc: bool) -> None:
        out = type_only if tc else runtime
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, tc)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = relative(node.level, node.module) if node.level else node.module
            out.update(base if a.name == "*" else f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call):
            name = _dynamic_import(node)
            if name is not None:
                out.add(relative(len(name) - len(name.lstrip(".")), name.lstrip(".") or None)
                        if name.startswith(".") else name)
        for child in ast.iter_child_nodes(node):
            visit(child, tc)

    visit(ast.parse(source), False)
    return runtime, type_only


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def build_graph(root: Path = ROOT, package: str = PACKAGE) -> ImportGraph:
    modules = find_modules(root, package)
    graph = ImportGraph(modules)
    for mod, path in modules.items():
        runtime, type_only = imports_of(path.read_text(), mod, path.name == "__init__.py")
        for names, edges in ((runtime, graph.runtime), (type_only, graph.type_only)):
            # the longest module a name starts with: ``a.b.c`` if that is a module, else ``a.b``
            edges[mod] |= {t for t in (_resolve(n, modules) for n in names) if t is not None and t != mod}
    return graph


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module, ignoring a
    child's import of its own parent package."""
    edges = {a: {b for b in bs if not a.startswith(b + ".")} for a, bs in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def read_layers(doc: Path = DOC) -> list[list[str]]:
    """The ``layers`` block of the architecture document: one line per layer, lowest first,
    entries separated by spaces."""
    m = re.search(r"^```layers\n(.*?)^```", doc.read_text(), re.S | re.M)
    assert m, f"{doc.name}: no ```layers block"
    return [line.split() for line in m.group(1).splitlines() if line.strip()]


def layer_of(module: str, layers: list[list[str]], package: str = PACKAGE) -> tuple[int, str] | None:
    """(line, entry) of the longest entry naming ``module`` or a package above it."""
    best = None
    for i, line in enumerate(layers):
        for entry in line:
            full = f"{package}.{entry}"
            if module == full or module.startswith(full + "."):
                if best is None or len(entry) > len(best[1]):
                    best = (i, entry)
    return best


def layer_violations(edges: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    bad = []
    for a in sorted(edges):
        la = layer_of(a, layers)
        for b in sorted(edges[a]):
            lb = layer_of(b, layers)
            if la is None or lb is None or la[1] == lb[1]:
                continue
            if lb[0] >= la[0]:
                bad.append(f"{a} ({la[1]}, line {la[0] + 1}) imports {b} ({lb[1]}, line {lb[0] + 1})")
    return bad


# ---- the tests -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _graph() -> ImportGraph:
    return build_graph()


def test_the_reader_sees_local_dynamic_and_type_only_imports():
    src = '''
import os
from typing import TYPE_CHECKING
import importlib
from . import sibling
from ..other import thing
if TYPE_CHECKING:
    from megatron_tg.x import T
else:
    import megatron_tg.y
def f():
    from megatron_tg.z import g
    importlib.import_module("megatron_tg.dyn")
    __import__("megatron_tg.dunder")
    importlib.import_module(name_built_at_run_time)
'''
    runtime, type_only = imports_of(src, "megatron_tg.pkg.mod", is_package=False)
    assert {"megatron_tg.pkg.sibling", "megatron_tg.other.thing", "megatron_tg.y", "megatron_tg.z.g",
            "megatron_tg.dyn", "megatron_tg.dunder", "os"} <= runtime
    assert type_only == {"megatron_tg.x.T"}
    # a child importing its parent package is no circle; a -> b -> c -> a is
    assert circles({"a": {"b", "a.k"}, "b": {"c"}, "c": {"a"}, "a.k": {"a"}}) == [["a", "b", "c"]]


def test_no_runtime_import_circle():
    found = circles(_graph().runtime)
    assert not found, f"{len(found)} runtime import circle(s): {found}"


def test_no_import_circle_counting_type_checking_imports():
    found = circles(_graph().combined())
    assert not found, f"{len(found)} import circle(s) with TYPE_CHECKING imports: {found}"


def test_every_module_has_a_layer_and_every_entry_names_modules():
    graph, layers = _graph(), read_layers()
    entries = [e for line in layers for e in line]
    assert len(entries) == len(set(entries)), f"an entry is listed twice: {entries}"
    assert not [m for m in graph.modules if m != PACKAGE and layer_of(m, layers) is None]
    assert not [e for e in entries if not any(
        m == f"{PACKAGE}.{e}" or m.startswith(f"{PACKAGE}.{e}.") for m in graph.modules)]


def test_imports_follow_the_documented_layer_order():
    bad = layer_violations(_graph().combined(), read_layers())
    assert not bad, "imports against docs/architecture.md's layer order:\n" + "\n".join(bad)


def test_the_weight_path_does_not_import_the_embedded_engine():
    graph = _graph().combined()
    for mod in ("rollout.client", "rollout.server_pool", "rollout.generation", "rollout.responses",
                "rollout.weight_client", "rollout.transport", "weight_sync.sync"):
        engine = sorted(t for t in graph.get(f"{PACKAGE}.{mod}", ()) if t.startswith(f"{PACKAGE}.rollout.engine"))
        assert not engine, f"{mod} imports the embedded engine: {engine}"


def test_no_module_calls_another_s_private_client_call():
    """The SGLang client's ``_call`` is its own (and its weight-update subclass's): the rest
    of the project asks through ``SGLangClient.request``."""
    owners = {"rollout/client.py", "rollout/weight_client.py"}
    found = []
    for mod, path in find_modules().items():
        rel = path.relative_to(ROOT / PACKAGE.replace(".", "/")).as_posix()
        if rel in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            f = node.func if isinstance(node, ast.Call) else None
            if (isinstance(f, ast.Attribute) and f.attr == "_call" and len(node.args) >= 3  # (url, method, path)
                    and not (isinstance(f.value, ast.Name) and f.value.id == "self")):
                found.append(f"{mod}:{node.lineno}")
    assert not found, f"private client calls outside the client: {found}"


def size_figures(root: Path = ROOT, package: str = PACKAGE, limit: int = 400) -> list[str]:
    """Packages (directories directly under the package), modules, lines, modules over
    ``limit`` lines (largest first)."""
    mods = find_modules(root, package)
    lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    pkgs = sorted(p.name for p in (root / package).iterdir() if (p / "__init__.py").is_file())
    big = sorted(((n, m) for m, n in lines.items() if n > limit), reverse=True)
    return [f"packages: {len(pkgs)} ({', '.join(pkgs)})",
            f"modules: {len(mods)}, {sum(lines.values())} lines",
            f"modules over {limit} lines: {len(big)}" + "".join(f"\n  {n:5d} {m}" for n, m in big)]


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    g = build_graph(root)
    for line in size_figures(root):
        print(line)
    for what, edges in (("runtime", g.runtime), ("runtime + TYPE_CHECKING", g.combined())):
        found = circles(edges)
        print(f"{what}: {len(found)} import circle(s), {sum(map(len, found))} modules")
        for c in found:
            print("  " + " <-> ".join(c))
    bad = layer_violations(g.combined(), read_layers(root / "docs" / "architecture.md")
                           if (root / "docs" / "architecture.md").is_file() else read_layers())
    print(f"layer order: {len(bad)} import(s) against it")
    for line in bad:
        print("  " + line)
