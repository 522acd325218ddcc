"""Every admin and weight-update request the client sends during a weight sync, checked
against SGLang 0.5.23's own request classes (``sglang.srt.managers.io_struct``).

Which class an endpoint parses its body into is read from SGLang's own
``srt/entrypoints/http_server.py`` (its ``Annotated[<Class>, Body()]`` parameters, parsed with ``ast``:
importing that module needs serving packages outside the light set this lane installs,
xgrammar first). Each body is then
validated the way FastAPI validates it (pydantic, from JSON) and must use only fields the
class has: SGLang ignores unknown fields silently, so a misspelt one would be lost.

The requests are the client's real traffic to an embedded engine running the whole sync
sequence, recorded on their way out.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megatron_tg.rollout.client import SGLangClient
from megatron_tg.rollout.engine.launch import start_engines
from megatron_tg.rollout.engine.weights import iter_checkpoint
from megatron_tg.rollout.transport import FlatBucket
from megatron_tg.testing.distributed import free_port
from tests.rollout.conftest import build_tiny_model

SYNC_PATHS = {"/server_info", "/init_weights_update_group", "/pause_generation", "/begin_weight_update",
              "/update_weights_from_distributed", "/end_weight_update", "/update_weight_version",
              "/flush_cache", "/weights_checker", "/continue_generation", "/destroy_weights_update_group",
              "/update_weights_from_disk"}


def sglang_routes() -> dict[str, str | None]:
    """path -> name of the io_struct class its body is parsed into (None: no body)."""
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    tree = ast.parse((root / "srt/entrypoints/http_server.py").read_text())
    routes: dict[str, str | None] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths = [d.args[0].value for d in fn.decorator_list
                 if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                 and d.func.attr in ("get", "post", "api_route") and d.args and isinstance(d.args[0], ast.Constant)]
        body_cls = None
        for arg in fn.args.args:
            ann = arg.annotation
            if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Annotated":
                inner = ann.slice.elts[0]
                if isinstance(inner, ast.Subscript):  # Optional[X]
                    inner = inner.slice
                body_cls = getattr(inner, "id", None)
        for p in paths:
            routes[p] = body_cls
    return routes


class RecordingClient(SGLangClient):
    """The real client; every admin request is noted on its way to the engine."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent: list[tuple[str, str, object]] = []

    async def _call(self, url, method, path, body=None, timeout_s=None):
        self.sent.append((method, path, body))
        return await super()._call(url, method, path, body, timeout_s)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("model"), seed=0)
    (e,) = start_engines([model], tmp_path_factory.mktemp("logs"))
    yield e, model
    e.stop()


def test_every_sync_request_is_one_sglang_accepts(engine):
    import msgspec
    import pydantic
    from sglang.srt.managers import io_struct

    e, model = engine
    tensors = list(iter_checkpoint(str(model)))

    async def sync() -> list:
        async with RecordingClient([e.url]) as client:
            group = await client.init_weights_update_group("127.0.0.1", free_port(), group_name="tg-weights")
            try:
                await client.pause_generation(mode="retract")
                # the coverage check's sequence (weight_sync.sync.verify_coverage): checksum ->
                # reset_tensors -> push -> checksum; an admitted engine is paused with abort
                before = await client.weights_checker("checksum")
                await client.weights_checker("reset_tensors")
                await client.broadcast("POST", "/pause_generation", {"mode": "abort"}, strict=True)
                await client.begin_weight_update(group)
                bucket = FlatBucket(1 << 20, torch.device("cpu"))
                for n, t in tensors[1:]:
                    bucket.add(n, t.to(torch.bfloat16) if t.dim() == 1 else t)  # a mixed-dtype bucket
                await client.update_weights_from_distributed(group, bucket)
                await client.update_weights_from_distributed(group, tensors[:1])
                await client.end_weight_update(group)
                await client.update_weight_version("7", servers=group.servers)
                await client.flush_cache(servers=group.servers, strict=True)
                after = await client.weights_checker("checksum")
                await client.continue_generation()
                await client.update_weights_from_disk(str(model), weight_version="8", flush_cache=False)
            finally:
                await client.destroy_weights_update_group(group)
            return client.sent, before, after

    sent, before, after = asyncio.run(sync())
    # the checksum reply is SGLang's: each rank a ChecksumInfo (the client reads its fields)
    for reply in (*before.values(), *after.values()):
        for rank in reply["ranks"]:
            msgspec.convert(rank, io_struct.ChecksumInfo)
    names = lambda r: {n for x in r.values() for rank in x["ranks"] for n in rank["checksums"]}  # noqa: E731
    assert names(before) == names(after) and names(before)  # the same tensors hashed both times
    routes = sglang_routes()
    assert {p for _, p, _ in sent} == SYNC_PATHS
    for method, path, body in sent:
        assert path in routes, f"SGLang 0.5.23 has no endpoint {path}"
        cls_name = routes[path]
        if body is None:
            continue
        assert cls_name is not None, f"{path} takes no body in SGLang, we send {body}"
        cls = getattr(io_struct, cls_name)
        fields = {f.name for f in msgspec.structs.fields(cls)}
        assert set(body) <= fields, f"{path}: {sorted(set(body) - fields)} are not fields of {cls_name}"
        pydantic.TypeAdapter(cls).validate_json(json.dumps(body))  # as FastAPI parses it
    bucket_body = next(b for _, p, b in sent if p == "/update_weights_from_distributed")
    assert bucket_body["load_format"] == "flattened_bucket" and bucket_body["flush_cache"] is False
    assert len(set(bucket_body["dtypes"])) == 2
