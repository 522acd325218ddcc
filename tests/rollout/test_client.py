"""SGLangClient against two real engine subprocesses: balancing, admin broadcast,
exactly-once accounting, failover when a server is SIGKILLed mid-generation."""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron_tg.parallel.ports import free_port
from megatron_tg.rollout.client import SGLangClient, SGLangClientError, SGLangRequestError
from megatron_tg.rollout.responses import GenerateResult

PROMPT = [5, 17, 42, 7, 99]
LONG = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def engines(engine_launcher, model_plain):
    es = engine_launcher([model_plain, model_plain])
    yield es
    for e in es:
        e.stop()


def run(coro):
    return asyncio.run(coro)


def test_generate_result_and_least_in_flight_balancing(engines):
    async def main():
        async with SGLangClient([e.url for e in engines], backoff_s=0.05) as c:
            rs = await asyncio.gather(*(c.generate([3 + i, 9], {"temperature": 0, "max_new_tokens": 8})
                                        for i in range(8)))
            return rs, c.stats

    rs, stats = run(main())
    assert all(isinstance(r, GenerateResult) for r in rs)
    r = rs[0]
    assert len(r.output_ids) == 8 == len(r.output_logprobs) and r.finish_type == "length"
    assert r.weight_version == "default" and r.text is None  # no tokenizer: skip-tokenizer-init shape
    assert r.meta_info["id"] == f"{r.rid}@0"
    assert {x.server for x in rs} == {e.url for e in engines}  # least-in-flight spreads 8 over both
    assert (stats.completed, stats.failed, stats.resubmitted, stats.duplicates_discarded) == (8, 0, 0, 0)


def test_client_abort(engines):
    async def main():
        async with SGLangClient([engines[0].url]) as c:
            task = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 1000, "ignore_eos": True}, rid="ab"))
            await asyncio.sleep(0.4)
            await c.abort("ab")
            return await task

    r = run(main())
    assert r.finish_type == "abort" and 0 < len(r.output_ids) < 1000


def test_admin_broadcast_and_weight_version(engines, model_plain, model_b):
    async def main():
        async with SGLangClient([e.url for e in engines]) as c:
            assert set(await c.pause_generation(mode="in_place")) == {e.url for e in engines}
            await c.continue_generation()
            await c.flush_cache()
            await c.update_weights_from_disk(str(model_b))
            after_b = await c.get_weight_version()
            r = await c.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})
            await c.update_weights_from_disk(str(model_plain), weight_version="back")
            return after_b, r, c.expected_weight_version, await c.get_weight_version()

    after_b, r, expected, final = run(main())
    assert set(after_b.values()) == {"1"} and r.weight_version == "1"
    assert expected == "back" and set(final.values()) == {"back"}


def test_hedged_request_answered_once_and_late_duplicate_counted(engines):
    async def main():
        async with SGLangClient([e.url for e in engines], hedge_after_s=0.05) as c:
            r = await c.generate(PROMPT, {**LONG, "sampling_seed": 5})
            for _ in range(100):  # the loser is aborted; its answer arrives and is discarded
                if c.stats.duplicates_discarded:
                    break
                await asyncio.sleep(0.05)
            return r, c.stats

    r, stats = run(main())
    assert len(r.output_ids) == 300 and r.finish_type == "length"
    assert (stats.completed, stats.hedged, stats.duplicates_discarded) == (1, 1, 1)


def test_timeout_fails_over(engines):
    async def main():
        # A server that accepts connections and never answers.
        async def silent(reader, writer):
            await asyncio.sleep(30)

        hole = await asyncio.start_server(silent, "127.0.0.1", 0)
        hole_url = f"http://127.0.0.1:{hole.sockets[0].getsockname()[1]}"
        try:
            async with SGLangClient([hole_url, engines[0].url], timeout_s=1.0, backoff_s=0.05) as c:
                r = await c.generate(PROMPT, {"max_new_tokens": 4})
                return r, c.stats, c.servers[0].failures
        finally:
            hole.close()

    r, stats, hole_failures = run(main())
    assert r.server == engines[0].url and r.attempts == 2
    assert stats.resubmitted == 1 and hole_failures == 1


def test_bad_request_is_not_retried(engines):
    async def main():
        async with SGLangClient([e.url for e in engines]) as c:
            with pytest.raises(SGLangRequestError) as ei:
                await c.generate(PROMPT, {"repetition_penalty": 1.5}, rid="bad-1")
            return str(ei.value), c.stats

    msg, stats = run(main())
    assert "bad-1" in msg and "HTTP 400" in msg and "127.0.0.1" in msg and stats.resubmitted == 0


def test_all_servers_down_names_request_and_servers():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def main():
        async with SGLangClient(dead, max_retries=2, backoff_s=0.01, probe_interval_s=60) as c:
            with pytest.raises(SGLangClientError) as ei:
                await c.generate(PROMPT, {"max_new_tokens": 2}, rid="lost-1")
            return str(ei.value), c.servers

    msg, servers = run(main())
    assert "lost-1" in msg and "failed after 3 attempts" in msg and dead[0] in msg
    assert not any(s.healthy for s in servers)


def test_server_killed_mid_generation_loses_nothing(engines):
    """Runs last in this module: it SIGKILLs the second engine."""
    n = 12

    async def main():
        async with SGLangClient([e.url for e in engines], backoff_s=0.05, probe_interval_s=60) as c:
            tasks = [asyncio.ensure_future(c.generate(PROMPT, {**LONG, "sampling_seed": i}, rid=f"r{i}"))
                     for i in range(n)]
            victim = c.servers[1]
            # Kill it mid-generation: all its requests admitted and some tokens generated.
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30:
                info = await c.get_server_info(servers=[victim.url])
                state = info[victim.url]["internal_states"][0]
                if state["num_running"] == victim.in_flight > 0 and state["decode_steps"] >= 20:
                    break
                await asyncio.sleep(0.01)
            assert victim.in_flight > 0 and not any(t.done() for t in tasks)
            engines[1].kill()
            results = await asyncio.gather(*tasks)
            health = await c.health()
            return results, c.stats, victim, health

    results, stats, victim, health = run(main())
    assert sorted(r.rid for r in results) == sorted(f"r{i}" for i in range(n))  # 0 lost, none twice
    assert all(len(r.output_ids) == 300 and r.finish_type == "length" for r in results)
    moved = [r for r in results if r.attempts > 1]
    assert moved and all(r.server == engines[0].url for r in moved)
    assert (stats.completed, stats.failed, stats.duplicates_discarded) == (n, 0, 0)
    assert stats.resubmitted == len(moved)
    assert not victim.healthy and health == {engines[0].url: True, engines[1].url: False}
