"""The weight-update group's store behind its address gate (store_gate.py).

torch's TCPStore authenticates nobody: any client can list the group's keys (shown first,
on a plain store). With the gate, a member joining the way SGLang's init_custom_process_group
joins (``tcp://`` rendezvous, PrefixStore, torch's group constructor) from an engine host
forms the group and gets the broadcast, while a connection from any other address is closed
before a byte of the store protocol; the gate goes away with the group."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_tg.rollout.transport import init_weight_update_group
from megatron_tg.testing.distributed import free_port
from tests.rollout.test_weight_group_store import GROUP, _member


def test_a_plain_store_shows_its_keys_to_any_client():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    master.set("weight_update_group/rank_0", "10.0.0.1:41234")
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    assert "weight_update_group/rank_0" in stranger.list_keys()  # why the gate exists
    assert stranger.get("weight_update_group/rank_0") == b"10.0.0.1:41234"


def _knock(port: int, source: str) -> bytes | None:
    """Connect from ``source`` (any 127.x works on Linux), send a byte, read: b"" = closed."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(5)
    s.bind((source, 0))
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"\x00")
        return s.recv(16)
    except ConnectionResetError:
        return b""
    except socket.timeout:
        return None  # held open: the gate let it through
    finally:
        s.close()


def test_the_gate_admits_engine_hosts_only_and_closes_with_the_group():
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_member, args=(port, out), daemon=True)
    proc.start()
    try:
        group = init_weight_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=60,
                                         engine_hosts=["127.0.0.1"])
        try:
            assert _knock(port, "127.0.0.2") == b""  # not an engine host: closed at once
            assert any(a.endswith("127.0.0.2") for a in group.gate.refused)
            assert _knock(port, "127.0.0.1") is None  # an engine host's connection is forwarded
            t = torch.arange(4, dtype=torch.float32)
            group.broadcast(t)
            assert out.get(timeout=60) == [0.0, 1.0, 2.0, 3.0]
        finally:
            group.close()
        proc.join(timeout=30)
        assert proc.exitcode == 0
        deadline = time.monotonic() + 5
        while True:  # the gate's port is closed with the group
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                break
            assert time.monotonic() < deadline, "the gate still listens after close()"
            time.sleep(0.1)
    finally:
        if proc.is_alive():
            proc.kill()


def test_an_engine_refused_by_the_gate_is_named_in_the_error():
    port = free_port()
    # The only "engine host" is one nobody connects from: a member knocking from 127.0.0.1
    # is refused, the formation times out, and the error says who was turned away.
    knocker = threading.Timer(1.0, _knock, args=(port, "127.0.0.1"))
    knocker.start()
    try:
        with pytest.raises(RuntimeError, match=r"refused connections from \[.*127\.0\.0\.1.*\], which are not "
                                               r"engine hosts \['127\.0\.0\.9'\]"):
            init_weight_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=5,
                                     engine_hosts=["127.0.0.9"])
    finally:
        knocker.join(timeout=10)
