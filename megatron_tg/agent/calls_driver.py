"""The test side of a grade by calls: pytest on the pristine tests, the tested code elsewhere.

Each grade's test side is a fork of a zygote the grader starts once (``python -I -B
driver.py --serve FD``, :func:`serve`), outside the sandbox, run in a directory holding only
the task's test support from the pristine source (hidden tests, conftest, helpers). No code of the policy's runs in this interpreter: importing one of the
task's modules (a top-level name the *pristine* checkout defines, and that this interpreter
cannot import itself) gives a proxy module whose attributes are fetched from the sandboxed
tested side (:mod:`calls_subject`) through a pipe. What comes back is plain data, which the
tests compare with their own ``==``, or a :class:`Remote` handle, which can be called, read
and written, and iterated, but equals only itself and has no truth value, length or hash
of its own. Names that start with ``_`` or that pytest reads (``pytestmark``) are never
asked of the tested side: collection and assertion rewriting cannot be steered from there.

Arguments go by value (a list the test passes is copied; the test's own list is not
changed). Records go, with the grader's nonce, to a file in the grader's private directory,
in the format :func:`megatron_tg.agent.grading_verdict.verdict` reads.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import types

if __name__ == "__main__":  # a script in the grader's directory, beside its copy of calls_wire
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import calls_wire as wire
else:
    from megatron_tg.agent import calls_wire as wire

_REFUSED = frozenset({"pytestmark"})
MESSAGE_CHARS = 2000
"""Characters of an exception's message kept from the tested side (pytest prints each in full
in its report: a 16 MiB message per call made the test side's output hundreds of MB)."""
# Exceptions that end a loop quietly where the test calls the tested code through map(),
# zip() or a generator: from a call they arrive as RemoteError, so a call cannot cut a
# comparison short (only the "next" of an iterator may stop one).
_STOPS = frozenset({"StopIteration", "StopAsyncIteration"})


class RemoteError(Exception):
    """The tested side raised something that is not a built-in exception, or the channel
    failed (timed out, closed, sent a malformed frame)."""


class _Channel:
    def __init__(self, req_fd: int, resp_fd: int, deadline: float):
        self.req_fd, self.resp_fd, self.deadline, self.dead = req_fd, resp_fd, deadline, None

    def ask(self, **req):
        if self.dead:
            raise RemoteError(f"the tested code is unreachable ({self.dead})")
        try:
            wire.send(self.req_fd, req)
            resp = wire.receive(self.resp_fd, self.deadline)
        except (OSError, EOFError, TimeoutError, wire.WireError) as e:
            self.dead = f"{type(e).__name__}: {e}"
            raise RemoteError(f"the tested code is unreachable ({self.dead})") from None
        if type(resp) is not dict:
            self._die("a response that is not an object")
        if "raise" in resp:
            name, msg = resp.get("raise"), resp.get("msg")
            if type(name) is not str or type(msg) is not str:
                self._die("a malformed exception")
            cls = getattr(builtins, name, None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)) or (name in _STOPS and req["op"] != "next"):
                cls = RemoteError
            raise cls(msg[:MESSAGE_CHARS])
        if "ok" not in resp:
            self._die("a response without a value")
        try:
            return wire.decode(resp["ok"], self._handle, self.deadline), resp
        except wire.WireError as e:
            self._die(str(e))
        except TimeoutError as e:
            self.dead = str(e)
            raise RemoteError(f"the tested code is unreachable ({e})") from None

    def _die(self, why: str):
        self.dead = why
        raise RemoteError(f"the tested code sent {why}")

    def _handle(self, node: list) -> "Remote":
        if len(node) != 3 or type(node[1]) is not int or type(node[2]) is not str:
            raise wire.WireError("a malformed handle")
        return Remote._make(self, node[1], node[2][:100])


CHANNEL: _Channel | None = None


class Remote:
    """An object of the tested code, held on its side."""

    __slots__ = ("_tg_channel", "_tg_id", "_tg_type")

    @classmethod
    def _make(cls, channel: _Channel, hid: int, tname: str) -> "Remote":
        obj = object.__new__(cls)
        object.__setattr__(obj, "_tg_channel", channel)
        object.__setattr__(obj, "_tg_id", hid)
        object.__setattr__(obj, "_tg_type", tname)
        return obj

    def _tg_node(self) -> list:
        return ["h", self._tg_id]

    def __getattr__(self, name: str):
        if name.startswith("_") or name in _REFUSED:
            raise AttributeError(name)
        return self._tg_channel.ask(op="getattr", h=self._tg_node(), name=name)[0]

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_") or name in _REFUSED:
            raise AttributeError(f"{name}: not set on the tested code's objects by the grader")
        self._tg_channel.ask(op="setattr", h=self._tg_node(), name=name, value=_encode(value))

    def __call__(self, *args, **kwargs):
        return self._tg_channel.ask(op="call", h=self._tg_node(), args=_encode(list(args)),
                                    kwargs=_encode(dict(kwargs)))[0]

    def __iter__(self):
        it = self._tg_channel.ask(op="iter", h=self._tg_node())[0]
        if not isinstance(it, Remote):
            raise TypeError("the tested code's iterator is not an object")
        return _RemoteIterator(it)

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__

    def __bool__(self):
        raise TypeError(f"an object of the tested code ({self._tg_type}) has no truth value here: "
                        "return a bool")

    def __repr__(self) -> str:
        return f"<the tested code's {self._tg_type!r} object>"


class _RemoteIterator:
    def __init__(self, remote: Remote):
        self.remote = remote

    def __iter__(self):
        return self

    def __next__(self):
        return self.remote._tg_channel.ask(op="next", h=self.remote._tg_node())[0]


def _encode(value):
    def handle(v):
        if isinstance(v, Remote):
            return v._tg_node()
        raise TypeError(f"a {type(v).__name__} cannot be passed to the tested code (plain data and its own "
                        "objects only)")
    return wire.encode(value, handle)


class _ProxyModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("_") or name in _REFUSED:
            raise AttributeError(name)
        remote = self.__dict__["_tg_remote"]
        return remote._tg_channel.ask(op="getattr", h=remote._tg_node(), name=name)[0]


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Appended last to ``sys.meta_path``: only what nothing else here can import, and only
    names under the pristine checkout's own top-level modules."""

    def __init__(self, tops: frozenset[str]):
        self.tops = tops

    def find_spec(self, name, path=None, target=None):
        if name.split(".", 1)[0] not in self.tops or CHANNEL is None:
            return None
        try:
            remote, resp = CHANNEL.ask(op="import", name=name)
        except ImportError:
            return None
        if not isinstance(remote, Remote):
            raise ImportError(f"{name}: the tested side did not give a module")
        spec = importlib.machinery.ModuleSpec(name, self, is_package=resp.get("pkg") is True)
        spec._tg_remote = remote
        return spec

    def create_module(self, spec):
        mod = _ProxyModule(spec.name)
        mod.__dict__["_tg_remote"] = spec._tg_remote
        return mod

    def exec_module(self, module):
        pass


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the zygote dies (the grader killed mid-grade: the zygote reads the end of
    its socket and exits): a test side is not in the sandbox's pid namespace, so nothing else
    would end it."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def run_grade(cfg: dict) -> None:
    """One grade's test side: pytest on ``cfg``'s tests, records to its report."""
    global CHANNEL
    nonce = cfg["nonce"]
    out = open(cfg["report"], "a", buffering=1)

    def emit(rec: dict) -> None:
        out.write(f"{nonce} {json.dumps(rec)}\n")

    CHANNEL = _Channel(cfg["req_fd"], cfg["resp_fd"], time.monotonic() + cfg["timeout_s"])
    sys.meta_path.append(_Finder(frozenset(cfg["modules"])))
    sys.path.extend(os.path.join(cfg["tests"], r) for r in cfg["roots"])
    import pytest

    class Recorder:
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_logreport(self, report):
            outcome = "error" if report.failed and report.when != "call" else report.outcome
            emit({"t": "result", "id": report.nodeid, "when": report.when, "outcome": outcome})

        @pytest.hookimpl(tryfirst=True)
        def pytest_collectreport(self, report):
            if report.failed:
                emit({"t": "result", "id": report.nodeid, "when": "collect", "outcome": "error"})

    code = pytest.main(cfg["pytest_args"], plugins=[Recorder()])
    emit({"t": "done", "exit": int(code)})
    out.close()
    os.close(cfg["req_fd"])  # the tested side sees the end of its requests and exits


def serve(sock_fd: int) -> None:
    """The test sides' zygote: pytest imported once, then one fork per grade (a grade's test
    side starts in milliseconds instead of importing pytest again: about 0.13 s of the 0.2 s
    a grade cost). Each request is the grade's config (JSON) with three descriptors: the
    request pipe's write end, the response pipe's read end, the output pipe's write end; the
    answer is the child's pid. The child runs :func:`run_grade` and exits; it dies with the
    zygote, which dies with the grader (parent-death signals), and the zygote ends when the
    grader closes its socket."""
    import signal
    import socket

    import pytest  # noqa: F401 -- what pytest.main loads, loaded once here
    from _pytest.config import default_plugins

    for name in default_plugins:
        __import__(f"_pytest.{name}")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
    sock = socket.socket(fileno=sock_fd)
    zygote = os.getpid()
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not msg:
            return
        cfg = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()
                _die_with_parent(zygote)
                req_w, resp_r, out_w = fds
                os.dup2(out_w, 1)
                os.dup2(out_w, 2)
                os.close(out_w)
                os.chdir(cfg["tests"])
                run_grade({**cfg, "req_fd": req_w, "resp_fd": resp_r})
                sys.stdout.flush()
                os._exit(0)
            except BaseException:  # noqa: BLE001 -- a child never returns into the zygote's loop
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"pid": pid}).encode())


def main() -> None:
    """``driver.py --serve FD``: the zygote on the socket ``FD`` (the grader's way)."""
    if len(sys.argv) != 3 or sys.argv[1] != "--serve":
        raise SystemExit("usage: driver.py --serve SOCKET_FD")
    serve(int(sys.argv[2]))


if __name__ == "__main__":
    main()
