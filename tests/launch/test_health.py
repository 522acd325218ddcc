"""The batch script's /health probe: which servers are up now, in parallel, never raising."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_tg.launch.health import main, probe


def _server(status: int, delay: float = 0.0) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            time.sleep(delay)
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_returns_only_healthy_urls_in_order(capsys):
    up, loading, slow = _server(200), _server(503), _server(200, delay=3)
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in (loading, up, slow)]
    urls.insert(1, f"http://127.0.0.1:{_closed_port()}/")
    t0 = time.monotonic()
    assert probe(urls, timeout=1.0) == [urls[2]]
    assert time.monotonic() - t0 < 2.5  # one timeout for all, not one per server
    assert main(["--timeout", "1", *urls]) == 0
    assert capsys.readouterr().out == urls[2] + "\n"
    for s in (up, loading, slow):
        s.shutdown()


def test_probe_of_nothing_and_of_garbage():
    assert probe([]) == [] and probe(["not a url"]) == []
