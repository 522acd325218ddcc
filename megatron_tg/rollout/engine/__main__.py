"""Command line: ``python -m megatron_tg.rollout.engine --model DIR --port N``."""

from __future__ import annotations

import argparse
import logging
import os


def main(argv: list[str] | None = None) -> None:
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
    ap.add_argument("--log-level", default=os.environ.get("ENGINE_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    # Slurm's pre-time-limit warning (SIGUSR1) is signalled to every process of the trainer's
    # step, engines started by rank 0 included; it is the trainer's cue to checkpoint, and the
    # engine must keep serving until the trainer stops it.
    import signal

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
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
    )
    logging.getLogger(__name__).info("serving %s on http://%s:%d", args.model, args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
