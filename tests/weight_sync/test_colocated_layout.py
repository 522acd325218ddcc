"""The colocated mapping check (weight_sync/colocated_push.py: check_engine_layout): engine e's TP
rank r takes its payload from trainer rank e * tp + r, so those ranks must be on the engine's
host, one engine's ranks on one host, and on one GPU each. No engine or process group: the
ranks' reports are written out."""

from __future__ import annotations

from megatron_tg.weight_sync.colocated_push import RankReport, check_engine_layout

ADDRS = {"node-a": "10.0.0.1", "node-b": "10.0.0.2"}


def _ranks(*hosts: str, uuids: list[str] | None = None) -> list[RankReport]:
    return [RankReport(k, h, (ADDRS[h],), f"cuda:{k % 2}" if uuids else "cpu", k % 2 if uuids else None,
                       uuids[k] if uuids else None) for k, h in enumerate(hosts)]


def _resolve(host: str) -> set[str]:
    return {ADDRS[host]} if host in ADDRS else ({host} if host[0].isdigit() else set())


def test_engines_on_the_hosts_of_their_ranks_pass():
    ranks = _ranks("node-a", "node-a", "node-b", "node-b")
    urls = ["http://node-a:30000", "http://10.0.0.2:30000"]  # by name or by address
    assert check_engine_layout(urls, 2, ranks, resolver=_resolve) is None
    assert check_engine_layout(urls, 2, ranks, tp_sizes={urls[0]: 2, urls[1]: 2}, resolver=_resolve) is None
    # loopback: the engine is on rank 0's host (rank 0 calls it)
    assert check_engine_layout(["http://127.0.0.1:30000"], 2, ranks, resolver=_resolve) is None
    # fewer engine GPUs than ranks (CPU tests): the extra ranks host nothing
    assert check_engine_layout(["http://localhost:1"], 1, ranks, resolver=_resolve) is None
    # the fully qualified name of a rank's host
    assert check_engine_layout(["http://node-a.cluster:1"], 2, ranks, resolver=_resolve) is None


def test_an_engine_away_from_its_ranks_is_refused_naming_engine_ranks_and_hosts():
    ranks = _ranks("node-a", "node-a", "node-b", "node-b")
    # engine 1's ranks 2 and 3 are on node-b; its URL says node-a
    err = check_engine_layout(["http://node-a:1", "http://node-a:2"], 2, ranks, resolver=_resolve)
    assert err == ("rollout.placement='colocated': engine 1 (http://node-a:2) is on host node-a, but trainer "
                   "ranks [2, 3], whose GPUs its TP ranks use and which hand it their tensors (CUDA IPC "
                   "handles or shared memory: same host only), are on node-b")
    # a loopback URL is rank 0's host, node-a
    err = check_engine_layout(["http://node-a:1", "http://127.0.0.1:2"], 2, ranks, resolver=_resolve)
    assert "engine 1 (http://127.0.0.1:2) is on host 127.0.0.1 (rank 0's host, node-a)" in err
    assert err.endswith("are on node-b")


def test_an_engine_split_over_hosts_is_refused():
    ranks = _ranks("node-a", "node-b", "node-b", "node-b")
    err = check_engine_layout(["http://node-a:1", "http://node-b:2"], 2, ranks, resolver=_resolve)
    assert err == ("rollout.placement='colocated': engine 0 (http://node-a:1) has its TP ranks on the GPUs of "
                   "trainer ranks [0, 1], which are on different hosts {0: 'node-a', 1: 'node-b'}; one "
                   "engine's TP ranks share a host")


def test_too_few_ranks_a_wrong_tp_size_and_a_shared_gpu_are_refused():
    ranks = _ranks("node-a", "node-a")
    assert check_engine_layout(["http://node-a:1", "http://node-a:2"], 2, ranks, resolver=_resolve) == (
        "rollout.placement='colocated': 2 engines x rollout.engine_tp=2 = 4 engine GPUs, but the trainer has "
        "2 ranks; each engine TP rank takes its weights from the trainer rank on its GPU")
    err = check_engine_layout(["http://node-a:1"], 2, ranks, tp_sizes={"http://node-a:1": 1}, resolver=_resolve)
    assert err.startswith("rollout.placement='colocated': engine 0 (http://node-a:1) reports tp_size=1, "
                          "but rollout.engine_tp=2")
    shared = _ranks("node-a", "node-a", uuids=["GPU-0", "GPU-0"])
    err = check_engine_layout(["http://node-a:1"], 2, shared, resolver=_resolve)
    assert err.startswith("rollout.placement='colocated': trainer ranks 0 and 1 on node-a share GPU GPU-0")
    apart = _ranks("node-a", "node-a", uuids=["GPU-0", "GPU-1"])
    assert check_engine_layout(["http://node-a:1"], 2, apart, resolver=_resolve) is None
