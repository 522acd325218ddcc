"""``megatron-tg vet``: vet a rubric's feedback strings (paper §4) from the command line; the
procedure is :mod:`megatron_tg.judge.vetting`, its statistics and the report
:mod:`megatron_tg.judge.vet_report`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Sequence

from megatron_tg.judge.judge import Judge
from megatron_tg.judge.vet_report import format_report
from megatron_tg.judge.vetting import FEEDBACK_CONTEXTS, VetConfig, vet_feedback

DESCRIPTION = ("Vet a rubric's feedback strings (paper §4): does the model with the "
               "feedback beat the model without it?")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-tg vet", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF model directory (with tokenizer) served by the embedded engine")
    src.add_argument("--server", action="append", metavar="URL",
                     help="URL of a running SGLang-compatible server (repeatable)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--num-engines", type=int, default=1, help="embedded engines to start")
    p.add_argument("--rubric", required=True, help="rubric YAML")
    p.add_argument("--tasks", default="builtin", help="task JSONL, or 'builtin'")
    p.add_argument("--task-ids", help="comma-separated subset of task ids")
    p.add_argument("--max-tasks", type=int, default=0, help="use the first N tasks (0: all)")
    p.add_argument("--samples", type=int, default=8, help="rollouts per task and arm")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of both arms")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top-p of both arms")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="tokens per assistant turn")
    p.add_argument("--max-turns", type=int, default=8, help="assistant turns per rollout")
    p.add_argument("--max-context-tokens", type=int, default=4096, help="a rollout stops when its context reaches this")
    p.add_argument("--criteria", help="comma-separated criteria to vet (default: all with feedback)")
    p.add_argument("--feedback", action="append", default=[], metavar="NAME=TEXT",
                   help="vet TEXT instead of the rubric's feedback for NAME (repeatable)")
    p.add_argument("--template", default=None,
                   help="message text around the feedback, with {feedback} "
                        "(default: the config's judge.feedback_framing)")
    p.add_argument("--framing", choices=("user", "system"), default="user",
                   help="role of the inserted message (judge.feedback_role)")
    p.add_argument("--feedback-context", choices=FEEDBACK_CONTEXTS, default="shared",
                   help="keep earlier turns' feedback in the context (shared) or not (exact)")
    p.add_argument("--confidence", type=float, default=0.95, help="level of the improvement's interval (0 < c < 1)")
    p.add_argument("--min-improvement", type=float, default=0.0, help="keep a feedback only if its interval's lower bound on the criterion's gain exceeds this")
    p.add_argument("--max-primary-drop", type=float, default=0.05, help="keep a feedback only if the primary pass rate drops by at most this (point estimate)")
    p.add_argument("--concurrency", type=int, default=8, help="rollouts in flight at once")
    p.add_argument("--sandbox", choices=("bwrap", "none"), default="bwrap", help="how tool calls run: bubblewrap, or unsandboxed (needs --allow-unsandboxed)")
    p.add_argument("--allow-unsandboxed", action="store_true", help="permit --sandbox none (tool calls then run on this host as you)")
    p.add_argument("--judge-url", help="LLM judge base URL (rubrics with llm criteria)")
    p.add_argument("--judge-model", default="judge", help="model name sent to the LLM judge at --judge-url")
    p.add_argument("--log-dir", help="engine logs (default: a temporary directory)")
    p.add_argument("--out", required=True, help="JSON report path")


def _select_tasks(args) -> list:
    from megatron_tg.agent.tasks import builtin_tasks, load_tasks

    tasks = builtin_tasks() if args.tasks == "builtin" else load_tasks(args.tasks)
    if args.task_ids:
        want = [x.strip() for x in args.task_ids.split(",") if x.strip()]
        by_id = {t.id: t for t in tasks}
        missing = [x for x in want if x not in by_id]
        if missing:
            raise SystemExit(f"--task-ids: unknown task(s) {missing}")
        tasks = [by_id[x] for x in want]
    if args.max_tasks:
        tasks = tasks[:args.max_tasks]
    return tasks


async def _run(args, log) -> dict[str, Any]:
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from megatron_tg.agent.harness import AgentHarness
    from megatron_tg.config.rollout import RolloutConfig
    from megatron_tg.judge import LLMJudgeClient, LLMJudgeConfig, load_rubric
    from megatron_tg.rollout.client import SGLangClient

    rubric = load_rubric(args.rubric)
    tasks = _select_tasks(args)
    tok_dir = args.tokenizer or args.model
    if tok_dir is None:
        raise SystemExit("--tokenizer is required with --server")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    overrides = {}
    for item in args.feedback:
        name, sep, text = item.partition("=")
        if not sep or not text.strip():
            raise SystemExit(f"--feedback expects NAME=TEXT, got {item!r}")
        overrides[name.strip()] = text.strip()
    cfg = VetConfig(samples=args.samples, confidence=args.confidence,
                    min_improvement=args.min_improvement, max_primary_drop=args.max_primary_drop,
                    feedback_context=args.feedback_context, framing=args.framing,
                    template=args.template, concurrency=args.concurrency)
    rcfg = RolloutConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                         max_context_tokens=args.max_context_tokens, sandbox=args.sandbox,
                         allow_unsandboxed=args.allow_unsandboxed, temperature=args.temperature,
                         top_p=args.top_p)
    llm = None
    if rubric.llm_criteria():
        if not args.judge_url:
            raise SystemExit(f"rubric {rubric.name!r} has LLM-judged criteria: pass --judge-url")
        llm = LLMJudgeClient(LLMJudgeConfig(base_url=args.judge_url, model=args.judge_model))
    engines = []
    tmp = None
    try:
        if args.model and not args.server:
            from megatron_tg.rollout.engine.launch import start_engines

            log_dir = args.log_dir or (tmp := tempfile.mkdtemp(prefix="vet-engines-"))
            log(f"starting {args.num_engines} embedded engine(s) on {args.model}")
            engines = start_engines([Path(args.model)] * args.num_engines, Path(log_dir))
            urls = [e.url for e in engines]
        else:
            urls = list(args.server)
        async with SGLangClient(urls) as client:
            return await vet_feedback(
                rubric, tasks, tok, client, AgentHarness(tok, rcfg), Judge(rubric, tok, llm=llm),
                cfg, sampling_params={"temperature": args.temperature, "top_p": args.top_p,
                                      "max_new_tokens": args.max_new_tokens},
                criteria=[x.strip() for x in args.criteria.split(",")] if args.criteria else None,
                feedback_overrides=overrides, log=log)
    finally:
        if llm is not None:
            await llm.close()
        for e in engines:
            e.stop()
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    report = asyncio.run(_run(args, log))
    report["command"] = {k: v for k, v in vars(args).items()}
    out = os.fspath(args.out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, allow_nan=False)
    print(format_report(report))
    print(f"\nreport written to {out}")
    return 0
