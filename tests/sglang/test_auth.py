"""The embedded engine's API-key rule against SGLang's own (``sglang/srt/utils/auth.py``,
``decide_request_auth``), its ADMIN_OPTIONAL routes against ``http_server.py``'s, and the
job's ``sglang_auth.yaml`` read by SGLang's own ``--config`` merger.

The modules are loaded from the installed wheel's files, not imported through the ``sglang``
package: ``sglang/__init__`` pulls in the GPU stack, these two files only the standard library
(and yaml)."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import re
import sys
from pathlib import Path

from megatron_tg import auth
from megatron_tg.rollout.engine.server import ADMIN_OPTIONAL

SGLANG = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])


def _load(rel: str):
    spec = importlib.util.spec_from_file_location(f"sglang_file_{Path(rel).stem}", SGLANG / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_decide_matches_sglangs_decide_request_auth():
    up = _load("srt/utils/auth.py")
    k, a = "k" * 43, "a" * 43
    headers = [None, "", f"Bearer {k}", f"bearer {k}", f"BEARER {a}", f"Bearer {a}", f"Basic {k}",
               f"Bearer  {k}", f"Bearer {k} ", "Bearer", k]
    paths = ["/generate", "/health", "/health_generate", "/ready", "/readiness", "/metrics",
             "/model_info", "/update_weights_from_distributed", "/pause_generation"]
    n = 0
    for method, path, header, api_key, admin_key in itertools.product(
            ["GET", "POST", "OPTIONS"], paths, headers, [None, k], [None, a]):
        admin = path in ADMIN_OPTIONAL
        level = up.AuthLevel.ADMIN_OPTIONAL if admin else up.AuthLevel.NORMAL
        theirs = up.decide_request_auth(method=method, path=path, authorization_header=header,
                                        api_key=api_key, admin_api_key=admin_key, auth_level=level)
        ours = auth.decide(method, path, header, api_key, admin_key, admin=admin)
        assert ours == (0 if theirs.allowed else theirs.error_status_code), (method, path, header, api_key, admin_key)
        n += 1
    assert n == 3 * len(paths) * len(headers) * 4


def test_admin_optional_routes_are_sglangs():
    src = (SGLANG / "srt" / "entrypoints" / "http_server.py").read_text()
    theirs = set()
    for m in re.finditer(r"((?:@app\.\w+\([^\n]*\)\n)+)@auth_level\(AuthLevel\.ADMIN_OPTIONAL\)", src):
        theirs.update(re.findall(r'"(/[^"]*)"', m.group(1)))
    assert ADMIN_OPTIONAL <= theirs, sorted(ADMIN_OPTIONAL - theirs)
    # every ADMIN_OPTIONAL route the embedded engine serves is in the set
    ours = {"/flush_cache", "/abort_request", "/pause_generation", "/continue_generation",
            "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
            "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
            "/end_weight_update", "/update_weight_version", "/get_weights_by_name", "/weights_checker",
            "/release_memory_occupation", "/resume_memory_occupation"}
    assert ours & theirs == ADMIN_OPTIONAL


def test_sglangs_config_merger_reads_the_jobs_key_file(tmp_path):
    merger_mod = _load("srt/utils/server_args_config_parser.py")
    key_path, yaml_path = auth.write_key_dir(tmp_path / "secret")
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    parser.add_argument("--model-path")
    parser.add_argument("--config")
    argv = merger_mod.ConfigArgumentMerger(parser).merge_config_with_args(
        ["--model-path", "m", "--config", str(yaml_path)])
    assert parser.parse_args(argv).api_key == auth.read_key(key_path)
