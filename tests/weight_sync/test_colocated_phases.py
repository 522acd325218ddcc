"""How the colocated phases read an engine's /server_info: whether it runs with the memory
saver (SGLang: a server argument at the top level; the embedded engine: memory_occupation), and
the bytes it still holds (only where the engine reports them exactly)."""

from __future__ import annotations

from megatron_tg.weight_sync.colocated import _held_bytes, _uses_memory_saver


def _embedded(saver: bool, weights: int = 0, kv: int = 0) -> dict:
    return {"version": "0.5.23", "memory_occupation": {
        "weights_bytes": weights, "kv_cache_bytes": kv, "weights_backup_bytes": 0,
        "released": [], "enable_memory_saver": saver}}


def test_memory_saver_is_read_from_either_engine_kind():
    assert _uses_memory_saver(_embedded(True)) and not _uses_memory_saver(_embedded(False))
    assert _uses_memory_saver({"version": "0.5.23", "enable_memory_saver": True})
    assert not _uses_memory_saver({"version": "0.5.23", "enable_memory_saver": False})
    assert not _uses_memory_saver({"version": "0.5.23"})  # not said: refused
    assert not _uses_memory_saver(None)  # no answer: refused


def test_held_bytes_counts_weights_and_kv_where_reported():
    infos = {"a": _embedded(True, weights=10, kv=5), "b": _embedded(True),
             "c": {"version": "0.5.23", "enable_memory_saver": True}}
    assert _held_bytes(infos) == {"a": 15, "b": 0}
