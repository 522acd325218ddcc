"""The job's shared secret: one random key per job guards every HTTP server of the run (the
rollout service, the engines, the router, the judge) and is what the client side sends
(docs/security.md).

The key lives in a file only its owner can read (mode 0600 in a 0700 directory). It is passed
by file name, never by value: command lines are world-readable in ``ps``, and a path in a log,
a manifest or the saved config gives nothing away. Files are refused when group or others
can read them, as ssh refuses a private key.

Server side, :func:`decide` is SGLang 0.5.23's rule (``sglang/srt/utils/auth.py``:
``decide_request_auth``): ``Authorization: Bearer <key>``, compared in constant time;
``OPTIONS`` and paths starting with ``/health``, ``/ready`` or ``/metrics`` are open (probes
without secrets); a refused request gets 401 ``{"error": "Unauthorized"}``. With an admin key,
SGLang's admin endpoints take only that key.

    python -m megatron_tg.auth new DIR           write DIR/api_key and DIR/sglang_auth.yaml
    python -m megatron_tg.auth redact --key-file F   copy stdin to stdout, the key replaced
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import secrets
import stat
import sys
from pathlib import Path
from typing import Iterable, Optional

KEY_FILE_ENV = "TG_API_KEY_FILE"
"""Environment variable naming the key file (set by slurm/lib.sh for every step)."""
KEY_NAME = "api_key"
SGLANG_CONFIG_NAME = "sglang_auth.yaml"
"""SGLang's ``--config`` YAML holding ``api-key``: the way to give SGLang its key off argv."""
MIN_KEY_CHARS = 16
REDACTED = "<redacted>"
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang's probe paths, open with a key set


class SecretError(ValueError):
    """A key file that is missing, unreadable, too open or malformed (the message says which)."""


def new_key() -> str:
    """256 random bits, URL-safe (43 characters): no quoting needed in YAML or headers."""
    return secrets.token_urlsafe(32)


def _write_private(path: Path, text: str) -> None:
    # Created 0600 from the start (no window where it is readable) and renamed into place,
    # so a reader sees the old file or the whole new one.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_key_dir(directory: str | os.PathLike) -> tuple[Path, Path]:
    """Make ``directory`` (0700) with a fresh key in ``api_key`` and SGLang's ``--config``
    file ``sglang_auth.yaml`` (both 0600); returns their paths. A key already there is
    replaced: every job start (a requeue too) gets a new one."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SecretError(f"{d}: not a directory owned by this user; refusing to put the job key there")
    os.chmod(d, 0o700)
    key = new_key()
    key_path, yaml_path = d / KEY_NAME, d / SGLANG_CONFIG_NAME
    _write_private(key_path, key + "\n")
    _write_private(yaml_path, f"api-key: {key}\n")
    return key_path, yaml_path


def read_key(path: str | os.PathLike) -> str:
    """The key in ``path``; a clear :class:`SecretError` when it cannot be used."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SecretError(f"API key file {p}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"API key file {p}: not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(f"API key file {p}: readable by group or others (mode {st.st_mode & 0o777:o}); "
                              f"chmod 600 it (the key guards every server of the job)")
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        key = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise SecretError(f"API key file {p}: not ASCII text") from None
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise SecretError(f"API key file {p}: expected one word of at least {MIN_KEY_CHARS} characters "
                          f"(python -m megatron_tg.auth new DIR writes one); got {len(key)} characters")
    return key


def resolve_key(path: Optional[str]) -> Optional[str]:
    """The key of ``path``, else of ``$TG_API_KEY_FILE``, else None (no authentication)."""
    path = path or os.environ.get(KEY_FILE_ENV) or None
    return read_key(path) if path else None


def bearer(key: Optional[str]) -> dict[str, str]:
    """The request header carrying ``key`` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def bearer_matches(header: Optional[str], key: str) -> bool:
    """SGLang's check: "<scheme> <token>" with scheme "bearer" (any case), the token compared
    in constant time (as bytes: a non-ASCII header is a mismatch, not an error)."""
    if not header:
        return False
    parts = header.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return hmac.compare_digest(parts[1].encode("utf-8", "surrogateescape"), key.encode())


def decide(method: str, path: str, header: Optional[str], api_key: Optional[str],
           admin_api_key: Optional[str] = None, admin: bool = False) -> int:
    """The HTTP status a request gets before its handler: 0 = let it through, else 401
    (or 403: an admin-only endpoint on a server without an admin key; SGLang's ADMIN_FORCE,
    which none of the endpoints here are). ``admin``: the endpoint is one of SGLang's
    ADMIN_OPTIONAL ones (weight updates, pause, abort, flush, ...)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return 0
    if admin and admin_api_key:
        return 0 if bearer_matches(header, admin_api_key) else 401
    if api_key:
        return 0 if bearer_matches(header, api_key) else 401
    return 0


def aiohttp_middleware(api_key: Optional[str], admin_api_key: Optional[str] = None,
                       admin_paths: Iterable[str] = ()):
    """An aiohttp middleware enforcing :func:`decide` (``admin_paths``: the ADMIN_OPTIONAL
    routes); the 401/403 body is SGLang's."""
    from aiohttp import web

    admin = frozenset(admin_paths)

    @web.middleware
    async def auth(request: web.Request, handler):
        status = decide(request.method, request.path, request.headers.get("Authorization"),
                        api_key, admin_api_key, admin=request.path in admin)
        if status:
            return web.json_response({"error": "Unauthorized" if status == 401 else "Forbidden"}, status=status)
        return await handler(request)

    return auth


class RedactFilter(logging.Filter):
    """Replaces the key in every record it sees (the formatted message), so an exception text
    or a library's debug line that happens to contain it is logged as ``<redacted>``."""

    def __init__(self, *secrets_: str) -> None:
        super().__init__()
        self.secrets = [s for s in secrets_ if s]

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if any(s in msg for s in self.secrets):
            for s in self.secrets:
                msg = msg.replace(s, REDACTED)
            record.msg, record.args = msg, None
        return True


def redact_logs(*secrets_: str) -> None:
    """Install :class:`RedactFilter` on every handler of the root logger (call after
    ``logging.basicConfig``); filters on handlers see records of every logger."""
    f = RedactFilter(*secrets_)
    for h in logging.getLogger().handlers:
        h.addFilter(f)


def redact_stream(key: str, src, dst) -> None:
    """Copy ``src`` to ``dst`` line by line with ``key`` replaced (binary streams). For the
    logs of servers that print their own arguments (SGLang logs ``server_args=`` with its
    ``api_key`` at startup)."""
    k, r = key.encode(), REDACTED.encode()
    for line in iter(src.readline, b""):
        dst.write(line.replace(k, r))
        dst.flush()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tg.auth", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("new", help="write a fresh key to DIR/api_key and DIR/sglang_auth.yaml (0600)")
    n.add_argument("dir")
    r = sub.add_parser("redact", help="copy stdin to stdout with the key replaced by <redacted>")
    r.add_argument("--key-file", required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "new":
            for p in write_key_dir(a.dir):
                print(p)  # the paths only: the key is never printed
            return 0
        key = read_key(a.key_file)
        import signal

        # The server beside this filter is the one Slurm's signals are for: keep copying its
        # output until it closes it (EOF), so its last lines are logged.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        redact_stream(key, sys.stdin.buffer, sys.stdout.buffer)
    except SecretError as exc:
        print(f"megatron_tg.auth: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
