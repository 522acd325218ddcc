"""The checks of ``slurm/preflight.sh``: first contact with a cluster, on one node, in minutes.

    python -m megatron_tg.launch.preflight reduce --recipe R --gpus G [k=v ...]   overrides, one per line
    python -m megatron_tg.launch.preflight probe --results F [--seeded] URL ...   engines answer and generate
    python -m megatron_tg.launch.preflight train --results F --run-dir D --ckpt-dir C --steps N URL ...
    python -m megatron_tg.launch.preflight resume --results F --run-dir D --log L --steps N
    python -m megatron_tg.launch.preflight routing --results F --recipe R [k=v ...]
    python -m megatron_tg.launch.preflight nccl --results F --trainer-python P --engine-python Q
    python -m megatron_tg.launch.preflight router --results F --recipe R --cmdline C [k=v ...]
    python -m megatron_tg.launch.preflight table --results F                      exit 1 if a check failed

Each check appends one row (name, PASS/FAIL/SKIP, what it saw) to the results file, a TSV
the batch script also writes to; ``table`` prints them all and names what failed. The
checks read what the real code did (the engines' HTTP answers, the trainer's
metrics.jsonl, its checkpoint directory and log), never what a step claims about itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Sequence

from megatron_tg.auth import resolve_key
from megatron_tg.config import ConfigError, load_config

STATES = ("PASS", "FAIL", "SKIP")
PROBE_PROMPT = [5, 17, 42, 7, 99]
RULE_RUBRIC = "recipes/rubrics/tool_format.yaml"  # rule-based: needs no judge server


def record(results: Path, name: str, state: str, detail: str) -> None:
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
    with open(results, "a") as f:
        f.write(f"{name}\t{state}\t{' '.join(detail.split())}\n")


# ---------------------------------------------------------------------- reduce

def reduce_overrides(recipe: str, gpus: int, overrides: Sequence[str] = (), judge_url: str = "") -> list[str]:
    """Overrides that shrink the recipe's job to ``gpus`` trainer GPUs and one short step.

    Kept from the recipe: TP, CP, PP, expert TP, the model, the engines' TP and flags.
    Reduced: EP to the largest divisor of the recipe's EP whose layout the trainer accepts
    on ``gpus`` ranks; the batch to
    one prompt x 2 rollouts of 64 tokens. A rubric with LLM-judged criteria and no judge
    endpoint is swapped for the rule-based one (the judge server is not part of this check).
    """
    cfg = load_config(recipe, list(overrides))
    p = cfg.parallel
    dense = p.tp * p.cp * p.pp
    if gpus % dense:
        raise ConfigError(f"preflight: the recipe's tp {p.tp} x cp {p.cp} x pp {p.pp} = {dense} ranks do not "
                          f"fit {gpus} trainer GPUs (half the node); override the layout to fit, e.g. parallel.pp=1")
    one_node = [*overrides, "parallel.nodes=1", f"parallel.gpus_per_node={gpus}"]
    ep, last = None, None
    for d in sorted((d for d in range(1, p.ep + 1) if p.ep % d == 0), reverse=True):
        try:  # the trainer's own layout check (sizes, and the model's experts when known)
            load_config(recipe, [*one_node, f"parallel.ep={d}"]).layout(gpus)
        except ConfigError as exc:
            last = exc
            continue
        ep = d
        break
    if ep is None:
        raise ConfigError(f"preflight: no expert-parallel size dividing the recipe's ep={p.ep} fits "
                          f"tp {p.tp} x cp {p.cp} x pp {p.pp} on {gpus} trainer GPUs ({last})")
    out = [f"parallel.ep={ep}", "steps=1", "checkpoint.interval=1", "logging.progress_bar=false",
           "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.buffer_size=1",
           "rollout.max_new_tokens=64", "rollout.max_turns=2", "rollout.max_staleness=0"]
    from megatron_tg.launch.sizing import judge_needed

    if judge_needed(cfg)[0] and not (judge_url or cfg.judge.endpoint):
        out.append(f"judge.rubric={RULE_RUBRIC}")
    return out


# ---------------------------------------------------------------------- engines

async def _probe(urls: Sequence[str], seeded: bool = False) -> list[tuple[str, str, str]]:
    from megatron_tg.rollout.client import SGLangClient, SGLangClientError

    rows = []
    async with SGLangClient(list(urls), max_retries=1, timeout_s=300, api_key=resolve_key(None)) as client:
        try:
            info = await client.get_model_info(strict=True)
            versions = {u: i.get("weight_version") for u, i in info.items()}
            rows.append(("engines answer /model_info", "PASS", f"{len(info)} engine(s), weight versions "
                         f"{sorted(set(map(str, versions.values())))}"))
        except SGLangClientError as exc:
            rows.append(("engines answer /model_info", "FAIL", str(exc)[:400]))
            return rows
        try:
            # one request per engine: least-in-flight balancing sends one to each
            res = await asyncio.gather(*(client.generate(PROBE_PROMPT, {"temperature": 1.0, "max_new_tokens": 8})
                                         for _ in urls))
            ok = all(len(r.output_ids) > 0 and r.output_logprobs and len(r.output_logprobs) == len(r.output_ids)
                     and all(math.isfinite(x) and x <= 0 for x in r.output_logprobs) for r in res)
            rows.append(("generate with log-probs", "PASS" if ok else "FAIL",
                         f"{len(res)} request(s), {sum(len(r.output_ids) for r in res)} tokens, servers "
                         f"{sorted({r.server for r in res})}"))
        except SGLangClientError as exc:
            rows.append(("generate with log-probs", "FAIL", str(exc)[:400]))
            return rows
        # The same seed twice on each engine: SGLang repeats only in deterministic inference.
        name, differ = "seeded sampling repeats", []
        for url in urls:
            async with SGLangClient([url], max_retries=1, timeout_s=300, api_key=resolve_key(None)) as one:
                a, b = [await one.generate(PROBE_PROMPT, {"temperature": 1.0, "max_new_tokens": 16,
                                                          "sampling_seed": 1234}) for _ in range(2)]
            if a.output_ids != b.output_ids:
                differ.append(url)
        # SGLang's /server_info carries its resolved server args, enable_deterministic_inference
        # among them (tests/sglang/test_server_args.py); the embedded engine does not report it.
        flags = {}
        for url in urls:
            try:
                flags[url] = (await client.request(url, "GET", "/server_info")).get("enable_deterministic_inference")
            except (SGLangClientError, AttributeError):
                flags[url] = None
        off = [u for u, f in flags.items() if f is False]
        if seeded and off:
            rows.append((name, "FAIL", f"the recipe is seeded but {off} run without --enable-deterministic-inference "
                         "(their /server_info says so)"))
        elif not differ:
            reported = {str(f) for f in flags.values()}
            rows.append((name, "PASS", f"{len(urls)} engine(s) gave the same 16 tokens for seed 1234 twice; "
                         f"enable_deterministic_inference reported: {', '.join(sorted(reported))}"))
        elif seeded:
            rows.append((name, "FAIL", f"different tokens for the same seed on {differ}: started without "
                         "--enable-deterministic-inference, or not deterministic at this layout"))
        else:
            rows.append((name, "SKIP", f"differs on {differ}; expected: the recipe sets no rollout.sampling_seed, "
                         "so the engines run without deterministic inference"))
    return rows


async def _weight_versions(urls: Sequence[str]) -> dict[str, str]:
    from megatron_tg.rollout.client import SGLangClient

    async with SGLangClient(list(urls), api_key=resolve_key(None)) as client:
        return {u: str(i.get("weight_version")) for u, i in (await client.get_model_info()).items()}


# ---------------------------------------------------------------------- trainer

def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def check_train(run_dir: Path, ckpt_dir: Path, steps: int, urls: Sequence[str]) -> list[tuple[str, str, str]]:
    rows = _metrics(run_dir)
    last = next((r for r in rows if r.get("step") == steps), None)
    out = []
    if last is None:
        out.append(("TG train step", "FAIL", f"no step {steps} in {run_dir}/metrics.jsonl ({len(rows)} rows)"))
    else:
        loss = last.get("loss")
        good = isinstance(loss, (int, float)) and math.isfinite(loss)
        out.append(("TG train step", "PASS" if good else "FAIL",
                    f"step {steps} loss {loss}, {last.get('time/step', float('nan')):.1f} s"))
    synced = bool(last) and last.get("sync/bytes", 0) > 0
    try:
        versions = asyncio.run(_weight_versions(urls)) if urls else {}
    except Exception as exc:  # the engines went away: that is the finding
        versions = {"<engines>": f"unreachable: {exc}"}
    served = bool(versions) and set(versions.values()) == {str(steps)}
    out.append(("weight sync to engines", "PASS" if synced and served else "FAIL",
                f"{last.get('sync/bytes', 0) if last else 0} bytes sent; engines report weight version "
                f"{versions or 'none'} (expected {steps})"))
    latest = ckpt_dir / "latest"
    name = latest.read_text().strip() if latest.exists() else ""
    out.append(("checkpoint save", "PASS" if name == f"step_{steps:08d}" and (ckpt_dir / name).is_dir() else "FAIL",
                f"{latest}: {name or 'missing'}"))
    return out


def check_resume(run_dir: Path, log: Path, steps: int) -> tuple[str, str, str]:
    text = log.read_text() if log.exists() else ""
    resumed = f"resumed from checkpoint step {steps - 1} of {steps}" in text
    logged = [r.get("step") for r in _metrics(run_dir)]
    ok = resumed and logged.count(steps) == 1
    return ("checkpoint load (resume)", "PASS" if ok else "FAIL",
            f"log {'says' if resumed else 'lacks'} 'resumed from checkpoint step {steps - 1}'; steps logged {logged}")


def check_routing(recipe: str, overrides: Sequence[str]) -> tuple[str, str, str]:
    """Routing replay as the trainer will run it: on for an MoE model (``rollout.routing_replay``
    and routed experts in the model), which also makes the plan start every engine with
    ``--enable-return-routed-experts``. A config-level check: the train step above ran with it."""
    cfg = load_config(recipe, list(overrides))
    experts = cfg.model.num_experts()
    if experts == 0:
        return ("routing replay", "SKIP", "dense model: no routers to replay")
    if experts is None and not cfg.is_moe():
        return ("routing replay", "SKIP", f"cannot tell: {cfg.model.hf_config} is not on this "
                "machine and parallel.ep=1")
    if not cfg.rollout.routing_replay:
        return ("routing replay", "FAIL", "rollout.routing_replay=false on an MoE model (the "
                "trainer's routing would differ from the engines')")
    where = f"{experts} experts" if experts else "experts per parallel.ep"
    return ("routing replay", "PASS", f"rollout.routing_replay=true ({where}); engines get "
            "--enable-return-routed-experts")


# ---------------------------------------------------------------------- NCCL, router health

def check_nccl(trainer_python: str, engine_python: str) -> tuple[str, str, str]:
    """Both sides' torch and NCCL versions; FAIL where NCCL would refuse the weight-update group."""
    from megatron_tg.launch import nccl_check

    return ("NCCL versions", *nccl_check.check(nccl_check.side_versions(trainer_python),
                                               nccl_check.side_versions(engine_python)))


def check_router(recipe: str, overrides: Sequence[str], cmdline: str) -> tuple[str, str, str]:
    """The router's health flags against the longest weight-sync pause the recipe allows."""
    import shlex

    from megatron_tg.launch.router_health import check_router_argv

    if not cmdline.strip():
        return ("router health", "SKIP", "no router in this plan (one engine, or rollout.router_url unset)")
    try:
        return ("router health", *check_router_argv(load_config(recipe, list(overrides)), shlex.split(cmdline)))
    except ValueError as exc:
        return ("router health", "FAIL", str(exc))


# ---------------------------------------------------------------------- table

def table(results: Path) -> tuple[str, int]:
    rows = [line.split("\t", 2) for line in results.read_text().splitlines() if line.strip()] if results.exists() else []
    width = max([len(r[0]) for r in rows] + [5])
    lines = [f"{'check':{width}}  result  detail"] + [f"{n:{width}}  {s:6}  {d}" for n, s, d in rows]
    failed = [n for n, s, _ in rows if s == "FAIL"]
    if not rows:
        failed = ["<no checks ran>"]
    lines.append(f"preflight: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    return "\n".join(lines) + "\n", 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tg.launch.preflight", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reduce")
    r.add_argument("--recipe", required=True)
    r.add_argument("--gpus", type=int, required=True)
    r.add_argument("--judge-url", default="")
    for name in ("probe", "train", "resume", "routing", "nccl", "router", "table"):
        s = sub.add_parser(name)
        s.add_argument("--results", type=Path, required=True)
        if name in ("train", "resume"):
            s.add_argument("--run-dir", type=Path, required=True)
            s.add_argument("--steps", type=int, required=True)
        if name == "train":
            s.add_argument("--ckpt-dir", type=Path, required=True)
        if name == "resume":
            s.add_argument("--log", type=Path, required=True)
        if name in ("routing", "router"):
            s.add_argument("--recipe", required=True)
        if name == "router":
            s.add_argument("--cmdline", default="", help="the router's command line ('' = no router)")
        if name == "nccl":
            s.add_argument("--trainer-python", required=True)
            s.add_argument("--engine-python", required=True)
        if name == "probe":
            s.add_argument("--seeded", action="store_true", help="the recipe sets rollout.sampling_seed")
    for p in sub.choices.values():
        p.add_argument("rest", nargs="*", help="key=value overrides (reduce, routing) or engine URLs")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "reduce":
            print("\n".join(reduce_overrides(args.recipe, args.gpus, args.rest, args.judge_url)))
            return 0
        if args.cmd == "table":
            text, code = table(args.results)
            sys.stdout.write(text)
            return code
        if args.cmd == "probe":
            rows = asyncio.run(_probe(args.rest, args.seeded))
        elif args.cmd == "train":
            rows = check_train(args.run_dir, args.ckpt_dir, args.steps, args.rest)
        elif args.cmd == "resume":
            rows = [check_resume(args.run_dir, args.log, args.steps)]
        elif args.cmd == "nccl":
            rows = [check_nccl(args.trainer_python, args.engine_python)]
        elif args.cmd == "router":
            rows = [check_router(args.recipe, args.rest, args.cmdline)]
        else:
            rows = [check_routing(args.recipe, args.rest)]
    except ConfigError as exc:
        print(f"preflight: error: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        record(args.results, *row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
