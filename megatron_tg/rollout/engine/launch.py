"""Start embedded CPU engines as subprocesses and wait until they are healthy.

Used by the trainer's CPU default (one or more engines beside the trainer ranks), the
demo, and the tests. Each engine is its own process (``python -m megatron_tg.rollout.engine``)
with its log in ``log_dir``; :meth:`Engine.stop` terminates only that process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from megatron_tg.parallel.ports import free_port


@dataclass
class Engine:
    url: str
    proc: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)
    """The command line it runs (:func:`restart_engine` starts it again, same port)."""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""


def _die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGTERM the engine when the process that
    started it dies, so a crashed or killed trainer never leaves engines behind."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not Linux: rely on Engine.stop()
        pass


def start_engines(model_dirs: list[Path], log_dir: Path, timeout_s: float = 90.0,
                  threads: int = 1, extra_args: Sequence[str] = (),
                  api_key_file: str | None = None) -> list[Engine]:
    """Start engine subprocesses (in parallel) and wait until each answers /health.

    ``extra_args`` go to every engine's command line (e.g. ``--enable-return-routed-experts``);
    ``api_key_file``: every engine requires that file's key (passed by name, never on argv)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", ENGINE_LOG_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    engines = []
    for i, model_dir in enumerate(model_dirs):
        port = free_port()
        log_path = log_dir / f"engine_{port}.log"
        argv = [sys.executable, "-m", "megatron_tg.rollout.engine", "--model", str(model_dir), "--port", str(port),
                "--host", "127.0.0.1", "--threads", str(threads), *extra_args]
        if api_key_file:
            argv += ["--api-key-file", str(api_key_file)]
        engines.append(Engine(f"http://127.0.0.1:{port}", _spawn(argv, log_path, env), log_path, argv))
    _wait_healthy(engines, timeout_s)
    return engines


def _spawn(argv: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, env=env,
                            preexec_fn=_die_with_parent)


def restart_engine(engine: Engine, timeout_s: float = 90.0) -> Engine:
    """A dead engine started again at its URL, on the weights it started with (what a
    cluster's restart of a crashed server does); waits until it is healthy."""
    if engine.proc.poll() is None:
        raise RuntimeError(f"engine {engine.url} is still running (pid {engine.proc.pid})")
    env = dict(os.environ, OMP_NUM_THREADS="1", ENGINE_LOG_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    new = Engine(engine.url, _spawn(engine.argv, engine.log_path, env), engine.log_path, engine.argv)
    _wait_healthy([new], timeout_s)
    return new


def _wait_healthy(engines: list[Engine], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for e in engines:
        while True:
            if e.proc.poll() is not None:
                raise RuntimeError(f"engine {e.url} exited with {e.proc.returncode}:\n{e.log_tail()}")
            try:
                with urllib.request.urlopen(f"{e.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                for x in engines:
                    x.kill()
                raise RuntimeError(f"engine {e.url} not healthy after {timeout_s}s:\n{e.log_tail()}")
            time.sleep(0.2)


