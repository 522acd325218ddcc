"""The job's key (megatron_tg.auth): its files, SGLang's acceptance rule, the middleware and
the log redaction. SGLang's own decide_request_auth is compared in tests/sglang/test_auth.py."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import subprocess
import sys

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from megatron_tg import auth


def test_key_dir_is_private_and_a_new_start_gets_a_new_key(tmp_path):
    d = tmp_path / "secret"
    key_path, yaml_path = auth.write_key_dir(d)
    key = auth.read_key(key_path)
    assert len(key) >= 43 and key.isascii()
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert os.stat(key_path).st_mode & 0o777 == 0o600 and os.stat(yaml_path).st_mode & 0o777 == 0o600
    assert yaml_path.read_text() == f"api-key: {key}\n"  # SGLang's --config file
    auth.write_key_dir(d)  # a requeued job: a fresh key, same paths
    assert auth.read_key(key_path) != key
    assert sorted(p.name for p in d.iterdir()) == ["api_key", "sglang_auth.yaml"]  # no temp files left


def test_unusable_key_files_are_refused_naming_why(tmp_path):
    key_path, _ = auth.write_key_dir(tmp_path / "s")
    os.chmod(key_path, 0o644)
    with pytest.raises(auth.SecretError, match=r"readable by group or others \(mode 644\); chmod 600"):
        auth.read_key(key_path)
    with pytest.raises(auth.SecretError, match="No such file"):
        auth.read_key(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("abc\n")
    os.chmod(short, 0o600)
    with pytest.raises(auth.SecretError, match="at least 16 characters"):
        auth.read_key(short)
    os.chmod(key_path, 0o600)
    link = tmp_path / "link"
    link.symlink_to(key_path)
    with pytest.raises(auth.SecretError):  # O_NOFOLLOW: a link is not the key file
        auth.read_key(link)
    (tmp_path / "other").mkdir()
    os.symlink(tmp_path / "other", tmp_path / "ln")
    with pytest.raises(auth.SecretError, match="not a directory owned by this user"):
        auth.write_key_dir(tmp_path / "ln")


def test_resolve_key_reads_the_config_path_then_the_environment(tmp_path, monkeypatch):
    a, _ = auth.write_key_dir(tmp_path / "a")
    b, _ = auth.write_key_dir(tmp_path / "b")
    monkeypatch.delenv(auth.KEY_FILE_ENV, raising=False)
    assert auth.resolve_key(None) is None
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(b))
    assert auth.resolve_key(None) == auth.read_key(b)
    assert auth.resolve_key(str(a)) == auth.read_key(a)


K, A = "k" * 40, "a" * 40


@pytest.mark.parametrize("method,path,header,api_key,admin_key,admin,status", [
    ("POST", "/generate", None, K, None, False, 401),
    ("POST", "/generate", f"Bearer {K}", K, None, False, 0),
    ("POST", "/generate", f"bearer {K}", K, None, False, 0),        # scheme in any case
    ("POST", "/generate", f"Basic {K}", K, None, False, 401),
    ("POST", "/generate", f"Bearer  {K}", K, None, False, 401),      # the token is all after one space
    ("POST", "/generate", f"Bearer {K}x", K, None, False, 401),
    ("POST", "/generate", "Bearer ключ", K, None, False, 401),        # non-ASCII: a mismatch, not a crash
    ("GET", "/health", None, K, None, False, 0),
    ("GET", "/health_generate", None, K, None, False, 0),           # prefix match, as SGLang
    ("GET", "/ready", None, K, None, False, 0),
    ("GET", "/readiness", None, K, None, False, 401),               # "/readi..." is not "/ready"
    ("GET", "/metrics", None, K, None, False, 0),
    ("OPTIONS", "/generate", None, K, None, False, 0),
    ("GET", "/model_info", None, None, None, False, 0),              # no key configured: open
    ("POST", "/pause_generation", f"Bearer {K}", K, A, True, 401),   # admin key set: api key refused
    ("POST", "/pause_generation", f"Bearer {A}", K, A, True, 0),
    ("POST", "/generate", f"Bearer {A}", K, A, False, 401),          # and the admin key is not the api key
    ("POST", "/pause_generation", None, None, A, True, 401),
    ("POST", "/generate", None, None, A, False, 0),                  # admin key only: normal routes open
])
def test_decide_follows_sglangs_rule(method, path, header, api_key, admin_key, admin, status):
    assert auth.decide(method, path, header, api_key, admin_key, admin=admin) == status


def test_middleware_answers_401_with_sglangs_body_before_the_handler_runs():
    ran = []

    async def handler(request):
        ran.append(request.path)
        return web.json_response({"ok": True})

    async def go():
        app = web.Application(middlewares=[auth.aiohttp_middleware(K)])
        app.router.add_post("/generate", handler)
        app.router.add_get("/health", handler)
        async with TestClient(TestServer(app)) as c:
            r = await c.post("/generate", json={})
            assert (r.status, await r.json()) == (401, {"error": "Unauthorized"})
            r = await c.post("/generate", json={}, headers=auth.bearer(K))
            assert (r.status, await r.json()) == (200, {"ok": True})
            r = await c.get("/health")
            assert r.status == 200

    asyncio.run(go())
    assert ran == ["/generate", "/health"]


def test_logged_keys_are_redacted(caplog):
    stream = io.StringIO()
    h = logging.StreamHandler(stream)
    h.addFilter(auth.RedactFilter(K))
    log = logging.getLogger("tg-auth-test")
    log.addHandler(h)
    try:
        log.warning("server_args=%s", {"api_key": K})
        log.warning("plain %d", 3)
    finally:
        log.removeHandler(h)
    out = stream.getvalue()
    assert K not in out and "'api_key': '<redacted>'" in out and "plain 3" in out


def test_redact_command_filters_a_servers_output(tmp_path):
    key_path, _ = auth.write_key_dir(tmp_path / "s")
    key = auth.read_key(key_path)
    text = f"server_args=ServerArgs(api_key='{key}', port=1)\nline two {key}{key}\n"
    out = subprocess.run([sys.executable, "-m", "megatron_tg.auth", "redact", "--key-file", str(key_path)],
                         input=text.encode(), capture_output=True, timeout=60, check=True).stdout.decode()
    assert out == "server_args=ServerArgs(api_key='<redacted>', port=1)\nline two <redacted><redacted>\n"
    new = subprocess.run([sys.executable, "-m", "megatron_tg.auth", "new", str(tmp_path / "n")],
                         capture_output=True, timeout=60, check=True).stdout.decode()
    assert new.split() == [str(tmp_path / "n" / "api_key"), str(tmp_path / "n" / "sglang_auth.yaml")]
    assert auth.read_key(tmp_path / "n" / "api_key") not in new  # paths only, never the key


def test_router_launcher_refuses_a_key_on_the_command_line(tmp_path):
    from megatron_tg.launch import router

    key_path, _ = auth.write_key_dir(tmp_path / "s")
    assert router.main(["--api-key-file", str(key_path), "--api-key", K]) == 2
    os.chmod(key_path, 0o640)
    assert router.main(["--api-key-file", str(key_path)]) == 2
