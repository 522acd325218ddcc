"""Cost of the expert (feedback-conditioned) forward pass: ``shared`` vs ``exact`` sequences.

Fixture: one 20-turn agent rollout built with :func:`~megatron_tg.chat.builder.simulate_rollout`
(tiny Qwen3-Coder-framed tokenizer). Every assistant turn has a short thinking block and one
search tool call, and every turn is followed by a tool result. Two failure patterns:

* ``1 failing``: only the middle turn (index 10) fails;
* ``20 failing``: every turn fails (e.g. an ``every_turn`` criterion the policy never meets).

For each pattern and mode, the script counts what :func:`~megatron_tg.train.batching.build_micro_batch`
hands to the expert pass (sequences, tokens, packed rows, gated rows) and times the expert
forward (:func:`~megatron_tg.train.step.expert_hidden_states`) on the tiny megatron Qwen3-MoE
at TP=1. The student forward over the same rollout is timed in the same run for reference.
Modes and the student are interleaved within each repeat, so load drift on a shared machine
hits them alike. The time printed is the fastest of ``--repeats`` (wall and CPU of the one rank).

Packing: rows of at most ``--row-tokens`` tokens (default: the rollout's own length, i.e. one
student rollout per row; the expert rows widen to the longest expert sequence when that is
longer). Rows run as THD packed sequences: attention costs O(Σ segment²) in time and O(tokens)
in memory; the linear layers cost O(tokens).

Expected counts (confirmed by the printed table), with t_k = tokens of the rollout up to and
including assistant turn k and f_k = tokens of turn k's framed feedback message:

    shared:  1 sequence,    T = t_max(F) + sum_{k in F} f_k
    exact:   |F| sequences, T = sum_{k in F} (t_k + f_k)

With a P-token prompt and c tokens per turn (assistant + tool result), t_k = P + (k+1)·c, so
with all n turns failing exact forwards n·P + c·n(n+1)/2 + n·f tokens, against
P + n·c + n·f for shared: quadratic vs linear in the number of turns. With one failing turn
both modes build the same single sequence. The gated (output-layer) rows are identical in
both modes: the failing turns' tokens.

    python benchmarks/expert_cost.py               # 3 repeats
    python benchmarks/expert_cost.py --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

# The fixture tokenizer/model helpers live in the test tree: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TURNS = 20
FEEDBACK = "Use the lines= argument of the search tool."


def fixture_messages(turns: int = TURNS) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Find every caller of count() and fix the off-by-one."}]
    for k in range(turns):
        call = {"type": "function",
                "function": {"name": "search", "arguments": {"query": f"count( part {k}"}}}
        msgs.append({"role": "assistant", "reasoning_content": f"Look at part {k} next.",
                     "content": f"Searching part {k}.", "tool_calls": [call]})
        msgs.append({"role": "tool", "content": f"src/mod{k}.py:{10 + k}: n = count(xs) - 1"})
    return msgs


def _rank(rank, world, state, hf_cfg, tok_dir, cases, row_tokens, repeats):
    from transformers import AutoTokenizer

    from megatron_tg.config.objective import ObjectiveConfig
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.batching import build_micro_batch
    from megatron_tg.train.policy import forward_hidden
    from megatron_tg.train.step import expert_hidden_states

    tok = AutoTokenizer.from_pretrained(tok_dir)
    init_parallel(tp=1)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=1)
    load_hf_weights(model, state, arch, current_layout())
    model.eval()

    batches = {}
    for name, samples in cases.items():
        for mode in ("shared", "exact"):
            batches[(name, mode)] = build_micro_batch(
                samples, tok, ObjectiveConfig(mode="tg", expert_sequence=mode),
                row_tokens=row_tokens)
    student = next(iter(batches.values())).student

    def timed(fn):
        w, c = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - w, time.process_time() - c

    def student_fwd():
        with torch.no_grad():
            forward_hidden(model, student)

    best: dict = {}
    timed(student_fwd)  # warm-up (allocator, lazy init)
    for _ in range(repeats):
        jobs = [("student", "-", student_fwd)] + [
            (name, mode, (lambda mb=mb: expert_hidden_states(model, mb)))
            for (name, mode), mb in batches.items()]
        for name, mode, fn in jobs:
            w, c = timed(fn)
            old = best.get((name, mode))
            best[(name, mode)] = (min(w, old[0]), min(c, old[1])) if old else (w, c)

    rows = []
    for (name, mode), (w, c) in best.items():
        if name == "student":
            rows.append(dict(case="student", mode="-", seqs=len(student.offsets),
                             real=int(sum(_seq_lens(student))),
                             rows=student.tokens.shape[0], width=student.tokens.shape[1],
                             gated=0, wall=w, cpu=c))
            continue
        mb = batches[(name, mode)]
        seqs = len(mb.expert.offsets)
        real = int(sum(_seq_lens(mb.expert)))
        rows.append(dict(case=name, mode=mode, seqs=seqs, real=real,
                         rows=mb.expert.tokens.shape[0], width=mb.expert.tokens.shape[1],
                         gated=int(mb.policy.gate.sum()), wall=w, cpu=c))
    return rows


def _seq_lens(rows):
    """Lengths of the packed sequences: each starts at position 0 and counts up."""
    pos = rows.position_ids
    out = []
    for r, c in rows.offsets:
        n = 1
        while c + n < pos.shape[1] and pos[r, c + n] == n:
            n += 1
        out.append(n)
    return out


def expected_tokens(rollout, failing, f_len, mode):
    ends = [seg.end for seg in rollout.assistant_turns()]
    if mode == "shared":
        return ends[max(failing)] + f_len * len(failing)
    return sum(ends[k] + f_len for k in failing)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--row-tokens", type=int, default=0,
                    help="packing budget (default: the rollout's length, one rollout per row)")
    args = ap.parse_args()

    from megatron_tg.chat import get_tiny_tokenizer
    from megatron_tg.chat.builder import simulate_rollout
    from megatron_tg.chat.feedback import feedback_message_ids
    from megatron_tg.testing.distributed import run_distributed
    from megatron_tg.sampling.train_sample import TrainSample
    from tests.chat.convos import SEARCH_TOOL
    from tests.models.qwen3_moe.common import tiny_hf_model

    tok = get_tiny_tokenizer()
    cfg, _, state = tiny_hf_model(vocab_size=len(tok))
    ro = simulate_rollout(tok, fixture_messages(), tools=[SEARCH_TOOL], rollout_id="r20")
    assert ro.num_turns == TURNS and all(seg.tool_calls for seg in ro.assistant_turns())
    f_len = len(feedback_message_ids(tok, FEEDBACK))
    failing = {"1 failing": [TURNS // 2], f"{TURNS} failing": list(range(TURNS))}
    cases = {name: [TrainSample(ro, 1.0, {k: FEEDBACK for k in ks})] for name, ks in failing.items()}
    row_tokens = args.row_tokens or len(ro.token_ids)
    rows = run_distributed(_rank, 1, state, cfg.to_dict(), tok.name_or_path, cases, row_tokens,
                           args.repeats)[0]

    first = ro.turn(0)
    per_turn = (ro.turn(-1).end - first.end) / (TURNS - 1)
    print(f"torch {torch.__version__}, {platform.machine()}, 1 rank (TP=1), fp32, "
          f"tiny Qwen3-MoE (H={cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_experts} experts), best of {args.repeats}")
    print(f"rollout: {TURNS} turns, {len(ro.token_ids)} tokens (prompt P={first.start}, "
          f"~{per_turn:.1f} tokens per turn + tool result), feedback message f={f_len} tokens, "
          f"row budget {row_tokens}")
    print()
    hdr = (f"{'case':<11} {'mode':<7} {'seqs':>4} {'tokens':>7} {'expected':>8} {'rows x width':>13} "
           f"{'gated':>6} {'wall ms':>8} {'cpu ms':>8}")
    print(hdr)
    by = {}
    for r in rows:
        exp = "-" if r["case"] == "student" else str(
            expected_tokens(ro, failing[r["case"]], f_len, r["mode"]))
        if exp != "-":
            assert int(exp) == r["real"], (r, exp)  # the formula holds token for token
        by[(r["case"], r["mode"])] = r
        print(f"{r['case']:<11} {r['mode']:<7} {r['seqs']:>4} {r['real']:>7} {exp:>8} "
              f"{str(r['rows']) + ' x ' + str(r['width']):>13} {r['gated']:>6} "
              f"{1e3 * r['wall']:>8.1f} {1e3 * r['cpu']:>8.1f}")
    print()
    stu = by[("student", "-")]
    print(f"{'ratios':<11} {'exact/shared':>26} {'shared/student':>18} {'exact/student':>18}")
    print(f"{'':<11} {'tokens':>8} {'wall':>8} {'cpu':>8} {'wall':>8} {'cpu':>9} {'wall':>8} {'cpu':>9}")
    for case in failing:
        s, e = by[(case, "shared")], by[(case, "exact")]
        print(f"{case:<11} {e['real'] / s['real']:>8.2f} {e['wall'] / s['wall']:>8.2f} "
              f"{e['cpu'] / s['cpu']:>8.2f} {s['wall'] / stu['wall']:>8.2f} "
              f"{s['cpu'] / stu['cpu']:>9.2f} {e['wall'] / stu['wall']:>8.2f} "
              f"{e['cpu'] / stu['cpu']:>9.2f}")
    # Closed form for evenly sized turns: t_k = t_0 + k*c (c = tokens per turn + tool result).
    n, t0 = TURNS, ro.turn(0).end
    c = (ro.turn(-1).end - t0) / (n - 1)
    print()
    print(f"closed form, all {n} failing (t_0={t0}, c={c:.1f}, f={f_len}): "
          f"exact ~ n*t_0 + c*n(n-1)/2 + n*f = {n * t0 + c * n * (n - 1) / 2 + n * f_len:.0f}, "
          f"shared = t_(n-1) + n*f = {ro.turn(-1).end + n * f_len}")

if __name__ == "__main__":
    main()
