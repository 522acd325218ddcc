"""sglang-router with its API key read from a file, so the key is not on the command line.

    python -m megatron_tg.launch.router --api-key-file FILE [sglang_router.launch_router args ...]

sglang-router 0.3.2 takes the key only as ``--api-key KEY`` (no environment variable, no
config file), and a command line is world-readable in ``ps``. This reads FILE (mode 0600,
:mod:`megatron_tg.auth`) and runs the router in this process with ``--api-key`` added to its
parsed arguments, never to ``sys.argv``; the router then renames the process
``sglang::router``. What the key does there (measured on 0.3.2, tests/rollout/test_router.py):
the router answers 401 to ``/generate`` and ``/workers`` without ``Authorization: Bearer
KEY``, ``/health`` and ``/readiness`` stay open, and workers that require the same key serve
the requests it forwards.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # add_help=False: every other argument belongs to sglang-router, so --help is answered
    # here (ours, then the router's when it is installed) rather than by either parser alone.
    ap = argparse.ArgumentParser(
        prog="python -m megatron_tg.launch.router",
        add_help=False,
        allow_abbrev=False,  # else "--api-key KEY" would be taken for "--api-key-file KEY"
        usage="%(prog)s --api-key-file FILE [sglang_router.launch_router args ...]",
        description="Run sglang-router with its API key read from FILE (mode 0600).",
    )
    ap.add_argument("--api-key-file", required=True, help="file holding the job's API key")
    if "-h" in argv or "--help" in argv:
        ap.print_help()
        try:
            from sglang_router.launch_router import parse_router_args
        except ImportError:
            print("\n(sglang-router is not installed here: pip install -e '.[gpu]')")
            return 0
        print("\nsglang-router arguments:")
        try:
            parse_router_args(["--help"])
        except SystemExit:
            pass
        return 0
    a, rest = ap.parse_known_args(argv)
    if any(x == "--api-key" or x.startswith("--api-key=") for x in rest):
        print("megatron_tg.launch.router: give the key by --api-key-file only", file=sys.stderr)
        return 2
    from megatron_tg.auth import SecretError, read_key

    try:
        key = read_key(a.api_key_file)
    except SecretError as exc:
        print(f"megatron_tg.launch.router: {exc}", file=sys.stderr)
        return 2
    from sglang_router.launch_router import launch_router, parse_router_args

    launch_router(parse_router_args([*rest, "--api-key", key]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
