"""The tested side of a grade by calls: runs in the sandbox and serves the tests' calls.

Started as ``python -I -B subject.py CONFIG`` in the graded checkout (read-only). It imports
the task's modules when the tests ask for them and answers each request (import, getattr,
setattr, call, iter, next) with plain data or a handle (:mod:`calls_wire`). Nothing here is
trusted: the tested code runs in this interpreter and may replace any of it. That is the
point of the design: whatever it does, all it can send the tests is data, which they judge
themselves, in another process it cannot reach.

Exceptions go back as the name of the first built-in exception class in their MRO (a
``ValueError`` subclass arrives as ``ValueError``) and a bounded message.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import sys

if __name__ == "__main__":  # a script in the grader's directory, beside its copy of calls_wire
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import calls_wire as wire
else:
    from megatron_tg.agent import calls_wire as wire

MESSAGE_CHARS = 2000


def _builtin_name(exc: BaseException) -> str:
    for cls in type(exc).__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return "Exception"


def serve(req_fd: int, resp_fd: int) -> None:
    objects: list = []

    def handle(obj) -> list:
        objects.append(obj)
        return ["h", len(objects) - 1, type(obj).__name__[:100]]

    def lookup(node: list):
        if len(node) < 2 or type(node[1]) is not int or not 0 <= node[1] < len(objects):
            raise wire.WireError("an unknown handle")
        return objects[node[1]]

    while True:
        try:
            req = wire.receive(req_fd)
        except EOFError:
            return
        try:
            op = req["op"]
            if op == "import":
                mod = importlib.import_module(req["name"])
                out = {"ok": handle(mod), "pkg": hasattr(mod, "__path__")}
            else:
                target = lookup(req["h"])
                if op == "getattr":
                    value = getattr(target, req["name"])
                elif op == "setattr":
                    setattr(target, req["name"], wire.decode(req["value"], lookup))
                    value = None
                elif op == "call":
                    args = wire.decode(req["args"], lookup)
                    kwargs = wire.decode(req["kwargs"], lookup)
                    value = target(*args, **kwargs)
                elif op == "iter":
                    value = iter(target)
                elif op == "next":
                    value = next(target)
                else:
                    raise wire.WireError(f"unknown op {op!r}")
                out = {"ok": wire.encode(value, handle)}
        except BaseException as e:  # noqa: BLE001 -- everything the tested code raises goes back
            if isinstance(e, (KeyboardInterrupt, SystemExit)) and not isinstance(e, Exception):
                name = "Exception"  # never a way to stop the test side's session
            else:
                name = _builtin_name(e)
            try:
                msg = str(e)[:MESSAGE_CHARS]
            except BaseException:  # noqa: BLE001 -- a __str__ that raises
                msg = "(its message could not be read)"
            out = {"raise": name, "msg": msg}
        wire.send(resp_fd, out)


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    sys.path.extend(r for r in cfg["roots"] if r)
    os.chdir(cfg["workspace"])
    serve(cfg["req_fd"], cfg["resp_fd"])


if __name__ == "__main__":
    main()
