"""An address gate in front of the weight-update group's TCPStore (docs/security.md).

torch's TCPStore has no authentication, and any client may list, read and overwrite its keys
(``list_keys``, ``get``, ``set``): whoever reaches the store while the group forms can read
the members' addresses or claim a rank, and then receive, or send, the weights. The engines
are real SGLang servers, which connect with a plain TCPStore client, so no secret can be
added to the store protocol itself. What can be done at the trainer, which serves the store:

* the store's server listens on loopback only (``master_listen_fd``: a socket bound to
  127.0.0.1 on a free port), and
* :class:`StoreGate` listens on the group's ``master_port`` (all interfaces, as TCPStore
  would) and forwards a connection to it only when its source address is one of the engine
  hosts' (their URLs' host names, resolved); any other connection is closed at once, before
  a byte of the store protocol, and logged with its address.

So a stranger on another host is refused; what the gate does not stop is anyone on an
allowed host (or on the trainer's own host, through loopback), and it does not protect the
data plane (gloo's and NCCL's own sockets, also unauthenticated). With whole-node
allocations (the Slurm scripts ask for ``--exclusive``) the allowed hosts are the job's own.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from typing import Iterable

log = logging.getLogger(__name__)


def resolve_addresses(hosts: Iterable[str]) -> set[str]:
    """Every IP address the host names resolve to (v4 and v6); loopback stays loopback."""
    out: set[str] = set()
    for h in hosts:
        if not h:
            continue
        try:
            out.update(info[4][0] for info in socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP))
        except socket.gaierror as exc:
            raise ValueError(f"weight-update store: cannot resolve engine host {h!r}: {exc}") from None
    if out & {"127.0.0.1", "::1"}:
        out |= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    return out | {f"::ffff:{a}" for a in out if ":" not in a}  # v4 peers on a dual-stack socket


def loopback_listener() -> socket.socket:
    """A listening socket on 127.0.0.1 (free port) for the store's server (master_listen_fd)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(1024)
    return s


class StoreGate:
    """Listens on ``port`` and forwards connections from ``allowed`` addresses to
    ``127.0.0.1:inner_port``; one daemon thread moves the bytes (selectors)."""

    def __init__(self, port: int, inner_port: int, allowed: set[str]):
        self.inner_port, self.allowed = inner_port, set(allowed)
        self.refused: list[str] = []  # source addresses turned away (for error messages)
        self._sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=1024) \
            if socket.has_dualstack_ipv6() else socket.create_server(("", port), backlog=1024)
        self._sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"store-gate-{port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        try:
            conn, addr = self._sock.accept()
        except BlockingIOError:
            return
        if addr[0] not in self.allowed:
            self.refused.append(addr[0])
            log.warning("weight-update store: refused a connection from %s (not an engine host)", addr[0])
            conn.close()
            return
        try:
            inner = socket.create_connection(("127.0.0.1", self.inner_port), timeout=10)
        except OSError as exc:
            log.warning("weight-update store: cannot reach the store (%s); dropping %s", exc, addr[0])
            conn.close()
            return
        for a, b in ((conn, inner), (inner, conn)):
            a.setblocking(False)
            self._sel.register(a, selectors.EVENT_READ, b)

    def _drop(self, *socks: socket.socket) -> None:
        for s in socks:
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            for key, _ in self._sel.select(timeout=0.2):
                if key.data is None:
                    self._accept()
                    continue
                src, dst = key.fileobj, key.data
                try:
                    data = src.recv(1 << 16)
                    if data:
                        dst.setblocking(True)  # store messages are small: a blocking send is brief
                        dst.sendall(data)
                        dst.setblocking(False)
                        continue
                except OSError:
                    pass
                self._drop(src, dst)  # one side closed or failed: close the pair

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()
