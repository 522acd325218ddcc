"""The demo's task (tool, verifier, rubric, episode driver) and its SFT'd base model.

The quick build (``base_config.QUICK``: 400 SFT steps) is built once per test run (conftest.py). Its
thresholds: the targets (new format without hint <= 0.01, with hint >= 0.9) and, for task
success, ``base_config.QUICK_EXPECTED`` — lower bounds under the rates measured with two kernel
sets and, for the earlier 300-step build, on two machines (recorded there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_tg.agent.tools import search_lines
from megatron_tg.chat.builder import simulate_rollout
from megatron_tg.chat.feedback import insert_feedback
from megatron_tg.chat.parsing import parse_assistant
from megatron_tg.chat.template import assistant_generation_text, encode, generation_prompt_ids
from megatron_tg.chat.tokenizer import get_tiny_tokenizer
from megatron_tg.config.rollout import JudgeConfig
from megatron_tg.demo import base_config as BC
from megatron_tg.demo import base_eval as BE
from megatron_tg.demo import base_model as B
from megatron_tg.demo import sft_data as SD
from megatron_tg.demo import episodes as E
from megatron_tg.demo import task as T
from megatron_tg.judge import Judge, Transcript, load_rubric

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return get_tiny_tokenizer()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread, as the build uses: two threads on two busy cores run many times slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------ tasks / tool
def test_tasks_are_seeded_and_index_stable():
    a, b = T.make_tasks(20, seed=3), T.make_tasks(20, seed=3)
    assert a == b and T.make_tasks(5, seed=3, start=10) == a[10:15]
    assert a != T.make_tasks(20, seed=4)
    assert all(len({T.make_task(3, i, s).facts for s in T.SPLITS}) == len(T.SPLITS) for i in range(5))
    for t in a:
        keys = [k for k, _ in t.facts]
        assert len(set(keys)) == len(keys) and (t.key, t.value) in t.facts
        assert T.N_FACTS[0] <= len(t.facts) <= T.N_FACTS[1]


def test_search_format_and_ranking(tmp_path):
    for t in T.make_tasks(30, seed=1):
        res = T.search(t, t.key).splitlines()
        assert len(res) == min(T.DEFAULT_LINES, len(t.facts))
        assert res[0] == f"{T.FACTS_PATH}:{t.facts.index((t.key, t.value)) + 1}: {t.key} = {t.value}"
        assert len(T.search(t, t.key, 6).splitlines()) == min(6, len(t.facts))
        assert T.search(t, t.key, 100).splitlines()[:len(res)] == res
        assert sorted(T.search(t, t.key, 100).splitlines()) == sorted(
            f"{T.FACTS_PATH}:{i + 1}: {line}" for i, line in enumerate(t.file_lines()))
        # the project's code search, on the same repository, agrees on the best line and format
        d = tmp_path / t.id
        d.mkdir()
        (d / T.FACTS_PATH).write_text("\n".join(t.file_lines()) + "\n")
        _, path, no, text = search_lines(d, t.key, 1)[0]
        assert f"{path}:{no}: {text}" == res[0]
    with pytest.raises(ValueError):
        T.search(T.make_task(0, 0), "k1", 0)


def test_run_tool_call_errors_are_observations():
    t = T.make_task(0, 0)
    call = lambda text: parse_assistant(text + "<|im_end|>")  # noqa: E731
    ok = call(f"<tool_call>\n<function=search>\n<parameter=query>\n{t.key}\n</parameter>\n"
              f"<parameter=lines>\n2\n</parameter>\n</function>\n</tool_call>")
    assert T.run_tool_call(t, ok.tool_calls[0]) == T.search(t, t.key, 2)
    bad_lines = call("<tool_call>\n<function=search>\n<parameter=query>\nk1\n</parameter>\n"
                     "<parameter=lines>\nmany\n</parameter>\n</function>\n</tool_call>")
    assert T.run_tool_call(t, bad_lines.tool_calls[0]).startswith("Error: search: lines must be an integer")
    zero = call("<tool_call>\n<function=search>\n<parameter=query>\nk1\n</parameter>\n"
                "<parameter=lines>\n0\n</parameter>\n</function>\n</tool_call>")
    assert "between 1 and" in T.run_tool_call(t, zero.tool_calls[0])
    other = call("<tool_call>\n<function=run>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>")
    assert T.run_tool_call(t, other.tool_calls[0]).startswith("Error: unknown tool 'run'")
    broken = call("<tool_call>\n<function=search>\nk1\n</tool_call>")
    assert broken.errors and T.run_tool_call(t, broken.errors[0]).startswith("Error: malformed tool call")


# ------------------------------------------------------------------------------ verifier / rubric
def test_answer_correct():
    assert T.answer_correct("The value of k54 is 55.", 55)
    assert T.answer_correct("55", "55")
    assert not T.answer_correct("The value of k54 is 56.", 55)
    assert not T.answer_correct("The value of k54 is 55 or 71.", 55)  # listing values is no answer
    assert not T.answer_correct("The value of k55 is unknown.", 55)   # a key is not the value
    assert not T.answer_correct("", 55)


def test_rubric_matches_the_recipe_rubric():
    recipe = load_rubric(REPO / "recipes/rubrics/tool_format.yaml")["search_lines"]
    ours = T.rubric()["search_lines"]
    assert (ours.scope, ours.feedback, ours.checker_type, ours.checker_args) == \
        (recipe.scope, recipe.feedback, recipe.checker_type, recipe.checker_args)
    assert T.FEEDBACK == recipe.feedback
    assert T.HINT == JudgeConfig().feedback_framing.replace("{feedback}", T.FEEDBACK)
    assert T.FEEDBACK_ROLE == JudgeConfig().feedback_role
    assert T.rubric().primary_names() == ["answer"]


def _judge(tok, msgs, task_info):
    r = simulate_rollout(tok, msgs, task_id="t")
    return Judge(T.rubric(), tok).judge_sync(r, task_info)


def test_judge_on_hand_written_transcripts(tok):
    t = T.make_task(0, 5)
    old = T.reference_messages(t, new_format=False)
    new = T.reference_messages(t, new_format=True, lines=4)
    r = _judge(tok, old, t)
    assert r.trainable and r.passed == {"answer": True, "search_lines": False}
    assert r.feedback_by_turn() == {0: T.FEEDBACK}  # feedback goes before the tool-call turn
    r = _judge(tok, new, t.info())  # task_info as the JSON-able dict works too
    assert r.passed == {"answer": True, "search_lines": True} and r.feedback_by_turn() == {}
    wrong = old[:-1] + [{"role": "assistant", "content": f"The value of {t.key} is {t.value + 1}."}]
    assert _judge(tok, wrong, t).passed["answer"] is False
    hedged = old[:-1] + [{"role": "assistant", "content": f"It is {t.value} or 11."}]
    assert _judge(tok, hedged, t).passed["answer"] is False
    no_answer = old[:-2]  # ends with the tool call
    assert _judge(tok, no_answer, t).passed["answer"] is False
    # a tool-call turn cut by the token limit before its call closes is no valid call: it fails
    # the format criterion and gets its feedback (so TG gates it), like a malformed search call
    from megatron_tg.chat.builder import RolloutBuilder, fake_logprobs

    prompt = list(t.prompt_messages())
    text = assistant_generation_text(tok, old[len(prompt)])
    ids = encode(tok, text[:text.index("</parameter>") + len("</parameter>\n<para")])
    b = RolloutBuilder(tok, prompt, task_id="t")
    b.add_assistant(ids, fake_logprobs(ids), 0)
    cut = b.build("length")
    r = Judge(T.rubric(), tok).judge_sync(cut, t)
    assert cut.finish_reason == "length"
    assert r.passed == {"answer": False, "search_lines": False}
    assert r.feedback_by_turn() == {0: T.FEEDBACK}
    # without task info or metadata the answer cannot be judged: a judge error, not a fail
    r = _judge(tok, old, None)
    assert not r.trainable and "answer" in r.judge_error


def test_episode_metrics_on_hand_written_turns():
    t = T.make_task(0, 2)
    call_old = f"<tool_call>\n<function=search>\n<parameter=query>\n{t.key}\n</parameter>\n</function>\n</tool_call><|im_end|>"
    call_new = (f"<tool_call>\n<function=search>\n<parameter=query>\n{t.key}\n</parameter>\n"
                f"<parameter=lines>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>")
    ans = f"The value of {t.key} is {t.value}.<|im_end|>"
    m = T.episode_metrics(t, [parse_assistant(call_old), parse_assistant(ans)])
    assert m["success"] and not m["new_format"] and not m["format_ok"] and m["first_call_new_format"] is False
    m = T.episode_metrics(t, [parse_assistant(call_new), parse_assistant(ans)])
    assert m["success"] and m["new_format"] and m["format_ok"]
    m = T.episode_metrics(t, [parse_assistant(call_new), parse_assistant(call_old), parse_assistant(ans)])
    assert not m["new_format"] and m["n_search_calls"] == 2   # every call must use lines
    m = T.episode_metrics(t, [parse_assistant(ans)])            # guessed without searching
    assert m["success"] and not m["new_format"] and m["format_ok"] and m["first_call_new_format"] is None
    assert not T.episode_metrics(t, [parse_assistant(call_new), parse_assistant(ans[:-10])])["success"]
    assert not T.episode_metrics(t, [parse_assistant(call_new), parse_assistant(ans)], "max_turns")["success"]


# ------------------------------------------------------------------------------ hint placement
def _scripted(tok, task, *, new_format, lines=3):
    """A generate_batch that plays the reference transcript, whatever the context."""
    msgs = T.reference_messages(task, new_format=new_format, lines=lines)
    turns = [encode(tok, assistant_generation_text(tok, m)) for m in msgs if m["role"] == "assistant"]

    def gen(contexts):
        k = gen.round
        gen.round += 1
        return [turns[k] for _ in contexts]
    gen.round = 0
    return gen


@pytest.mark.parametrize("new_format", [False, True])
def test_sft_hint_placement_equals_insert_feedback(tok, new_format):
    for i in range(6):
        t = T.make_task(7, i)
        lines = 1 + i % 6
        plain = simulate_rollout(tok, T.reference_messages(t, new_format=new_format, lines=lines))
        expert = insert_feedback(plain, {0: T.HINT}, tok, framing="user", truncate=False)
        hinted = T.reference_messages(t, new_format=new_format, lines=lines, hint=T.HINT)
        text = tok.apply_chat_template(hinted, tokenize=False)
        sft_ids = encode(tok, text[:text.rindex(tok.eos_token) + len(tok.eos_token)])
        assert sft_ids == expert.token_ids
        # the SFT loss mask is exactly the rollout's assistant tokens, moved by the insertion
        mask = SD.assistant_loss_mask(sft_ids, generation_prompt_ids(tok), tok.eos_token_id)
        moved = [0] * len(sft_ids)
        for j, a in enumerate(plain.assistant_mask()):
            if a:
                moved[expert.position_map[j]] = 1
        assert mask == moved
        # and without the hint the SFT example is the plain rollout
        text = tok.apply_chat_template(T.reference_messages(t, new_format=new_format, lines=lines), tokenize=False)
        assert encode(tok, text[:text.rindex(tok.eos_token) + len(tok.eos_token)]) == plain.token_ids


def test_sft_examples_are_the_rendered_rollouts(tok):
    ex = SD.sft_examples(tok, 80, seed=0, hint_fraction=0.5, context_fraction=0.3, hint_old_fraction=0.3)
    kinds = [e.kind for e in ex]
    assert 10 < kinds.count("hint") < 50 and kinds.count("context") > 2 and kinds.count("plain") > 10
    assert kinds.count("hint_old") > 2
    gen = generation_prompt_ids(tok)
    for ids, mask, kind in ex:
        text = tok.decode(ids)
        assert ("<parameter=lines>" in text) == (kind in ("hint", "context"))
        assert (T.HINT in text) == (kind in ("hint", "hint_old"))
        assert ids[-1] == tok.eos_token_id and mask[-1] == 1 and len(mask) == len(ids)
        full = SD.assistant_loss_mask(ids, gen, tok.eos_token_id)
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        if kind == "context":  # the new-format call is never a target without the hint
            assert "<tool_call>" not in trained and trained.startswith("The value of")
            assert sum(mask) < sum(full)
        elif kind == "hint_old":  # the old call is trained under the hint, but for its branch token
            off = [i for i, (m, f) in enumerate(zip(mask, full)) if m != f]
            assert len(off) == 1 and tok.convert_ids_to_tokens([ids[off[0]]]) == ["</"]
            assert trained.startswith("<tool_call>") and tok.decode(ids[off[0]:off[0] + 2]) == "</function"
        else:
            assert mask == full and trained.startswith("<tool_call>")


@pytest.mark.parametrize("turn", [0, 1])
def test_episode_hint_placement_equals_insert_feedback(tok, turn):
    t = T.make_task(0, 9)
    plain = E.run_episodes([t], _scripted(tok, t, new_format=True, lines=2), tok)[0]
    hinted = E.run_episodes([t], _scripted(tok, t, new_format=True, lines=2), tok,
                            hint=T.HINT, hint_turns=(turn,))[0]
    expert = insert_feedback(plain.rollout, {turn: T.HINT}, tok, framing="user", truncate=False)
    assert hinted.rollout.token_ids == expert.token_ids
    # the rollouts' turns are the same tokens
    assert [hinted.rollout.token_ids[s.start:s.end] for s in hinted.rollout.assistant_turns()] == \
        [plain.rollout.token_ids[s.start:s.end] for s in plain.rollout.assistant_turns()]


# ------------------------------------------------------------------------------ episode driver
def test_episode_driver_oracle_and_failures(tok):
    tasks = T.make_tasks(3, seed=2)
    for new in (False, True):
        for t in tasks:
            e = E.run_episode(t, lambda ids, g=_scripted(tok, t, new_format=new): g([ids])[0], tok)
            assert e.finish_reason == "stop" and e.success and e.new_format == new
            assert e.rollout.metadata["answer"] == t.answer and e.rollout.metadata["logprobs"] == "missing"
            assert [s.kind for s in e.rollout.segments] == ["prompt", "assistant", "tool", "assistant"]
            assert Transcript.from_rollout(e.rollout, tok).turns[-1].content == f"The value of {t.key} is {t.value}."
    t = tasks[0]
    call = encode(tok, assistant_generation_text(tok, T.reference_messages(t, new_format=False)[1]))
    # the agent keeps searching: max_turns
    e = E.run_episode(t, lambda ids: (call, [-0.5] * len(call)), tok, max_turns=2)
    assert e.finish_reason == "max_turns" and not e.success and e.rollout.num_turns == 2
    assert "logprobs" not in e.rollout.metadata and e.rollout.turn(0).logprobs == [-0.5] * len(call)
    # a turn cut without the stop token: length; tokens after the stop token are dropped
    e = E.run_episode(t, lambda ids: call[:-1], tok)
    assert e.finish_reason == "length" and not e.success
    e = E.run_episode(t, lambda ids: call + [tok.pad_token_id] * 3, tok, max_turns=1)
    assert e.rollout.token_ids[-1] == tok.eos_token_id


# ------------------------------------------------------------------------------ the base model
def test_sft_is_deterministic(tok):
    import torch
    from transformers import Qwen3MoeForCausalLM

    cfg = BC.BaseModelConfig(steps=3, batch_size=4, warmup_steps=1)
    ex = SD.sft_examples(tok, 16, seed=0, hint_fraction=0.5)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        m = Qwen3MoeForCausalLM(cfg.model_config(len(tok), eos, pad))
        runs.append((B.train(m, ex, cfg, pad), m.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


@pytest.fixture(scope="module")
def quick_build(quick_base):
    return quick_base


@pytest.mark.slow
def test_quick_build_properties(quick_build):
    out, m = quick_build
    # built here, unless the run was handed an earlier build of the same hash (conftest.py)
    assert m["cached"] is bool(os.environ.get("TG_TEST_QUICK_BASE")) and m["n_params"] < 2_000_000
    # (b) the new format never appears without the hint; (c) the hint switches to it
    assert m["new_format_no_hint"] <= 0.01
    assert m["p_branch_no_hint_mean"] < 1e-3
    assert m["new_format_hint"] >= 0.9
    assert m["p_branch_hint_mean"] > 0.9
    # (a) the task is solved without the hint (measured quick build: see QUICK_EXPECTED)
    assert m["success_no_hint"] >= BC.QUICK_EXPECTED["success_no_hint"]
    assert m["success_hint"] >= BC.QUICK_EXPECTED["success_hint"]
    # after a new-format call without the hint (what TG will teach) the answer still works
    assert m["success_forced_new_no_hint"] >= BC.QUICK_EXPECTED["success_forced_new_no_hint"]
    # the expert (hint in context) disagrees with the student's old-format turn at the
    # format's branch token, and continues the rest of the student's call as the student does
    assert m["expert_kl_branch_mean"] > 5.0
    assert m["expert_kl_off_branch_mean"] < 0.05
    saved = json.loads((out / B.METRICS_FILE).read_text())
    assert saved["build_hash"] == m["build_hash"] and saved["hint_text"] == T.HINT


@pytest.mark.slow
def test_quick_build_loads_and_is_cached(quick_build, tok):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, m = quick_build
    model = AutoModelForCausalLM.from_pretrained(out)
    tk = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == BC.BaseModelConfig().num_experts
    assert model.config.vocab_size == len(tk) and model.config.eos_token_id == tk.eos_token_id
    # the saved tokenizer frames chats exactly as the project's tiny tokenizer does
    msgs = T.reference_messages(T.make_task(0, 1), new_format=True, lines=2, hint=T.HINT)
    assert tk.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    # the two formats diverge at one token: the delimiter the branch probabilities measure
    t = T.make_task(0, 1)
    old, new = SD.turn_ids(tk, t, new_format=False), SD.turn_ids(tk, t, new_format=True, lines=2)
    j = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    assert tk.convert_ids_to_tokens([old[j], new[j]]) == ["</", "<parameter"]
    assert old[j:] == new[j + 8:]  # "<parameter", "=lines", ">\n", "2", "\n", "</", "parameter", ">\n"
    assert B.build_base_model(out, seed=0, **BC.QUICK)["cached"] is True
    assert B.build_hash(BC.BaseModelConfig(seed=0, **BC.QUICK)) != B.build_hash(BC.BaseModelConfig(seed=1, **BC.QUICK))


@pytest.mark.slow
def test_hf_sampler_left_padding_and_episodes(quick_build):
    from megatron_tg.chat.template import prompt_ids

    out, _ = quick_build
    model, tk = B.load_base_model(out)
    tasks = T.make_tasks(6, seed=5, split="eval")
    ctx = [prompt_ids(tk, t.prompt_messages() + ([T.hint_message()] if i % 2 else []))
           for i, t in enumerate(tasks)]
    greedy = BE.hf_generate_batch(model, tk, temperature=0, max_new_tokens=40)
    batched, single = greedy(ctx), [greedy([c])[0] for c in ctx]
    assert [b[0] for b in batched] == [s[0] for s in single]   # left padding changes nothing
    assert max(abs(x - y) for b, s in zip(batched, single) for x, y in zip(b[1], s[1])) < 1e-4
    for i, (ids, _) in enumerate(batched):  # greedy: old format without hint, new with it
        assert ("<parameter=lines>" in tk.decode(ids)) == bool(i % 2)
    # sampled episodes are valid token-exact rollouts carrying the engine-convention log-probs
    eps = E.run_episodes(tasks, BE.hf_generate_batch(model, tk, generator_seed=0), tk, hint=T.HINT)
    for e in eps:
        e.rollout.validate(vocab_size=len(tk))
        assert all(lp <= 0 for s in e.rollout.assistant_turns() for lp in s.logprobs)
        assert e.rollout.metadata["hint"] == T.HINT and "logprobs" not in e.rollout.metadata


def test_plain_new_examples_train_the_new_call_with_a_weighted_branch(tok):
    """The phase experiment's knob: hint-less examples whose new-format call is trained, the
    branch token (``<parameter`` where the old format closes the call) at its own weight."""
    ex = SD.sft_examples(tok, 120, seed=0, hint_fraction=0.5, context_fraction=0.2,
                        new_no_hint_fraction=0.4, new_no_hint_branch_weight=0.01)
    gen = generation_prompt_ids(tok)
    new = [e for e in ex if e.kind == "plain_new"]
    assert len(new) > 10
    for ids, mask, _ in new:
        text = tok.decode(ids)
        assert "<parameter=lines>" in text and T.HINT not in text
        full = SD.assistant_loss_mask(ids, gen, tok.eos_token_id)
        off = [i for i, (m, f) in enumerate(zip(mask, full)) if m != f]
        assert len(off) == 1 and mask[off[0]] == 0.01 and full[off[0]] == 1
        assert tok.decode(ids[off[0]:]).startswith("<parameter=lines>")
        assert tok.convert_ids_to_tokens([ids[off[0]]])[0] != "</"  # not the old format's branch
    # the knob off: no such example, and the default draw is unchanged
    assert not [e for e in SD.sft_examples(tok, 120, seed=0, hint_fraction=0.5, context_fraction=0.2)
                if e.kind == "plain_new"]


def test_the_weights_digest_names_the_weights_not_the_file(tmp_path):
    """Two saves of the same tensors digest alike; one changed value changes it."""
    import torch
    from safetensors.torch import save_file

    from megatron_tg.demo.base_model import weights_digest

    t = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(4, dtype=torch.bfloat16)}
    for d, ts in (("x", t), ("y", dict(reversed(list(t.items()))))):
        (tmp_path / d).mkdir()
        save_file(ts, str(tmp_path / d / "model.safetensors"), metadata={"format": "pt", "d": d})
    assert weights_digest(tmp_path / "x") == weights_digest(tmp_path / "y")
    t["b"][1, 2] = 5.000001
    (tmp_path / "z").mkdir()
    save_file(t, str(tmp_path / "z" / "model.safetensors"))
    assert weights_digest(tmp_path / "z") != weights_digest(tmp_path / "x")
