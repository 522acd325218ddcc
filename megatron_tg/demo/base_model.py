"""The didactic experiment's base model: a tiny Qwen3-MoE SFT'd on :mod:`megatron_tg.demo.task`.

:func:`build_base_model` reproduces the "SFT that never saw the new tool format" of paper §5.1
at toy scale, on CPU, in the project's real formats:

1. tokenizer: :func:`megatron_tg.chat.build_tiny_tokenizer` (Qwen3-Coder framing) with its BPE
   fitted to rendered demo transcripts, so sequences stay short (~105 tokens);
2. data: demonstrations from :func:`~megatron_tg.demo.task.reference_messages`, rendered with
   the chat template; loss on assistant turns. Without the hint the search call uses the OLD
   format; on ``hint_fraction`` (0.5) of the examples the hint (the trainer's framed feedback
   message) sits right before the tool-call turn — token for token where ``insert_feedback``
   puts the expert's feedback — and the call uses the NEW format (``lines=N``). On
   ``context_fraction`` (0.2) of the hint-less examples the call is new-format but *context
   only* (masked out of the loss) and only the answer after its result is trained: the model
   never learns to emit the new format without the hint, but can still read a result it
   fetched that way. Without them (0.0) the answer after a new-format call without hint (the
   state TG's student reaches) was right 0.06–1.0 of the time over 21 measured builds, under
   0.8 in 7 (with them: 0.96–1.0 over 6 builds);
3. model: ``transformers.Qwen3MoeForCausalLM`` (the 30B model's architecture path: q/k norm,
   GQA, top-k routed experts), trained with plain PyTorch AdamW;
4. evaluation by sampling (temperature 1, full vocabulary) through the multi-turn episode
   driver :func:`~megatron_tg.demo.episodes.run_episodes` with HF ``generate``, plus the exact
   teacher-forced probability of the new format's first token at the branch point;
5. ``save_pretrained`` of model and tokenizer into ``out_dir`` + ``base_metrics.json``.

Where each part lives: the settings in :mod:`.base_config`, the data (1-2) in
:mod:`.sft_data`, the evaluation (4) in :mod:`.base_eval`; this module trains and builds.

The build is deterministic given its settings and cached: ``out_dir`` holding a build with the
same :func:`build_hash` (settings, this package's source, torch/transformers versions) is
reused. ``python -m megatron_tg.demo.base_model OUT_DIR [--quick]`` builds from the shell.

Measured (one torch thread, the 2-core CI machine; ~390k parameters): the default build
(400 steps x 32 sequences) takes ~70 s of SFT and ~80 s in all (CPU time); seeds 0 / 1 / 2
give task success without hint 0.99 / 0.99 / 0.98, new format without hint 0 (exact branch
probability ~1e-6), new format with hint 1.0, success after a forced new-format call without
hint 0.99–1.0. ``QUICK`` (300 steps): ~52 s of SFT, rates in :data:`QUICK_EXPECTED`; its
exact no-hint branch probability is 2.8e-5, not ~1e-6. The phase experiment's knob
(``new_no_hint_fraction`` 0.05 with ``new_no_hint_branch_weight`` 0.003 / 0.2, default build)
gave 4.8e-5 / 5.1e-3 (``python -m megatron_tg.demo --suite phase``, seed 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Sequence

from megatron_tg.demo import task as T
from megatron_tg.demo.base_config import QUICK, BaseModelConfig
from megatron_tg.demo.base_eval import evaluate
from megatron_tg.demo.sft_data import sft_examples, tokenizer_corpus

METRICS_FILE = "base_metrics.json"
BUILD_FORMAT = 2  # bump when the build's outputs change meaning


# ------------------------------------------------------------------------------ hashing
def _source_digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in ("task.py", "episodes.py", "base_config.py", "sft_data.py", "base_eval.py", "base_model.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()


def build_hash(cfg: BaseModelConfig) -> str:
    import torch
    import transformers

    blob = json.dumps({"format": BUILD_FORMAT, "config": dataclasses.asdict(cfg), "hint": T.HINT,
                       "source": _source_digest(), "torch": torch.__version__,
                       "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------ training
def _lr_at(step: int, cfg: BaseModelConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train(model, examples, cfg: BaseModelConfig, pad_id: int, log=None) -> list[float]:
    """Plain PyTorch AdamW SFT; cross-entropy on assistant tokens only (logits computed only
    where a target exists). Returns the per-step losses."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(f"demo-batches:{cfg.seed}")
    decay = [p for n_, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n_]
    no_decay = [p for n_, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n_)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    model.train()
    losses = []
    for step in range(cfg.steps):
        # Uniform batches: length-bucketed ones (sort 8 batches' draw by length, split) cut
        # padding by a third but left the copy skill unlearnt at 300 steps (success 0.05 vs 0.95).
        batch = [examples[rng.randrange(len(examples))] for _ in range(cfg.batch_size)]
        L = max(len(x[0]) for x in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        weight = torch.zeros((len(batch), L), dtype=torch.float32)
        for b, (x, m, _) in enumerate(batch):
            ids[b, :len(x)] = torch.tensor(x)
            weight[b, :len(m)] = torch.tensor(m, dtype=torch.float32)
        tgt_mask = weight > 0
        # right padding needs no attention mask: causal attention never looks right.
        h = model.model(input_ids=ids).last_hidden_state
        sel = tgt_mask[:, 1:]
        logits = model.lm_head(h[:, :-1][sel])
        w = weight[:, 1:][sel]
        if bool((w == 1).all()):  # the plain mean: the default build's arithmetic, unchanged
            loss = F.cross_entropy(logits.float(), ids[:, 1:][sel])
        else:  # per-token weights, normalised by the token count (a weight scales its token only)
            loss = (F.cross_entropy(logits.float(), ids[:, 1:][sel], reduction="none") * w).sum() / w.numel()
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if log is not None and (step % 50 == 0 or step == cfg.steps - 1):
            log(f"step {step:4d}  loss {losses[-1]:.4f}  lr {_lr_at(step, cfg):.2e}")
    model.eval()
    return losses


# ------------------------------------------------------------------------------ build
def load_metrics(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    p = Path(out_dir) / METRICS_FILE
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _complete(out_dir: Path) -> bool:
    return all((out_dir / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json"))


def build_base_model(out_dir: str | os.PathLike, *, seed: int = 0, steps: int | None = None,
                     force: bool = False, log=None, **overrides: Any) -> dict[str, Any]:
    """Build (or reuse) the base model in ``out_dir``; returns its metrics.

    ``overrides`` are :class:`BaseModelConfig` fields (``steps`` too). Reuse: when ``out_dir``
    holds a complete build whose ``build_hash`` equals this one's, its stored metrics are
    returned with ``cached: True`` (``force=True`` rebuilds). Metrics: the :func:`.base_eval.evaluate`
    rates, ``sft_seconds`` (training only), ``build_seconds``, ``n_params``, losses, the hint
    text/role the model was trained with, the config and the hash.
    """
    if steps is not None:
        overrides["steps"] = steps
    cfg = BaseModelConfig(seed=seed, **overrides)
    return build_with(
        out_dir, cfg, build_hash(cfg), force=force, log=log,
        corpus=lambda: tokenizer_corpus(cfg.tokenizer_docs, cfg.seed),
        examples=lambda tok: sft_examples(tok, cfg.pool_size, cfg.seed, cfg.hint_fraction,
                                          cfg.context_fraction, cfg.hint_old_fraction,
                                          cfg.new_no_hint_fraction, cfg.new_no_hint_branch_weight),
        evaluate_fn=lambda model, tok: evaluate(model, tok, cfg),
        extra={"hint_text": T.HINT, "hint_role": T.FEEDBACK_ROLE, "feedback": T.FEEDBACK})


def weights_digest(out_dir: str | os.PathLike) -> str:
    """A digest of the saved weights (names, dtypes, shapes and bytes, in name order): which
    base a build made. The build hash names the inputs, and the same inputs train other
    weights on another CPU (the claims' P bases, docs/claims-2.md's amendments), so a record
    holds both."""
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    tensors = load_file(str(Path(out_dir) / "model.safetensors"))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build_with(out_dir: str | os.PathLike, cfg: BaseModelConfig, h: str, *, corpus, examples,
               evaluate_fn, extra: dict[str, Any], force: bool = False, log=None) -> dict[str, Any]:
    """The build steps shared by this module's base model and the paper suite's
    (:mod:`.paper_base`): reuse a complete build of hash ``h``, else fit the tokenizer on
    ``corpus()``, make the SFT pool ``examples(tokenizer)``, train (:func:`train`), evaluate
    (``evaluate_fn(model, tokenizer)``), save; ``extra`` goes into the metrics as is."""
    import torch

    out = Path(out_dir)
    prev = load_metrics(out)
    if not force and prev is not None and prev.get("build_hash") == h and _complete(out):
        return {**prev, "weights_sha256": weights_digest(out), "cached": True}

    say = log or (lambda s: None)
    t_start, c_start = time.perf_counter(), time.process_time()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        from transformers import Qwen3MoeForCausalLM

        from megatron_tg.chat.template import stop_token_id
        from megatron_tg.chat.tokenizer import build_tiny_tokenizer

        out.mkdir(parents=True, exist_ok=True)
        mp = out / METRICS_FILE
        if mp.exists():
            mp.unlink()  # an interrupted rebuild must not look complete
        tok = build_tiny_tokenizer(out, corpus=corpus(), vocab_size=cfg.vocab_size)
        eos, pad = stop_token_id(tok), tok.convert_tokens_to_ids(tok.pad_token)
        t0 = time.perf_counter()
        pool = examples(tok)
        data_s = time.perf_counter() - t0
        say(f"tokenizer {len(tok)} ids; {len(pool)} SFT examples, mean length "
            f"{sum(len(x) for x, _, _ in pool) / len(pool):.1f} tokens ({data_s:.1f} s)")

        torch.manual_seed(cfg.seed)
        model = Qwen3MoeForCausalLM(cfg.model_config(len(tok), eos, pad))
        n_params = sum(p.numel() for p in model.parameters())
        say(f"Qwen3MoeForCausalLM: {n_params:,} parameters")
        t0, c0 = time.perf_counter(), time.process_time()
        losses = train(model, pool, cfg, pad, log=say)
        sft_s, sft_cpu = time.perf_counter() - t0, time.process_time() - c0

        t0 = time.perf_counter()
        metrics = evaluate_fn(model, tok)
        eval_s = time.perf_counter() - t0
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = pad
        model.save_pretrained(out)
        metrics.update({
            "build_hash": h, "config": dataclasses.asdict(cfg), "n_params": n_params,
            "vocab_size": len(tok), **extra,
            "mean_sft_tokens": sum(len(x) for x, _, _ in pool) / len(pool),
            "sft_seconds": round(sft_s, 1), "sft_cpu_seconds": round(sft_cpu, 1),
            "sft_ms_per_step": round(1000 * sft_s / cfg.steps, 1),
            "eval_seconds": round(eval_s, 1), "data_seconds": round(data_s, 1),
            "loss_first": losses[0], "loss_last": float(sum(losses[-20:]) / len(losses[-20:])),
            "threads": cfg.threads,
        })
        metrics["build_seconds"] = round(time.perf_counter() - t_start, 1)
        metrics["build_cpu_seconds"] = round(time.process_time() - c_start, 1)
        mp.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        return {**metrics, "weights_sha256": weights_digest(out), "cached": False}
    finally:
        torch.set_num_threads(old_threads)


def load_base_model(out_dir: str | os.PathLike):
    """(model, tokenizer) from a built ``out_dir``, model in eval mode (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out_dir)).eval()
    return model, AutoTokenizer.from_pretrained(str(out_dir))


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m megatron_tg.demo.base_model",
                                 description="Build (or reuse) the demo's SFT'd tiny Qwen3-MoE base model.")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help=f"CI-sized build: {QUICK}")
    ap.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
    a = ap.parse_args(argv)
    over = dict(QUICK) if a.quick else {}
    if a.steps is not None:
        over["steps"] = a.steps
    m = build_base_model(a.out_dir, seed=a.seed, force=a.force, log=print, **over)
    keys = ("cached", "n_params", "sft_seconds", "sft_cpu_seconds", "build_seconds",
            "build_cpu_seconds", "success_no_hint", "new_format_no_hint", "new_format_hint",
            "success_hint", "success_forced_new_no_hint", "p_branch_no_hint_mean", "p_branch_hint_mean",
            "expert_kl_branch_mean", "expert_kl_off_branch_mean", "expert_kl_off_branch_max")
    print(json.dumps({k: m.get(k) for k in keys}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
