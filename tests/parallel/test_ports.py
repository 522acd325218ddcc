"""free_port draws outside the kernel's ephemeral range, so an outgoing connection cannot take
the port between the draw and the store's bind (a trainer failed with EADDRINUSE that way)."""

from __future__ import annotations

import socket

from megatron_tg.parallel import ports


def test_ports_are_free_and_outside_the_ephemeral_range():
    lo, hi = ports.ephemeral_range()
    drawn = {ports.free_port() for _ in range(50)}
    assert all(not lo <= p <= hi for p in drawn), sorted(drawn)
    assert len(drawn) > 40  # at random, not one port handed to every caller
    for p in list(drawn)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        # Only the busy port and one other can be drawn: the other must come back every time.
        monkeypatch.setattr(ports, "_candidates", lambda lo, hi, rng: iter([busy, busy, busy + 1 if busy < 65535 else busy - 1]))
        assert ports.free_port() != busy


def test_an_unreadable_range_file_falls_back_to_linux_s_default(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_range() == (32768, 60999)
    (tmp_path / "bad").write_text("not numbers")
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "bad")
    assert ports.ephemeral_range() == (32768, 60999)
