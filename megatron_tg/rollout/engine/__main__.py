"""Command line: ``python -m megatron_tg.rollout.engine --model DIR --port N``.

Authentication takes SGLang's flags (``--api-key``, ``--admin-api-key``, and ``--config
FILE.yaml`` whose keys are read as flags, e.g. ``api-key: KEY``, so the key stays off the
command line), plus ``--api-key-file`` (a 0600 file, :mod:`megatron_tg.auth`).

``--tp-size N`` is the CPU stand-in for SGLang's per-rank read of
``/update_weights_from_tensor``: N payloads, every one opened and checked bit-identical
(docs/colocated.md)."""

from __future__ import annotations

import argparse
import logging
import os


def merge_config(argv: list[str]) -> list[str]:
    """SGLang 0.5.23's ``--config`` (``utils/server_args_config_parser.py``): a YAML mapping
    of flag names to values becomes flags placed before the command line's, so the command
    line wins; true booleans become bare flags, false ones are dropped, lists repeat values."""
    if "--config" not in argv:
        return argv
    if argv.count("--config") > 1:
        raise SystemExit("engine: Multiple config files specified! Only one allowed.")
    i = argv.index("--config")
    if i == len(argv) - 1:
        raise SystemExit("engine: No config file specified after --config flag!")
    path = argv[i + 1]
    if not path.lower().endswith((".yaml", ".yml")):
        raise SystemExit(f"engine: Config file must be YAML format, got: {os.path.splitext(path)[1]}")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise SystemExit(f"engine: Config file {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise SystemExit("engine: Config file must contain a dictionary at root level")
    extra: list[str] = []
    for key, value in data.items():
        if value is True:
            extra.append(f"--{key}")
        elif value is False:
            continue
        elif isinstance(value, list):
            extra += [f"--{key}", *map(str, value)] if value else []
        else:
            extra += [f"--{key}", str(value)]
    return extra + argv[:i] + argv[i + 2:]


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = merge_config(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(description="Embedded CPU engine with SGLang's HTTP API")
    ap.add_argument("--model", "--model-path", dest="model", required=True, help="HF model directory")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--max-running-requests", type=int, default=64, help="rows in the running batch")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed for requests without sampling_seed")
    ap.add_argument("--weight-version", default="default", help="initial weight version (SGLang's default)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    ap.add_argument("--attn-implementation", default=None, help="e.g. sdpa or eager (default: transformers')")
    ap.add_argument("--sglang-version", default="0.5.23",
                    help="the SGLang release whose weight-update rules the engine enforces")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="record each token's routed experts (SGLang's flag; requests then "
                         "may set return_routed_experts)")
    ap.add_argument("--enable-memory-saver", action="store_true",
                    help="SGLang's: /release_memory_occupation really frees the weights (without it "
                         "release and resume succeed and free nothing)")
    ap.add_argument("--enable-weights-cpu-backup", action="store_true",
                    help="SGLang's: keep a copy of the weights while released, so resume restores "
                         "them (without it they must be rewritten after resume)")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="SGLang's tensor-parallel size, as a CPU stand-in: /server_info reports it "
                         "and /update_weights_from_tensor then takes that many payloads, opens every "
                         "one (each from the trainer process on that rank's GPU), refuses them unless "
                         "they are bit-identical, and loads one; SGLang's rank r opens only entry r. "
                         "The model still runs in this one process")
    ap.add_argument("--api-key", help="SGLang's: requests must carry 'Authorization: Bearer KEY' "
                                       "(/health*, /ready*, /metrics* stay open)")
    ap.add_argument("--admin-api-key", help="SGLang's: the admin endpoints (weight updates, pause, "
                                             "abort, flush) take only this key")
    ap.add_argument("--api-key-file", help="read --api-key from this file (mode 0600) instead")
    ap.add_argument("--log-level", default=os.environ.get("ENGINE_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    if args.tp_size < 1:
        ap.error(f"--tp-size must be at least 1, got {args.tp_size}")
    if args.api_key_file:
        from megatron_tg.auth import SecretError, read_key

        if args.api_key:
            ap.error("give --api-key or --api-key-file, not both")
        try:
            args.api_key = read_key(args.api_key_file)
        except SecretError as exc:
            ap.error(str(exc))
    # Slurm's pre-time-limit warning (SIGUSR1) is signalled to every process of the trainer's
    # step, engines started by rank 0 included; it is the trainer's cue to checkpoint, and the
    # engine must keep serving until the trainer stops it.
    import signal

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
    from megatron_tg.auth import redact_logs

    redact_logs(args.api_key, args.admin_api_key)
    import torch
    from aiohttp import web

    from .server import EngineServer

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    server = EngineServer(
        args.model,
        max_running=args.max_running_requests,
        seed=args.seed,
        weight_version=args.weight_version,
        attn_implementation=args.attn_implementation,
        sglang_version=args.sglang_version,
        enable_return_routed_experts=args.enable_return_routed_experts,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        enable_memory_saver=args.enable_memory_saver,
        enable_weights_cpu_backup=args.enable_weights_cpu_backup,
        tp_size=args.tp_size,
    )
    logging.getLogger(__name__).info("serving %s on http://%s:%d (%s)", args.model, args.host, args.port,
                                     "API key required" if args.api_key or args.admin_api_key else "no API key")
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
