"""A stand-in for SGLang, the sglang-router and the judge in the Slurm tests: ``GET /health``.

Takes the flags slurm/task.sh gives the real servers (``--model-path``/``--model``,
``--port``, ``--worker-urls``, ``--node-rank``, ...) and ignores what it does not need.
On start it writes ``<record>/<port>-rank<r>.json`` (argv, node, CUDA_VISIBLE_DEVICES,
Slurm ids) so a test can check where and with which GPUs each server ran; on SIGTERM it
writes ``<port>-rank<r>.stopped`` and exits 0, so a test can check the teardown reached it.

Modes (``--mode``): ``ok`` serves /health; ``exit`` exits 3 at once (a server that
crashes while loading); ``hang`` answers /health with 503 forever (one that never loads).
Like multi-node SGLang, node ranks > 0 serve nothing and only wait.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", "--model", dest="model")
    ap.add_argument("--served-model-name")
    ap.add_argument("--tp-size", type=int)
    ap.add_argument("--worker-urls", nargs="*", default=[])
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--mode", choices=("ok", "exit", "hang"), default="ok")
    ap.add_argument("--record", default=os.environ.get("FAKE_SERVER_RECORD"))
    args, unknown = ap.parse_known_args()
    stem = f"{args.port}-rank{args.node_rank}"
    record = Path(args.record) if args.record else None
    if record is not None:
        record.mkdir(parents=True, exist_ok=True)
        info = {"argv": sys.argv[1:], "unknown": unknown, "model": args.model, "port": args.port,
                "worker_urls": args.worker_urls, "served_model_name": args.served_model_name,
                "pid": os.getpid(), "node": os.environ.get("SLURMD_NODENAME"),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                **{k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_LOCALID",
                                                  "SLURM_NODEID", "SLURM_RESTART_COUNT")}}
        (record / f"{stem}.json").write_text(json.dumps(info))
    print(f"fake server {stem}: mode {args.mode}, argv {sys.argv[1:]}", flush=True)
    if args.mode == "exit":
        print("fake server: failing on purpose (--mode exit)", flush=True)
        return 3

    stop = threading.Event()

    def on_term(signum, frame):
        if record is not None:
            (record / f"{stem}.stopped").write_text(str(time.time()))
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    if args.node_rank > 0:
        stop.wait()
        return 0

    status = 503 if args.mode == "hang" else 200

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            code = status if self.path == "/health" else 404
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"ok" if code == 200 else b"no")

        def log_message(self, *a):  # keep the server log to what matters
            pass

    server = ThreadingHTTPServer((args.host, args.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"fake server: serving on {args.host}:{args.port}", flush=True)
    stop.wait()
    server.shutdown()
    print("fake server: stopped by SIGTERM", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
