"""The paper suite's environment, its SFT data and the suite's claim rules (no model is
trained here: the suite's runs are measured in the README, not in CI)."""

from __future__ import annotations

import argparse
import random

import pytest

from megatron_tg.chat.builder import simulate_rollout
from megatron_tg.chat.feedback import insert_feedback
from megatron_tg.chat.tokenizer import get_tiny_tokenizer
from megatron_tg.config.rollout import JudgeConfig
from megatron_tg.demo import claims as C
from megatron_tg.demo import paper_base as PB
from megatron_tg.demo import paper_env as P
from megatron_tg.demo import paper_suite as S
from megatron_tg.demo import task as T
from megatron_tg.judge import Judge
from megatron_tg.sampling.rollouts import feedback_for

ALL_NEW = {(k, c): True for k, cs in enumerate(P.TURN_CRITERIA) for c in cs}


@pytest.fixture(scope="module")
def tok():
    return get_tiny_tokenizer()


def _judge(tok, task, behaviour):
    ro = simulate_rollout(tok, P.reference_messages(task, behaviour, lines=2), task_id=task.id)
    return ro, Judge(P.rubric(), tok).judge_sync(ro, task)


def test_old_turns_fail_every_style_criterion_where_the_hints_say(tok):
    """The judge's feedback for the student's usual (all-old) episode, framed as the trainer
    frames it, is exactly the hint the base model is trained with, turn by turn."""
    t = T.make_task(0, 3, "eval")
    ro, res = _judge(tok, t, {})
    assert res.passed == {"answer": True, "search_lines": False, "answer_style": False,
                          "brief_thinking": False}
    frame = JudgeConfig.feedback_framing
    got = {k: frame.replace("{feedback}", v) for k, v in res.feedback_by_turn().items()}
    assert got == P.all_fail_hints()
    # always-on feedback (paper Fig. 5): the same texts on every turn the criteria cover
    always = {k: frame.replace("{feedback}", v) for k, v in feedback_for(ro, res, P.rubric(), True).items()}
    assert always == P.all_fail_hints()


def test_new_turns_pass_everything_and_each_criterion_fails_alone(tok):
    t = T.make_task(0, 4, "eval")
    _, res = _judge(tok, t, ALL_NEW)
    assert all(res.passed.values()), res.passed
    for (k, c) in ALL_NEW:
        _, res = _judge(tok, t, {**ALL_NEW, (k, c): False})
        assert [n for n, ok in res.passed.items() if not ok] == [c]
        assert res.feedback_by_turn() == {k: P.FEEDBACK[c]}


def test_checkers_refuse_the_shortcuts(tok):
    t = T.make_task(0, 5, "eval")
    msgs = P.reference_messages(t, ALL_NEW, lines=2)
    for m in msgs:  # drop the thinking: not a way to be brief
        m.pop("reasoning_content", None)
    res = Judge(P.rubric(), tok).judge_sync(simulate_rollout(tok, msgs), t)
    assert res.passed["brief_thinking"] is False and res.passed["answer"] is True
    assert P.check_brief_thinking(" ".join(["w"] * P.BRIEF_MAX_WORDS), None) == (True, "")
    assert P.check_brief_thinking(" ".join(["w"] * (P.BRIEF_MAX_WORDS + 1)), None)[0] is False
    assert P.check_answer_style("Answer: 55", None)[0] and P.check_answer_style("Answer: 55.", None)[0]
    for bad in ("Answer: 55 or 56", "The value is 55. Answer: 55", "answer: 55", "Answer:"):
        assert P.check_answer_style(bad, None)[0] is False, bad
    # the style is not the task: a styled wrong value fails the answer
    msgs = P.reference_messages(t, ALL_NEW, lines=2)
    msgs[-1]["content"] = f"Answer: {t.value + 1 if t.value < 99 else 10}"
    res = Judge(P.rubric(), tok).judge_sync(simulate_rollout(tok, msgs), t)
    assert res.passed["answer_style"] is True and res.passed["answer"] is False


def test_episode_metrics_agree_with_the_judge(tok):
    from megatron_tg.chat.parsing import parse_assistant

    t = T.make_task(0, 6, "eval")
    for beh in ({}, ALL_NEW, {(0, "search_lines"): True, (1, "brief_thinking"): True}):
        ro, res = _judge(tok, t, beh)
        turns = [parse_assistant(tok.decode(ro.token_ids[s.start:s.end])) for s in ro.assistant_turns()]
        m = P.episode_metrics(t, turns)
        assert m["answer_style"] == res.passed["answer_style"]
        assert m["brief_thinking"] == res.passed["brief_thinking"]
        assert m["new_format"] == res.passed["search_lines"]
        assert m["all_criteria"] == all(res.passed.values())


def test_sft_example_is_the_trainer_expert_context_and_the_chat_template(tok):
    """Two independent paths give the same tokens: the SFT example (the trainer's
    insert_feedback on the hint-less rollout) and the chat template rendering the hints as
    messages where the trainer puts them."""
    cfg = PB.config(0)
    rng = random.Random(1)
    seen = set()
    for i in range(60):
        t = T.make_task(0, i, "sft")
        ch = PB.draw_example(rng, t, cfg)
        ex = PB.sft_example(tok, t, ch)
        hints = {k: P.hint_for(cs) for k, cs in ch["hints"].items()}
        text = tok.apply_chat_template(P.reference_messages(t, ch["behaviour"], lines=ch["lines"],
                                                            hints=hints), tokenize=False)
        assert tok.decode(ex.ids) == text[:text.rindex(tok.eos_token) + len(tok.eos_token)]
        seen.add((bool(ch["hints"]), bool(ch["masked"]), ch["context"]))
        trained = {tok.decode([x]) for x, w in zip(ex.ids, ex.mask) if w}
        assert "Feedback" not in "".join(trained)  # hints are context, never targets
    assert {(True, True, False), (True, False, False), (False, False, True), (False, False, False)} <= seen


def test_old_turns_under_a_hint_mask_exactly_their_departures(tok):
    """A hinted criterion shown old has the tokens where it departs from the new behaviour
    out of the loss (thinking and action), and nothing else of the turn."""
    t = T.make_task(0, 7, "sft")
    # the old tokens at the departures: "." ends the plan where "with lines" would go; "</"
    # closes the call where "<parameter=lines>" would open
    for c, want in (("search_lines", [".", "</"]), ("brief_thinking", ["The"])):
        ch = {"hints": {0: (c,)}, "behaviour": {}, "masked": [(0, c)], "context": False, "lines": 2}
        ex = PB.sft_example(tok, t, ch)
        full = PB.sft_example(tok, t, {**ch, "masked": []})
        assert ex.ids == full.ids
        off = [i for i, (a, b) in enumerate(zip(ex.mask, full.mask)) if a != b]
        got = [tok.decode([ex.ids[i]]).strip() for i in off]
        assert sorted(got) == sorted(want), got
    # the departures of a diff, with the common prefix first
    assert PB.departures([1, 2, 3, 4], [1, 2, 9, 3, 4]) == [2]
    assert PB.departures([1, 2, 3], [1, 2, 3]) == []
    assert PB.departures([1, 5, 3, 6], [1, 2, 3, 4]) == [1, 3]


def test_reversals_count_falls_between_windows():
    """(The claims' rules on these measures: tests/demo/test_claims.py.)"""
    assert S.reversals([0, 0, 0, .9, .9, .9, .5, .5, .5, .9, .9, .9]) == 1
    assert S.reversals([0, .3, .6, .9, 1, 1, .85, .8, .8]) == 0  # falls of 0.15: noise, not a reversal
    assert S.reversals([1, 1, 1, .5, .5, .5, 1, 1, 1, .2, .2, .2]) == 2


def test_suite_runs_and_arguments():
    from megatron_tg.demo.command import _bad_arguments, add_arguments

    specs = S.run_specs((0, 1))
    assert len(specs) == 2 * len(S.RUNS) and len({s.name for s in specs}) == len(specs)
    lam = next(s for s in specs if s.name == "lambda_10-s1")
    assert lam.overrides() == ["objective.mode=tg", "seed=1", "objective.kl_coef=10.0"]
    assert S.plan().rl_args == ("--env", "paper") and S.plan().seeded
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert _bad_arguments(ap.parse_args(["--suite", "paper", "--seeds", "2"])) is None
    assert "--suite paper" in _bad_arguments(ap.parse_args(["--suite", "paper", "--full"]))


def test_rollout_side_env_is_checked():
    from megatron_tg.demo.rl import make_rollout_side

    with pytest.raises(ValueError, match="env must be one of"):
        make_rollout_side(env="other")
    with pytest.raises(ValueError, match="probe"):
        make_rollout_side(probe_every=5, env="paper")


def test_agent_with_the_paper_verdicts_and_their_rates(tok):
    """DemoAgent with the paper environment's verdicts: the rollout the judge scores and the
    ``demo/*`` rates the suite plots agree."""
    import asyncio

    from megatron_tg.chat.template import assistant_generation_text, encode
    from megatron_tg.demo.agent import DemoAgent
    from megatron_tg.demo.rl import episode_rates
    from megatron_tg.rollout.context import TurnOutput

    t = T.make_task(0, 8)
    beh = {(0, "search_lines"): True, (1, "answer_style"): True}
    turns = [encode(tok, assistant_generation_text(tok, m))
             for m in P.reference_messages(t, beh, lines=2) if m["role"] == "assistant"]

    class Ctx:
        task, group_id, rollout_id = t, "g", "g/0"
        n = 0

        async def generate(self, ids, max_new_tokens=None):
            out = turns[Ctx.n]
            Ctx.n += 1
            return TurnOutput(out, [-0.5] * len(out), 1, [1], "stop")

        def tool_slot(self):
            import contextlib
            return contextlib.nullcontext()

    ro = asyncio.run(DemoAgent(tok, metrics_fn=P.episode_metrics)(Ctx()))
    res = Judge(P.rubric(), tok).judge_sync(ro, t)
    assert res.passed == {"answer": True, "search_lines": True, "answer_style": True, "brief_thinking": False}
    rates = episode_rates([ro])
    assert rates["demo/answer_style"] == 1.0 and rates["demo/brief_thinking"] == 0.0
    words = [len(P.thinking_text(t, k, new=True, brief=False, lines=2).split()) for k in (0, 1)]
    assert rates["demo/all_criteria"] == 0.0 and rates["demo/thinking_words"] == sum(words) / 2 == 16.5
    assert rates["demo/new_format"] == 1.0 and rates["demo/success"] == 1.0


def test_a_tiny_build_runs_every_measurement(tmp_path):
    """The build's code path end to end at a size that learns nothing (seconds): every rate
    and decision probability is there and in range, and the build is reused by hash."""
    import torch

    n = torch.get_num_threads()
    try:
        kw = dict(steps=3, pool_size=48, tokenizer_docs=60, eval_episodes=4, warmup_steps=1)
        m = PB.build(tmp_path / "b", seed=0, **kw)
        n = kw["eval_episodes"]
        assert m["eval_episodes"] == n
        for c in P.STYLE_CRITERIA:
            for cond in ("no_hint", "all_hints", f"hint_{c}"):
                assert m[f"{c}_{cond}"] * n == pytest.approx(round(m[f"{c}_{cond}"] * n))  # k of n episodes
        # the decision probabilities are those of the saved model, recomputed here
        from megatron_tg.demo.base_model import load_base_model

        model, btok = load_base_model(tmp_path / "b")
        ps = PB.decision_probabilities(model, btok, T.make_tasks(n, seed=0, split="eval"))
        for c in P.STYLE_CRITERIA:
            assert m[f"p_decision_no_hint_{c}_mean"] == pytest.approx(sum(ps[c]) / len(ps[c]), rel=1e-5)
            assert m[f"p_decision_no_hint_{c}_max"] == pytest.approx(max(ps[c]), rel=1e-5)
        assert m["env"] == "paper" and not m["cached"]
        assert PB.build(tmp_path / "b", seed=0, **kw)["cached"] is True
        assert PB.build_hash(PB.config(0, **kw)) != PB.build_hash(PB.config(1, **kw))
    finally:
        torch.set_num_threads(n)


def test_covered_feedback_names_every_criterion_of_a_failing_turn_only(tok):
    """objective.expert_feedback=covered: a turn failing one criterion gets the feedback of
    all its criteria (a lagging expert is told to keep the others); passing turns get none."""
    t = T.make_task(0, 9, "eval")
    beh = {**ALL_NEW, (0, "search_lines"): False}  # turn 0 fails the format only; turn 1 passes
    ro, res = _judge(tok, t, beh)
    assert res.feedback_by_turn() == {0: P.LINES_FEEDBACK}
    assert feedback_for(ro, res, P.rubric(), False, covered=True) == \
        {0: "\n".join([P.LINES_FEEDBACK, P.BRIEF_FEEDBACK])}
    assert feedback_for(ro, res, P.rubric(), False) == {0: P.LINES_FEEDBACK}
    ro, res = _judge(tok, t, ALL_NEW)
    assert feedback_for(ro, res, P.rubric(), False, covered=True) == {}


def test_expert_feedback_is_validated():
    from megatron_tg.config import load_config
    from megatron_tg.config.base import ConfigError

    assert load_config(S.RECIPE, ["objective.expert_feedback=covered"]).objective.expert_feedback == "covered"
    with pytest.raises(ConfigError, match="expert_feedback"):
        load_config(S.RECIPE, ["objective.expert_feedback=all"])


def test_measures_table_and_plot_from_run_directories(tmp_path):
    """The suite's report from metrics.jsonl files (as the trainer writes them): a run whose
    format criterion rises then falls twice counts two reversals; the table and plot render."""
    import json

    def write(d, fmt, passed, ent):
        d.mkdir(parents=True)
        with open(d / "metrics.jsonl", "w") as f:
            for i, (a, p, e) in enumerate(zip(fmt, passed, ent), start=1):
                f.write(json.dumps({"step": i, "criteria/search_lines": a, "criteria/answer_style": 1.0,
                                    "criteria/brief_thinking": 1.0, "criteria/answer": p,
                                    "demo/all_criteria": a * p, "entropy/all": e,
                                    "rollout/response_tokens": 60.0}) + "\n")

    osc = [0, 0, 0, 1, 1, 1, .2, .2, .2, 1, 1, 1, .3, .3, .3]
    dirs = {}
    for name, _, _ in S.RUNS:
        d = tmp_path / name
        if name == "lambda_10":
            write(d, [1.0] * 15, [1, 1, 1, .9, .2, .1, .1, .1, .1, .1, .1, .1, .1, .1, .1],
                  [.01, .01, .05, .08, .03] + [.02] * 10)
        else:
            write(d, osc if name == "tg_failing" else [min(1.0, i / 5) for i in range(15)], [1.0] * 15, [.01] * 15)
        dirs[name] = [d]
    m = {n: [S.measure(d) for d in ds] for n, ds in dirs.items()}
    assert sum(m["tg_failing"][0]["reversals"].values()) == 2
    lam = m["lambda_10"][0]
    assert lam["collapse_step"] == 6 and lam["entropy_peak_step"] == 4
    assert C.relative_spike(lam, m["grpo"][0]) == pytest.approx(8.0)  # GRPO's entropy: 0.01 throughout
    assert m["tg"][0]["collapse_step"] is None
    c = S.claims(m)
    assert c["feedback"]["reproduced"] and c["fig6"]["reproduced"]
    assert not c["fig7"]["reproduced"]  # no_thinking learned like tg here: no reversal
    rows = {ln.split()[0]: ln.split() for ln in S.table(m).splitlines()[1:]}
    assert set(rows) == {name for name, _, _ in S.RUNS}
    assert rows["lambda_10"][-2:] == ["8.00", "6"] and rows["tg_failing"][-3] == "2"
    import matplotlib.image as mpimg

    img = mpimg.imread(S.plot(tmp_path / "p.png", dirs))
    assert img.shape[:2] == (792, 1760)  # 16 x 7.2 inches at 110 dpi: the six panels
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_covered_feedback_with_one_style_criterion_is_the_failed_feedback(tok):
    """The main demo's rubric has one criterion with feedback: there ``covered`` (its
    recipe's setting) gives the same expert context as the paper's failed-only feedback,
    also for a turn cut inside its call."""
    from megatron_tg.chat.template import encode

    from megatron_tg.chat.builder import RolloutBuilder

    t = T.make_task(0, 10, "eval")
    cut = encode(tok, "<tool_call>\n<function=search>\n<parameter=query>\nk1")
    b = RolloutBuilder(tok, t.prompt_messages(), task_id=t.id)
    b.add_assistant(cut, [0.0] * len(cut), 0)
    ro = b.build("length")
    res = Judge(T.rubric(), tok).judge_sync(ro, t)
    assert res.feedback_by_turn() == {0: T.FEEDBACK}
    assert feedback_for(ro, res, T.rubric(), False, covered=True) == {0: T.FEEDBACK}
    for new_format in (False, True):  # whole episodes: old format fails, new passes
        ro = simulate_rollout(tok, T.reference_messages(t, new_format=new_format, lines=2))
        res = Judge(T.rubric(), tok).judge_sync(ro, t)
        assert feedback_for(ro, res, T.rubric(), False, covered=True) == res.feedback_by_turn() == \
            ({} if new_format else {0: T.FEEDBACK})


def test_wrong_answer_fraction_makes_that_share_of_demonstrations_answer_wrong(tok):
    """wrong_answer_fraction (issue 38's base with a task gradient): about that share of the
    demonstrations state a wrong value (the second search line's), trained on; at 0 no draw
    is made, so the default base's data is what it was."""
    import random

    from megatron_tg.demo import paper_base as PB

    n = 400
    cfg = PB.config(0, pool_size=n, wrong_answer_fraction=0.5)
    tasks = [T.make_task(0, i, "sft") for i in range(n)]
    rng = random.Random("t")
    choices = [PB.draw_example(rng, t, cfg) for t in tasks]
    wrong = [c["wrong"] for c in choices]
    assert 0.4 < sum(wrong) / n < 0.6
    for t, c in list(zip(tasks, choices))[:40]:
        ex = PB.sft_example(tok, t, c)
        import re

        answer = tok.decode([i for i, m in zip(ex.ids, ex.mask) if m > 0]).split("</think>")[-1]
        stated = int(re.findall(r"[0-9]+", answer)[-1])  # the answer turn's value
        assert P.wrong_value(t) != t.value
        assert stated == (P.wrong_value(t) if c["wrong"] else t.value), (answer, c["wrong"], t.value)
    plain = [PB.draw_example(random.Random("t"), t, PB.config(0, pool_size=n)) for t in tasks[:5]]
    assert not any(c["wrong"] for c in plain)


def test_skip_search_fraction_makes_that_share_of_demonstrations_answer_without_searching(tok):
    """skip_search_fraction (the stability base, after wrong_answer_fraction's failed build):
    about that share of the demonstrations answer at once with no value, one turn, no tool
    call, no hint; the others search and copy the right value; at 0 no draw is made."""
    import re

    n = 400
    cfg = PB.config(0, pool_size=n, skip_search_fraction=0.5)
    tasks = [T.make_task(0, i, "sft") for i in range(n)]
    choices = [PB.draw_example(random.Random(f"t{i}"), t, cfg) for i, t in enumerate(tasks)]
    skip = [c["skip"] for c in choices]
    assert 0.4 < sum(skip) / n < 0.6
    for t, c in list(zip(tasks, choices))[:40]:
        ex = PB.sft_example(tok, t, c)
        text = tok.decode(ex.ids)
        answer = tok.decode([i for i, m in zip(ex.ids, ex.mask) if m > 0]).split("</think>")[-1]
        numbers = re.findall(r"\b[0-9]+\b", answer)
        if c["skip"]:
            assert "<tool_call>" not in text and "answer without searching" in text.lower() and ex.kind == "plain"
            assert not numbers and f"I do not know {t.key}." in answer, answer
        else:
            assert "<tool_call>" in text and int(numbers[-1]) == t.value
    plain = [PB.draw_example(random.Random(f"t{i}"), t, PB.config(0, pool_size=n)) for i, t in enumerate(tasks[:5])]
    assert not any(c["skip"] for c in plain)
