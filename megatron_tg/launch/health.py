"""One round of ``GET <url>/health`` probes, for the batch script's wait loop.

    python -m megatron_tg.launch.health [--timeout 5] URL [URL ...]

Prints each URL whose ``/health`` answered 2xx, one per line, and exits 0 either way: the
caller owns the deadline and the failure message (it knows the role, host and log), this
only answers "which are up now". Probes run in parallel so one hung server costs one
timeout, not one per server. SGLang, the sglang-router, the embedded CPU engine and the
test's fake server all answer ``/health`` with 200 once they can serve.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence


def healthy(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (OSError, urllib.error.URLError, ValueError):  # refused, reset, timeout, 5xx
        return False


def probe(urls: Sequence[str], timeout: float = 5.0) -> list[str]:
    """The URLs among ``urls`` that are healthy now, in their given order."""
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(urls))) as pool:
        ok = list(pool.map(lambda u: healthy(u, timeout), urls))
    return [u for u, good in zip(urls, ok) if good]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tg.launch.health", description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds per probe")
    ap.add_argument("urls", nargs="*")
    args = ap.parse_args(argv)
    for url in probe(args.urls, args.timeout):
        print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
