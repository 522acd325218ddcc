"""Environment-worker admission: at most ``limit`` tool calls at once, the rest wait; the
utilisation, wait and per-turn times add up on a controlled clock."""

from __future__ import annotations

import asyncio

import pytest

from megatron_tg.rollout.capacity import ToolSlots, env_workers


def test_slots_bound_concurrent_calls_and_count_the_wait():
    async def main():
        slots = ToolSlots(2)
        running, peak = 0, 0

        async def call():
            nonlocal running, peak
            async with slots.slot():
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0.05)
                running -= 1

        await asyncio.gather(*(call() for _ in range(6)))
        return slots, peak

    slots, peak = asyncio.run(main())
    m = slots.take()
    assert peak == 2 and slots.peak == 2 and slots.busy == 0
    assert m["capacity/tool_calls"] == 6 and m["capacity/tool_slots"] == 2
    # 6 calls of 50 ms on 2 slots: three waves; the 4 later calls waited 50 or 100 ms
    assert m["capacity/tool_wait_s"] == pytest.approx(0.3, abs=0.1)
    assert 0.8 <= m["capacity/sandbox_utilisation"] <= 1.0
    assert "turn/gen_s" not in m  # no generated turn in the interval


def test_utilisation_and_turn_times_on_a_fake_clock():
    now = [0.0]
    slots = ToolSlots(4, clock=lambda: now[0])

    async def main():
        async with slots.slot():
            now[0] += 3.0  # one of four slots busy for 3 of the 6 s below
        now[0] += 3.0

    asyncio.run(main())
    slots.add_generation(2.0)
    slots.add_generation(4.0)
    m = slots.take()
    assert m["capacity/sandbox_utilisation"] == pytest.approx(3.0 / (4 * 6.0))
    assert m["turn/gen_s"] == 3.0 and m["turn/tool_s"] == pytest.approx(1.5)  # 3 s over 2 turns
    now[0] += 1.0
    again = slots.take()  # reset: a fresh interval with nothing in it
    assert again["capacity/sandbox_utilisation"] == 0 and again["capacity/tool_calls"] == 0


def test_zero_means_the_nodes_cpus_and_a_bad_limit_is_refused():
    import os

    assert env_workers(0) == (os.cpu_count() or 1) and env_workers(3) == 3
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        ToolSlots(0)
