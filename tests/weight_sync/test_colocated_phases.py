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


class _Side:
    """A rollout side whose engine answers as scripted: what /server_info says after the
    release and after the resume (the calls are recorded)."""

    def __init__(self, after_release: tuple, after_resume: tuple, fail: str | None = None):
        self.calls, self.infos, self.fail = [], [after_release, after_resume], fail
        side = self

        class Client:
            async def release_memory_occupation(self, tags):
                side.calls.append(("release", tags))
                if side.fail:
                    raise RuntimeError(side.fail)

            async def resume_memory_occupation(self, tags):
                side.calls.append(("resume", tags))

            async def get_server_info(self, strict):
                released, kv = side.infos.pop(0)
                info = _embedded(True, weights=7, kv=kv)
                info["memory_occupation"]["released"] = released
                return {"u": info}
        self.client = Client()

    def call(self, coro):
        import asyncio

        return asyncio.run(coro)


def test_the_preflight_releases_and_resumes_the_kv_cache_only():
    from megatron_tg.weight_sync.colocated import preflight

    ok = _Side((["kv_cache"], 0), ([], 0))
    assert preflight(ok) is None and ok.calls == [("release", ["kv_cache"]), ("resume", ["kv_cache"])]
    assert "did not release their KV cache ([released tags, bytes]): {'u': [['kv_cache'], 64]}" in \
        preflight(_Side((["kv_cache"], 64), ([], 0)))
    assert "did not release" in preflight(_Side(([], 0), ([], 0)))
    assert "still list their KV cache released after resuming it: {'u': ['kv_cache']}" in \
        preflight(_Side((["kv_cache"], 0), (["kv_cache"], 0)))
    assert "preflight failed: busy" in preflight(_Side((["kv_cache"], 0), ([], 0), fail="busy"))
    sglang = {"version": "0.5.23", "enable_memory_saver": True}  # reports no bytes: the calls only

    class Quiet(_Side):
        def __init__(self):
            super().__init__(([], 0), ([], 0))

            async def info(strict):
                return {"u": sglang}
            self.client.get_server_info = info
    assert preflight(Quiet()) is None
