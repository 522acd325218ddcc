"""The hidden tests served to pytest from memory, inside the grading sandbox.

The host writes each hidden Python test file (the task's hidden files, the required tests'
files, the canaries) on disk only as a stub that holds none of its source, and sends the
sources, with the nonce, through a pipe (:func:`read_key`). The runner reads the pipe to its
end and closes it before any workspace code runs, compiles every source the way pytest would
(assert rewriting, the runner's equality guard included) and drops the text
(:func:`install`); pytest then loads these modules from the compiled code:

* a module pytest rewrites (a test file, ``conftest.py``) through its assertion rewriter's
  ``_rewrite_test`` (and never from a cached ``.pyc``);
* any other module (a hidden ``__init__.py`` or helper) through a meta-path finder that
  hands the import system the compiled code.

So no route from the tested code to the disk (``open``, a directory descriptor, a link, a
finalizer made of C callables, a child process) reaches a hidden test's source: only the
stub is there, and the pipe is drained and closed. Standard library and pytest only, like
the runner it is bound beside.
"""

import ast
import importlib.machinery
import importlib.util
import json
import os
import sys

STUB = "# served to the test run from the grader's memory: this file's source is not on disk\n"


def read_key(fd: int) -> tuple[str, dict[str, bytes], frozenset]:
    """The nonce, ``{absolute path: source}`` and the paths pytest rewrites, from the host's
    key pipe (read to its end, then closed): the nonce's line, then one JSON object
    ``{path: [source, rewritten]}``."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    head, _, body = b"".join(chunks).partition(b"\n")
    del chunks
    served = json.loads(body) if body else {}
    del body
    sources = {path: text.encode("utf-8") for path, (text, _) in served.items()}
    rewritten = frozenset(path for path, (_, rw) in served.items() if rw)
    served.clear()
    return head.decode(), sources, rewritten


def compile_served(sources: dict[str, bytes], rewritten: frozenset, rewrite) -> dict[str, object]:
    """``{path: (source hash, code) | the exception compiling raised}``, compiled as pytest
    would: a file pytest rewrites through ``rewrite.rewrite_asserts`` (the runner's equality
    guard wrapped around it; no config: the grader's ini keeps the assertion-pass hook off,
    which is what a config would say), any other as plain source. ``sources`` is emptied."""
    out: dict[str, object] = {}
    for path in list(sources):
        src = sources.pop(path)
        try:
            if path in rewritten:
                tree = ast.parse(src, filename=path)
                rewrite.rewrite_asserts(tree, src, path, None)
                code = compile(tree, path, "exec", dont_inherit=True)
            else:
                code = compile(src, path, "exec", dont_inherit=True)
            out[path] = (importlib.util.source_hash(src), code)
        except Exception as e:  # pytest reports it as the module's collection error, as from disk
            out[path] = e
        del src
    return out


def install(sources: dict[str, bytes], rewritten: frozenset, rewrite) -> None:
    """Compile the served sources (emptying ``sources``) and make pytest and the import
    system load those modules from the compiled code, each once (its entry is dropped when
    it is loaded). Called before any workspace code runs and before the runner's audit hook
    is installed (the compiles are the runner's own). The compiled code is held only in the
    defaults of the functions below (a read of this runner's defaults is flagged), never in
    an attribute the tested code could reach through ``sys.meta_path`` or a loader."""
    codes = compile_served(sources, rewritten, rewrite)
    names = set()
    for path in codes:
        base = os.path.basename(path)[:-3]
        names.add(os.path.basename(os.path.dirname(path)) if base == "__init__" else base)

    def take(path, _codes=codes, _real=os.path.realpath, _fspath=os.fspath) -> object:
        """The compiled entry for ``path`` (as a loader names it), removed; or None."""
        if not _codes:
            return None
        p = _fspath(path)
        hit = _codes.pop(p, None)
        if hit is None:
            hit = _codes.pop(_real(p), None)
        if isinstance(hit, BaseException):
            raise hit
        return hit

    def served(path, _codes=codes, _real=os.path.realpath, _fspath=os.fspath) -> bool:
        if not _codes:
            return False
        p = _fspath(path)
        return p in _codes or _real(p) in _codes

    class ServedLoader(importlib.machinery.SourceFileLoader):
        """A source loader whose code is the one compiled from the served source (the file
        on disk is a stub)."""

        def get_code(self, fullname, _take=take):
            hit = _take(self.path)
            return super().get_code(fullname) if hit is None else hit[1]

    class ServedFinder:
        """Finds a served module that pytest does not rewrite (a hidden package's
        ``__init__.py``, a helper) where the path finder would, and loads it with the served
        code. Asked only about the names of served files: every other import passes at once."""

        @staticmethod
        def find_spec(name, path=None, target=None, _names=frozenset(names), _served=served,
                      _find=importlib.machinery.PathFinder.find_spec, _loader=ServedLoader,
                      _at=importlib.util.spec_from_file_location):
            last = name.rpartition(".")[2]
            if last not in _names:
                return None
            spec = _find(name, path, target)
            if spec is None and path:
                # pytest's importlib mode asks for a package with the package's own directory
                # as the path (and falls back to the file, from disk, when no finder has it)
                for d in path:
                    init = os.path.join(d, "__init__.py") if isinstance(d, str) else ""
                    if os.path.basename(d) == last and _served(init):
                        return _at(name, init, loader=_loader(name, init), submodule_search_locations=[d])
            if spec is None or spec.origin is None or not _served(spec.origin):
                return None
            spec.loader = _loader(name, spec.origin)
            return spec

        @staticmethod
        def invalidate_caches():
            pass

    def _rewrite_test(fn, config, _orig=rewrite._rewrite_test, _take=take):
        hit = _take(fn)
        return _orig(fn, config) if hit is None else hit

    def _read_pyc(source, pyc, trace=lambda x: None, _orig=rewrite._read_pyc, _served=served):
        if _served(source):
            return None  # a cached pyc beside a stub is never the served source's
        return _orig(source, pyc, trace)

    rewrite._rewrite_test, rewrite._read_pyc = _rewrite_test, _read_pyc
    sys.meta_path.insert(0, ServedFinder)


__all__ = ["STUB", "compile_served", "install", "read_key"]
