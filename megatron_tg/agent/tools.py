"""The agent's tools: specs (given to the model through the chat template's ``tools``) and
their implementations over one rollout's workspace.

File tools run here, in Python, confined to the workspace: every path is resolved (symlinks
included) and must stay inside it, so a link the agent planted with ``ln -s /etc/passwd x``
cannot be read or written through. Commands (``run_shell``, ``run_tests``) run in the
:class:`~megatron_tg.agent.sandbox.Sandbox`. No tool raises: every failure, including a
malformed call, becomes the text the agent sees in the tool response.

``search`` is the paper's §5.1 example: a code search over the task's files returning the
best-matching lines; its NEW optional argument ``lines`` sets how many (default
``search_default_lines``). The ranking is lexical (identifier-aware term overlap weighted by
rarity), a stand-in for an embedding search with the same interface.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_tg.agent.sandbox import Limits, Sandbox

MAX_SEARCH_LINES = 100
MAX_FILE_BYTES = 1 << 20  # files larger than this are not read or searched
MAX_LIST_ENTRIES = 200


def _fn(name: str, description: str, props: dict[str, dict], required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required}}}


def tool_specs(search_default_lines: int = 5) -> list[dict[str, Any]]:
    """OpenAI-style function specs; the chat template renders them into the system prompt."""
    s = {"type": "string"}
    return [
        _fn("read_file", "Read a text file of the workspace.",
            {"path": {**s, "description": "File path, relative to the workspace."}}, ["path"]),
        _fn("list_dir", "List a directory of the workspace (directories end with /).",
            {"path": {**s, "description": "Directory path; default: the workspace root."}}, []),
        _fn("write_file", "Create or overwrite a file with the given content.",
            {"path": {**s, "description": "File path."}, "content": {**s, "description": "The full new content."}},
            ["path", "content"]),
        _fn("edit_file", "Replace one exact occurrence of old_string with new_string in a file.",
            {"path": {**s, "description": "File path."},
             "old_string": {**s, "description": "Text to replace; must occur exactly once."},
             "new_string": {**s, "description": "Replacement text."}}, ["path", "old_string", "new_string"]),
        _fn("run_shell", "Run a shell command in the workspace (no network; time and memory limits).",
            {"command": {**s, "description": "The command, run with /bin/sh -c."}}, ["command"]),
        _fn("run_tests", "Run the task's visible tests.", {}, []),
        _fn("search", "Semantic code search over the workspace files: returns the best-matching lines "
            "as path:line: text.",
            {"query": {**s, "description": "What to look for (words, identifiers)."},
             "lines": {"type": "integer",
                       "description": f"Number of lines to return (default {search_default_lines})."}},
            ["query"]),
    ]


def printable(text: str) -> str:
    """Valid UTF-8 text for the tokenizer: a file name that is not valid UTF-8 comes from the
    OS as lone surrogates (surrogateescape), which cannot be encoded; each such byte becomes
    U+FFFD, as the rest of the observation's undecodable bytes do."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogateescape") if _only_escapes(text) else text.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "replace")


def _only_escapes(text: str) -> bool:
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in text)


class ToolError(Exception):
    """A tool call that cannot be carried out; its message is the observation."""


def _regular(p: Path, shown: str) -> None:
    # A FIFO the agent made with mkfifo would block open() forever; devices are never files.
    if not p.is_file():
        raise ToolError(f"{shown} is not a regular file")


@dataclass
class ToolResult:
    name: str
    output: str
    ok: bool
    meta: dict[str, Any] = field(default_factory=dict)


class Tools:
    """The tools bound to one workspace (one rollout)."""

    def __init__(self, workspace: str | os.PathLike, sandbox: Sandbox, *, test_command: str | None = None,
                 search_default_lines: int = 5, max_output_chars: int = 8192,
                 shell_limits: Limits | None = None):
        self.root = Path(os.path.realpath(workspace))
        self.sandbox = sandbox
        self.test_command = test_command
        self.search_default_lines = search_default_lines
        self.max_output_chars = max_output_chars
        self.shell_limits = shell_limits
        self.specs = tool_specs(search_default_lines)
        self._schemas = {s["function"]["name"]: s["function"]["parameters"] for s in self.specs}

    # ------------------------------------------------------------------ dispatch
    async def call(self, name: str, arguments: dict[str, str]) -> ToolResult:
        try:
            args = self._typed(name, arguments)
            out = await getattr(self, f"_tool_{name}")(**args)
            ok = True
            if isinstance(out, tuple):
                out, ok = out
            return ToolResult(name, self._cap(printable(out)), ok)
        except ToolError as e:
            return ToolResult(name, printable(f"Error: {e}"), False, {"error": printable(str(e))})
        except OSError as e:  # permissions, a directory given as file, ...
            return ToolResult(name, printable(f"Error: {e.strerror or e}"), False, {"error": printable(repr(e))})

    def _typed(self, name: str, arguments: dict[str, str]) -> dict[str, Any]:
        """Check the call against the tool's schema; type its raw string values."""
        schema = self._schemas.get(name)
        if schema is None:
            raise ToolError(f"unknown tool {name!r}; available tools: {', '.join(self._schemas)}")
        props = schema["properties"]
        unknown = [k for k in arguments if k not in props]
        if unknown:
            raise ToolError(f"{name}: unknown parameter(s) {unknown}; parameters: {list(props) or 'none'}")
        missing = [k for k in schema["required"] if k not in arguments]
        if missing:
            raise ToolError(f"{name}: missing required parameter(s) {missing}")
        out: dict[str, Any] = {}
        for k, v in arguments.items():
            if props[k].get("type") == "integer":
                try:
                    out[k] = int(str(v).strip())
                except ValueError:
                    raise ToolError(f"{name}: parameter {k!r} must be an integer, got {v!r}") from None
            else:
                out[k] = v
        return out

    def _cap(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n[truncated: {len(text)} characters in total]"

    def _path(self, rel: str, *, must_exist: bool = True) -> Path:
        """Resolve ``rel`` inside the workspace, following symlinks; refuse escapes."""
        if not isinstance(rel, str) or not rel.strip() or "\x00" in rel:
            raise ToolError(f"invalid path {rel!r}")
        rel = rel.strip()
        p = Path(os.path.realpath(self.root / rel))
        if p != self.root and self.root not in p.parents:
            raise ToolError(f"path {rel!r} is outside the workspace")
        if must_exist and not p.exists():
            raise ToolError(f"{rel}: no such file or directory")
        return p

    # ------------------------------------------------------------------ file tools
    async def _tool_read_file(self, path: str) -> str:
        p = self._path(path)
        if p.is_dir():
            raise ToolError(f"{path} is a directory (use list_dir)")
        _regular(p, path)
        if p.stat().st_size > MAX_FILE_BYTES:
            raise ToolError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
        return p.read_bytes().decode("utf-8", errors="replace")

    async def _tool_list_dir(self, path: str = ".") -> str:
        p = self._path(path or ".")
        if not p.is_dir():
            raise ToolError(f"{path} is not a directory")
        entries = sorted(e.name + ("/" if e.is_dir() and not e.is_symlink() else "") for e in p.iterdir())
        more = len(entries) - MAX_LIST_ENTRIES
        body = "\n".join(entries[:MAX_LIST_ENTRIES]) + (f"\n[{more} more entries]" if more > 0 else "")
        return body or "(empty directory)"

    async def _tool_write_file(self, path: str, content: str) -> str:
        p = self._path(path, must_exist=False)
        if p.is_dir():
            raise ToolError(f"{path} is a directory")
        if p.exists():
            _regular(p, path)
        new_dirs = [d for d in reversed(p.parents) if self.root in d.parents and not d.exists()]
        p.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode("utf-8")
        p.write_bytes(data)
        for d in new_dirs + [p]:  # what we create must stay writable by sandboxed commands
            self.sandbox.adopt(d, self.root)
        return f"Wrote {len(data)} bytes to {path}"

    async def _tool_edit_file(self, path: str, old_string: str, new_string: str) -> str:
        p = self._path(path)
        if p.is_dir():
            raise ToolError(f"{path} is a directory")
        _regular(p, path)
        text = p.read_bytes().decode("utf-8", errors="replace")
        if not old_string:
            raise ToolError("old_string must not be empty")
        n = text.count(old_string)
        if n != 1:
            raise ToolError(f"old_string occurs {n} times in {path}; it must occur exactly once"
                            + (" (include more surrounding text)" if n > 1 else ""))
        p.write_text(text.replace(old_string, new_string, 1), encoding="utf-8")
        return f"Edited {path}"

    # ------------------------------------------------------------------ commands
    async def _tool_run_shell(self, command: str):
        if not command.strip():
            raise ToolError("empty command")
        res = await self.sandbox.run(command, self.root, self.shell_limits)
        return res.describe(), res.ok

    async def _tool_run_tests(self):
        if not self.test_command:
            raise ToolError("this task has no visible tests")
        res = await self.sandbox.run(self.test_command, self.root, self.shell_limits)
        return res.describe(), res.ok

    # ------------------------------------------------------------------ search
    async def _tool_search(self, query: str, lines: int | None = None) -> str:
        n = self.search_default_lines if lines is None else lines
        if not 1 <= n <= MAX_SEARCH_LINES:
            raise ToolError(f"search: lines must be between 1 and {MAX_SEARCH_LINES}, got {n}")
        hits = await asyncio.to_thread(search_lines, self.root, query, n)  # big repos: off the loop
        if not hits:
            return f"No matches for {query!r}."
        return "\n".join(f"{path}:{no}: {text}" for _, path, no, text in hits)


_DEFINITION = re.compile(r"\s*(async\s+def|def|class)\s")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def terms(text: str) -> list[str]:
    """Identifier-aware terms: ``parseHTTPHeader_v2`` -> parse, http, header, v, 2 (and the
    whole identifier), lower-cased, with a crude plural strip."""
    out = []
    for ident in re.findall(r"[A-Za-z0-9_]+", text):
        parts = [w.lower() for w in _WORD.findall(ident)]
        out += parts
        if len(parts) > 1:
            out.append(ident.lower())
    return [w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w for w in out]


def _text_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            p = Path(dirpath, f)
            if f.startswith(".") or p.is_symlink() or not p.is_file():  # skip links, FIFOs, devices
                continue
            try:
                if p.stat().st_size <= MAX_FILE_BYTES:
                    files.append(p)
            except OSError:
                continue
        if len(files) > 2000:
            break
    return files


def search_lines(root: Path, query: str, n: int) -> list[tuple[float, str, int, str]]:
    """Top-``n`` lines by summed inverse-document-frequency of the query terms they contain
    (lines as documents; bonuses for an exact phrase match and for def/class lines). Ties:
    path, then line order."""
    q = set(terms(query))
    if not q:
        return []
    docs: list[tuple[str, int, str, set[str]]] = []
    for p in _text_files(root):
        try:
            text = p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # binary or unreadable
        rel = p.relative_to(root).as_posix()
        for no, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                docs.append((rel, no, line, set(terms(line))))
    df = Counter(t for *_, ts in docs for t in ts & q)
    idf = {t: math.log(1 + len(docs) / (1 + df[t])) for t in q}
    phrase = query.strip().lower()
    scored = []
    for rel, no, line, ts in docs:
        hit = ts & q
        s = sum(idf[t] for t in hit)
        if s > 0:
            if phrase and phrase in line.lower():
                s += max(idf.values())
            if _DEFINITION.match(line):
                s *= 1.5  # where a matching name is defined beats where it is used
            s += 0.1 * len(hit) / len(ts)  # tie-break: lines that are mostly about the query
            scored.append((-s, rel, no, line.rstrip()[:300]))
    scored.sort()
    return [(-s, rel, no, line) for s, rel, no, line in scored[:n]]
