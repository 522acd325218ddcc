"""The embedded engine with an API key, as SGLang 0.5.23 serves one (``--api-key``): every
route but the probes needs ``Authorization: Bearer KEY`` and answers 401 ``{"error":
"Unauthorized"}`` without it, before anything runs; the client sends the key on every call;
the key is on neither the engine's command line nor in its log."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from megatron_tg.auth import read_key, write_key_dir
from megatron_tg.rollout.client import SGLangClient, SGLangRequestError
from megatron_tg.rollout.engine.__main__ import merge_config
from megatron_tg.rollout.engine.launch import start_engines

PROMPT = [5, 17, 42, 7, 99]
GEN = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
GUARDED = [("POST", "/generate", GEN), ("GET", "/model_info", None), ("GET", "/server_info", None),
           ("POST", "/pause_generation", {"mode": "abort"}), ("POST", "/continue_generation", {}),
           ("POST", "/abort_request", {"abort_all": True}), ("POST", "/flush_cache", None),
           ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
           ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                   "rank_offset": 1, "world_size": 2, "backend": "gloo"}),
           ("POST", "/update_weight_version", {"new_version": "evil"}),
           ("GET", "/get_weights_by_name?name=lm_head.weight", None)]


def http(url, method, path, body=None, key=None):
    req = urllib.request.Request(url + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def engine(model_plain, tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_auth")
    key_file, _ = write_key_dir(d / "secret")
    (e,) = start_engines([model_plain], d / "logs", api_key_file=str(key_file))
    try:
        yield e, read_key(key_file)
    finally:
        e.stop()


def test_every_route_but_the_probes_refuses_a_missing_or_wrong_key(engine):
    e, key = engine
    for method, path, body in GUARDED:
        for sent in (None, "x" * 43, key[:-1]):
            assert http(e.url, method, path, body, sent) == (401, b'{"error": "Unauthorized"}'), (path, sent)
    for path in ("/health", "/health_generate", "/ready"):  # probes carry no secret, as on SGLang
        assert http(e.url, "GET", path)[0] == 200
    # Nothing ran: the version is still the engine's own, the weights are untouched.
    code, body = http(e.url, "GET", "/model_info", key=key)
    assert code == 200 and json.loads(body)["weight_version"] == "default"
    code, body = http(e.url, "POST", "/generate", GEN, key)
    assert code == 200 and len(json.loads(body)["output_ids"]) == 2


def test_the_client_sends_the_key_on_generation_and_admin_calls(engine):
    e, key = engine

    async def go():
        async with SGLangClient([e.url], api_key=key, max_retries=0) as c:
            r = await c.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0})
            assert len(r.output_ids) == 3
            await c.broadcast("POST", "/pause_generation", {"mode": "abort"}, strict=True)
            await c.broadcast("POST", "/continue_generation", {}, strict=True)
            info = await c.engine_info(e.url)  # /server_info, read by weight sync
            assert info.version == "0.5.23"
        async with SGLangClient([e.url], max_retries=0) as c:
            with pytest.raises(SGLangRequestError, match=r"HTTP 401.*requires an API key: set rollout.api_key_file"):
                await c.generate(PROMPT, {"max_new_tokens": 1})

    asyncio.run(go())


def test_the_key_is_not_on_the_command_line_nor_in_the_log(engine):
    e, key = engine
    with open(f"/proc/{e.proc.pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert b"--api-key-file" in argv and not any(key.encode() in a for a in argv)
    assert key not in e.log_tail(1 << 20)


def test_config_yaml_is_read_as_sglang_reads_it(tmp_path):
    cfg = tmp_path / "auth.yaml"
    cfg.write_text("api-key: KEY\nenable-return-routed-experts: true\nseed: 3\nthreads: false\n")
    assert merge_config(["--model", "m", "--config", str(cfg), "--seed", "4"]) == [
        "--api-key", "KEY", "--enable-return-routed-experts", "--seed", "3", "--model", "m", "--seed", "4"]
    assert merge_config(["--model", "m"]) == ["--model", "m"]
    bad = tmp_path / "auth.txt"
    bad.write_text("api-key: KEY\n")
    r = subprocess.run([sys.executable, "-m", "megatron_tg.rollout.engine", "--model", "m", "--config", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Config file must be YAML format, got: .txt" in r.stderr
