"""RolloutManager: staleness bound, accounting, backpressure, in-flight weight updates and
checkpoint round trips — with a fake engine (fast, scriptable) and with the real embedded
engine (one subprocess, also driving the agent harness end to end)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from megatron_tg.config.rollout import RolloutConfig
from megatron_tg.rollout.client import SGLangClient, SGLangClientError
from megatron_tg.rollout.manager import RolloutManager
from megatron_tg.rollout.manager_accounting import DROP_REASONS
from megatron_tg.rollout.responses import GenerateResult
from megatron_tg.rollout.types import Rollout, Segment

BASE = 100  # fake token id = BASE + the engine's weight version when it was sampled


class FakeEngine:
    """Duck-typed SGLangClient: ``chunk`` tokens every ``step_s`` seconds per request; pause
    modes as SGLang: in_place/retract freeze running requests, abort cuts them (partial
    output, finish abort); requests arriving while paused wait for continue."""

    def __init__(self, step_s: float = 0.001, chunk: int = 4):
        self.step_s, self.chunk = step_s, chunk
        self.version = 0
        self.abort_epoch = 0
        self.running = asyncio.Event()
        self.running.set()
        self.requests = 0
        self.live = 0

    async def generate(self, input_ids, sampling_params=None, return_logprob=True, rid=None):
        self.requests += 1
        p = sampling_params or {}
        marker = input_ids[0]
        if marker == 666:
            raise SGLangClientError(f"request {rid} failed after 4 attempts on all servers", rid)
        out: list[int] = []
        self.live += 1
        try:
            await self.running.wait()
            epoch = self.abort_epoch
            while len(out) < p.get("max_new_tokens", 16):
                if marker == 777 or self.abort_epoch != epoch:  # 777: the server keeps aborting it
                    return self._res(rid, out, "abort")
                await asyncio.sleep(self.step_s)
                await self.running.wait()
                if self.abort_epoch != epoch:
                    return self._res(rid, out, "abort")
                out += [BASE + self.version] * min(self.chunk, p["max_new_tokens"] - len(out))
            return self._res(rid, out, "length")
        finally:
            self.live -= 1

    def _res(self, rid, out, finish):
        return GenerateResult(rid, list(out), [-0.5] * len(out), {"type": finish}, str(self.version), "fake")

    async def pause_generation(self, mode="abort"):
        self.running.clear()
        if mode == "abort":
            self.abort_epoch += 1

    async def continue_generation(self):
        self.running.set()

    def set_version(self, v: int) -> None:
        self.version = v


def multi_turn_fn(turns: int = 2, tokens: int = 8):
    """A fake agent: ``turns`` generations separated by fixed tool tokens. The task dict's
    ``mode`` injects failures."""

    async def fn(ctx):
        mode = ctx.task.get("mode", "ok")
        marker = {"engine_error": 666, "abort": 777}.get(mode, 1)
        if mode == "bug":
            raise KeyError("harness bug")
        ids, segs = [marker, 2, 3], [Segment("prompt", 0, 3)]
        for t in range(turns):
            out = await ctx.generate(ids, max_new_tokens=tokens)
            s = len(ids)
            ids += out.ids
            lps = [0.5] * len(out.ids) if mode == "malformed" else out.logprobs  # log-prob > 0: invalid
            segs.append(Segment("assistant", s, len(ids), logprobs=lps, policy_version=out.version,
                                meta=out.segment_meta()))
            if t < turns - 1:
                ids += [4, 5]
                segs.append(Segment("tool", len(ids) - 2, len(ids)))
        return Rollout(task_id=ctx.task["id"], group_id=ctx.group_id, token_ids=ids, segments=segs,
                       finish_reason="stop")

    return fn


def cfg(**kw) -> RolloutConfig:
    base = dict(group_size=2, prompts_per_step=2, buffer_size=6, max_staleness=1, max_new_tokens=16,
                max_retries=2)
    c = RolloutConfig(**{**base, **kw})
    c.validate()
    return c


def tasks(n: int, **modes) -> list[dict]:
    """modes: {mode: [indices]}"""
    out = [{"id": f"t{i}"} for i in range(n)]
    for mode, idx in modes.items():
        for i in idx:
            out[i]["mode"] = mode
    return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def turn_versions(r: Rollout) -> list[int]:
    return [s.policy_version for s in r.assistant_turns()]


async def invariant_watch(m: RolloutManager, stop: asyncio.Event):
    """Check the accounting at every scheduling point while the test runs."""
    n = 0
    while not stop.is_set():
        m.check_invariants()
        n += 1
        await asyncio.sleep(0.002)
    return n


# --------------------------------------------------------------------------- fake engine
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_staleness_bound_holds_under_a_slow_trainer(staleness):
    async def main():
        eng = FakeEngine()
        m = RolloutManager(eng, multi_turn_fn(), tasks(200), cfg(max_staleness=staleness), epochs=None)
        stop = asyncio.Event()
        watch = asyncio.create_task(invariant_watch(m, stop))
        seen = []
        async with m:
            v = 0
            for step in range(8):
                batch = await m.get_batch(v, timeout=10)
                assert len(batch) == 2
                for g in batch:
                    assert g.version >= v - staleness, (g.group_id, g.version, v)
                    assert all(x >= v - staleness for r in g.rollouts for x in turn_versions(r))
                    seen.append(g.group_id)
                await asyncio.sleep(0.03)  # a slow trainer: generation races ahead
                await m.update_weights(eng.set_version, v + 1)
                v += 1
        stop.set()
        assert await watch > 10
        m.check_invariants()
        return m.counters(), seen

    c, seen = run(main())
    assert len(set(seen)) == len(seen) == 16
    assert c["trained"] == 16 and c["weight_updates"] == 8 and c["max_staleness_delivered"] <= staleness
    if staleness == 1:
        assert c["dropped_stale"] > 0  # the bound was exercised, not vacuous
    if staleness == 0:
        # Fully on-policy: no group beyond one step's worth is started per version, so
        # nothing is generated only to go stale, and each step trains the next prompts.
        assert c["dropped_stale"] == 0
        assert [int(g.split("@")[1]) for g in seen] == list(range(16))
    assert c["dropped"] == c["dropped_stale"]


def test_accounting_under_drops_and_engine_errors():
    modes = dict(engine_error=[1, 7], abort=[4], malformed=[10], bug=[13])

    async def main():
        eng = FakeEngine()
        m = RolloutManager(eng, multi_turn_fn(), tasks(20, **modes), cfg(buffer_size=4, max_staleness=100),
                           vocab_size=1000)
        stop = asyncio.Event()
        watch = asyncio.create_task(invariant_watch(m, stop))
        delivered, judge_failed = [], []
        async with m:
            v = 0
            while True:
                batch = await m.get_batch(v, timeout=10)
                if not batch:
                    break
                delivered += [g.index for g in batch]
                m.report_dropped(batch[0].group_id, "judge_error")  # the judge failed on one group
                judge_failed.append(batch[0].index)
                c = m.counters()
                assert c["taken"] == c["trained"] + c["dropped"] + c["in_flight"]
                await m.update_weights(eng.set_version, v + 1)
                v += 1
        stop.set()
        await watch
        with pytest.raises(KeyError):
            m.report_dropped(batch[0].group_id if batch else "nope")
        with pytest.raises(ValueError, match="reason must be one of"):
            m.report_dropped("x", "because")
        return m.counters(), delivered, judge_failed

    c, delivered, judge_failed = run(main())
    bad = {i for idx in modes.values() for i in idx}
    assert sorted(delivered) == sorted(set(range(20)) - bad)
    assert c["taken"] == 20 and c["in_flight"] == 0
    assert c["trained"] == 20 - len(bad) - len(judge_failed)
    assert {r: c[f"dropped_{r}"] for r in DROP_REASONS} == {
        "stale": 0, "engine_error": 3, "malformed": 1, "judge_error": len(judge_failed), "rollout_error": 1,
        "wrong_version": 0}
    assert c["taken"] == c["trained"] + c["dropped"]


def test_backpressure():
    async def main():
        eng = FakeEngine()
        m = RolloutManager(eng, multi_turn_fn(), tasks(50), cfg(buffer_size=4))  # <= 8 rollouts at once
        peak = 0
        async with m:
            for _ in range(150):  # nobody consumes
                await asyncio.sleep(0.002)
                peak = max(peak, eng.live)
            c1, r1 = m.counters(), eng.requests
            await asyncio.sleep(0.1)
            c2, r2 = m.counters(), eng.requests
            drained = []
            while m.counters()["buffered"] >= 4:
                drained += await m.get_batch(0)
            await asyncio.sleep(0.2)
            c3 = m.counters()
        return peak, c1, c2, c3, r1, r2, drained

    peak, c1, c2, c3, r1, r2, drained = run(main())
    assert peak == 8  # max_inflight_rollouts = buffer_size * group_size
    # full buffer: no new prompt starts; groups already running finish into it (<= 4 + 8/2)
    assert c1["generating"] == 0 and 4 <= c1["buffered"] <= 8 and c1["taken"] == c1["buffered"]
    assert c2 == c1 and r2 == r1 == c1["taken"] * 2 * 2  # groups x rollouts x turns, then nothing
    assert c3["taken"] > c1["taken"] and c3["taken"] == len(drained) + c3["buffered"] + c3["generating"]


@pytest.mark.parametrize("mode", ["in_place", "abort"])
def test_update_weights_mid_generation_keeps_per_turn_versions(mode):
    async def main():
        eng = FakeEngine(step_s=0.004, chunk=2)
        m = RolloutManager(eng, multi_turn_fn(turns=3, tokens=20), tasks(6),
                           cfg(max_staleness=10, pause_mode=mode, buffer_size=6))
        groups = []
        async with m:
            for v in (1, 2):
                while eng.live < 4:  # updates land while turns are being generated
                    await asyncio.sleep(0.002)
                await asyncio.sleep(0.01)
                await m.update_weights(eng.set_version, v)
            while True:
                b = await m.get_batch(2, num_groups=6)
                groups += b
                if not b:
                    break
        return groups, m.counters()

    groups, c = run(main())
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == 12 and c["trained"] == 6 and c["dropped"] == 0
    spanning = resubmitted = multi_version = 0
    for r in rollouts:
        tv = turn_versions(r)
        assert tv == sorted(tv)
        multi_version += len(set(tv)) > 1
        for seg in r.assistant_turns():
            toks = r.token_ids[seg.start:seg.end]
            made_by = sorted({t - BASE for t in toks})
            assert len(toks) == 20 and len(seg.logprobs) == 20  # pieces concatenated exactly
            assert seg.policy_version == made_by[0]  # the OLDEST weights that produced the turn
            assert set(made_by) <= set(seg.meta["versions"])
            spanning += len(made_by) > 1
            resubmitted += seg.meta.get("resubmits", 0) > 0
    assert spanning > 0 and multi_version > 0  # turns continued across an update; rollouts too
    assert (resubmitted > 0) == (mode == "abort")
    assert groups[0].version == 0 and groups[0].newest_version >= 1


def test_state_dict_round_trip_requeues_in_flight_work():
    n = 24

    async def first():
        eng = FakeEngine(step_s=0.003)
        m = RolloutManager(eng, multi_turn_fn(), tasks(n), cfg())
        async with m:
            got = (await m.get_batch(0)) + (await m.get_batch(0))
            await m.update_weights(eng.set_version, 1)
            while m.counters()["generating"] == 0 or m.counters()["buffered"] == 0:
                await asyncio.sleep(0.002)
        m.check_invariants()
        c = m.counters()
        # stopped: what was generating is queued again; finished groups stay buffered
        assert c["generating"] == 0 and c["queued"] > 0 and c["buffered"] > 0
        assert c["in_flight"] == c["queued"] + c["buffered"]
        return [g.index for g in got], json.loads(json.dumps(m.state_dict())), c

    async def second(state):
        eng = FakeEngine()
        eng.set_version(1)
        m = RolloutManager(eng, multi_turn_fn(), tasks(n), cfg())
        m.load_state_dict(state)
        c0 = m.counters()
        got = []
        async with m:
            while True:
                b = await m.get_batch(1)
                if not b:
                    break
                got += [g.index for g in b]
        m.check_invariants()
        return got, c0, m.counters()

    got1, state, c1 = run(first())
    got2, c0, c2 = run(second(state))
    assert c0["in_flight"] == len(state["pending"]) == c1["in_flight"] and c0["taken"] == c1["taken"]
    assert c0["policy_version"] == 1
    assert sorted(got1 + got2) == list(range(n))  # nothing lost, nothing twice
    assert c2["taken"] == c2["trained"] == n and c2["in_flight"] == 0 and c2["dropped"] == 0
    with pytest.raises(ValueError, match="4 tasks"):
        RolloutManager(FakeEngine(), multi_turn_fn(), tasks(4), cfg()).load_state_dict(state)


def test_regenerate_policy_replaces_stale_groups():
    async def main():
        eng = FakeEngine()
        # buffer 6, 2 groups a step, staleness 1: groups buffered at version v are still
        # there at v + 2, stale, and regenerated.
        m = RolloutManager(eng, multi_turn_fn(), tasks(100), cfg(max_staleness=1, stale_policy="regenerate",
                                                                   buffer_size=6))
        ids = []
        async with m:
            for v in range(5):
                for g in await m.get_batch(v, timeout=10):
                    assert g.version >= v - 1
                    ids.append(g.group_id)
                await asyncio.sleep(0.02)
                await m.update_weights(eng.set_version, v + 1)
        m.check_invariants()
        return ids, m.counters()

    ids, c = run(main())
    assert c["regenerated"] > 0 and c["trained"] == 10
    assert any(".r" in g for g in ids)  # a regenerated prompt made it into a batch
    assert c["dropped_stale"] <= c["regenerated"]


def test_a_rollout_function_that_always_fails_stops_the_run():
    async def main():
        m = RolloutManager(FakeEngine(), multi_turn_fn(), tasks(50, bug=range(50)), cfg(),
                           max_consecutive_failures=3)
        async with m:
            with pytest.raises(RuntimeError, match="3 groups in a row failed; the last \\(rollout_error\\)"):
                await m.get_batch(0, timeout=10)
        m.check_invariants()
        return m.counters()

    c = run(main())
    assert c["dropped_rollout_error"] >= 3 and c["taken"] < 50  # the dataset was not burnt


def test_trainer_ahead_of_engines_is_an_error():
    async def main():
        m = RolloutManager(FakeEngine(), multi_turn_fn(), tasks(4), cfg(max_staleness=1))
        with pytest.raises(ValueError, match="update the engines' weights first"):
            await m.get_batch(2)
        with pytest.raises(ValueError, match="num_groups"):
            await m.get_batch(0, num_groups=7)
        await m.stop()

    run(main())


class RestartedBehind(FakeEngine):
    """The first ``wrong`` answers come from an engine back on its base weights ("default",
    tokens BASE - 1) that a router still sends requests to; the rest from the live one."""

    def __init__(self, wrong: int, version: int):
        super().__init__()
        self.wrong, self.version = wrong, version

    async def generate(self, input_ids, sampling_params=None, return_logprob=True, rid=None):
        if self.wrong > 0:
            self.wrong -= 1
            n = (sampling_params or {}).get("max_new_tokens", 16)
            return GenerateResult(rid, [BASE - 1] * n, [-0.5] * n, {"type": "length"}, "default", "back")
        return await super().generate(input_ids, sampling_params, return_logprob, rid)


def test_answers_from_another_weight_version_are_discarded_and_counted():
    """An answer whose engine weight_version is not the turn's policy version is never
    trained as that version: its tokens are dropped and the turn is sent again; a turn that
    never gets a right answer drops its group (reason wrong_version)."""
    async def main(wrong):
        m = RolloutManager(RestartedBehind(wrong, version=3), multi_turn_fn(), tasks(40), cfg(max_staleness=0),
                           initial_version=3, max_consecutive_failures=3)
        async with m:
            batch = await m.get_batch(3, timeout=10) if wrong < 100 else None
            if batch is None:
                with pytest.raises(RuntimeError, match="wrong_version"):
                    await m.get_batch(3, timeout=10)
        m.check_invariants()
        return batch, m.counters()

    batch, c = run(main(wrong=2))  # at most max_retries per turn: every turn is saved
    for g in batch:
        for r in g.rollouts:
            assert BASE - 1 not in r.token_ids  # none of the base-weight tokens
            assert all(seg.meta["weight_version"] == "3" and seg.policy_version == 3
                       for seg in r.assistant_turns())
    assert c["wrong_version"] == 2 and c["dropped"] == 0
    _, c = run(main(wrong=10 ** 6))  # every answer from the wrong weights
    assert c["dropped_wrong_version"] >= 3 and c["dropped"] == c["dropped_wrong_version"]
    assert c["wrong_version"] >= 3 * (cfg().max_retries + 1) and c["trained"] == 0


def test_a_manager_adopts_the_version_pushed_before_it_starts():
    """A trainer resumed from a checkpoint without rollout state (an SFT checkpoint, as
    ``megatron-tg eval`` loads) pushes step N's weights straight to new engines; the manager,
    made at version 0, adopts N, and its rollouts are kept instead of all discarded."""
    async def main(adopt):
        m = RolloutManager(RestartedBehind(0, version=6), multi_turn_fn(), tasks(40), cfg(max_staleness=0),
                           initial_version=0, max_consecutive_failures=3)
        if adopt:
            m.adopt_version(6)
            with pytest.raises(ValueError, match="older"):
                m.adopt_version(5)
        async with m:
            if not adopt:
                with pytest.raises(RuntimeError, match="wrong_version"):
                    await m.get_batch(0, timeout=10)
                return None, m.counters()
            batch = await m.get_batch(6, timeout=10)
        m.check_invariants()
        return batch, m.counters()

    batch, c = run(main(adopt=True))
    assert c["wrong_version"] == 0 and c["dropped"] == 0
    assert all(seg.policy_version == 6 and seg.meta["weight_version"] == "6"
               for g in batch for r in g.rollouts for seg in r.assistant_turns())
    _, c = run(main(adopt=False))  # what eval did: every answer from "the wrong weights"
    assert c["trained"] == 0 and c["dropped_wrong_version"] >= 3


# --------------------------------------------------------------------------- real engine
@pytest.fixture(scope="module")
def tok():
    from megatron_tg.chat import get_tiny_tokenizer

    return get_tiny_tokenizer()


@pytest.fixture(scope="module")
def sandbox():
    from megatron_tg.agent.sandbox import BWRAP_APT_HINT, Limits, Sandbox, bwrap_path

    if bwrap_path() is None:
        msg = f"bubblewrap (bwrap) not installed; harness-on-engine test skipped. Install: {BWRAP_APT_HINT}"
        print(msg)
        pytest.skip(msg)
    return Sandbox("bwrap", limits=Limits(wall_s=10, cpu_s=5, memory_mb=512))


def _tiny_chat_model(path, seed: int, vocab: int):
    """A tiny Qwen3-MoE over the tiny chat tokenizer's vocabulary (the conftest models have
    300 ids), long enough for the harness's system prompt with tool specs."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg_ = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=4096, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    transformers.Qwen3MoeForCausalLM(cfg_).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_engine(engine_launcher, tmp_path_factory, tok):
    vocab = len(tok)
    a = _tiny_chat_model(tmp_path_factory.mktemp("chat_a"), 0, vocab)
    b = _tiny_chat_model(tmp_path_factory.mktemp("chat_b"), 1, vocab)
    (engine,) = engine_launcher([a])
    yield engine, a, b, vocab
    engine.stop()


def test_real_engine_staleness_versions_and_accounting(chat_engine):
    engine, model_a, model_b, vocab = chat_engine

    async def main():
        async with SGLangClient([engine.url], backoff_s=0.05) as client:
            c = cfg(max_staleness=1, buffer_size=4, pause_mode="in_place", max_new_tokens=12)
            m = RolloutManager(client, multi_turn_fn(turns=3, tokens=12), tasks(12), c,
                               sampling_params={"ignore_eos": True}, vocab_size=vocab)
            got = []
            async with m:
                v = 0
                while True:
                    batch = await m.get_batch(v, timeout=30)
                    if not batch:
                        break
                    got += batch
                    assert all(g.version >= v - 1 for g in batch)
                    m.check_invariants()
                    path = model_b if v % 2 == 0 else model_a
                    # in_place keeps requests running, where SGLang refuses a flush: do not ask for one
                    await m.update_weights(client.update_weights_from_disk, str(path), weight_version=str(v + 1),
                                           flush_cache=False)
                    v += 1
            return got, m.counters()

    got, c = run(main())
    assert c["taken"] == 12 == c["trained"] + c["dropped"] and c["in_flight"] == 0
    assert c["dropped"] == c["dropped_stale"] and c["weight_updates"] >= 3
    for g in got:
        for r in g.rollouts:
            r.validate(vocab_size=vocab)
            assert turn_versions(r) == sorted(turn_versions(r))
            for seg in r.assistant_turns():
                wv = seg.meta.get("weight_version")
                assert wv == "default" or int(wv) in seg.meta["versions"]


def test_real_engine_drives_the_agent_harness(chat_engine, tok, sandbox):
    from megatron_tg.agent import AgentHarness, builtin_tasks

    engine, _, _, vocab = chat_engine
    c = replace(RolloutConfig(), group_size=2, prompts_per_step=2, buffer_size=2, max_new_tokens=24,
                max_turns=3)

    async def main():
        async with SGLangClient([engine.url], backoff_s=0.05) as client:
            # the module's engine may hold a version an earlier test set: the manager starts
            # at it, since answers from another version are discarded
            served = (await client.get_weight_version())[engine.url]
            m = RolloutManager(client, AgentHarness(tok, c, sandbox=sandbox), builtin_tasks()[:2], c,
                               vocab_size=vocab, initial_version=int(served) if served.isdigit() else 0)
            async with m:
                return await m.get_batch(0, timeout=60), m.counters(), m.version

    batch, counters, served = run(main())
    assert len(batch) == 2 and counters["trained"] == 2 and counters["wrong_version"] == 0
    for g in batch:
        for r in g.rollouts:  # a random model: one turn cut by max_new_tokens, tests fail
            assert r.finish_reason in ("length", "stop", "max_turns") and r.metadata["tests_passed"] is False
            assert r.turn(0).meta["versions"] == [served] and len(r.turn(0).logprobs) == r.turn(0).end - r.turn(0).start
