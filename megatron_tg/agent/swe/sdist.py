"""A pinned source distribution from PyPI as a source tree: ``pip download`` (pip's own
resolver, index and proxy settings), then the archive's sha256 checked against the pin
before anything in it is unpacked."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path


class SdistError(RuntimeError):
    pass


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(requirement: str, sha256: str, cache_dir: str | os.PathLike) -> Path:
    """The source tree of ``name==version`` (unpacked under ``cache_dir``), its archive's
    sha256 checked; a cached tree is reused only if its archive still matches."""
    if "==" not in requirement:
        raise SdistError(f"pin an exact version (name==version), got {requirement!r}")
    name, version = requirement.split("==", 1)
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    stem = f"{name.replace('-', '_')}-{version}"
    archives = [p for p in cache.iterdir() if p.is_file() and p.name.lower().startswith(
        (stem.lower(), f"{name}-{version}".lower()))]
    if not archives:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--disable-pip-version-check", "-q", "-d", str(cache), requirement],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SdistError(f"pip download {requirement} failed: {r.stderr.strip()[-500:]}")
        archives = [p for p in cache.iterdir() if p.is_file() and p.name.lower().startswith(
            (stem.lower(), f"{name}-{version}".lower()))]
    if len(archives) != 1:
        raise SdistError(f"expected one sdist of {requirement} in {cache}, found {[p.name for p in archives]}")
    archive = archives[0]
    got = sha256_of(archive)
    if got != sha256:
        raise SdistError(f"{archive}: sha256 {got} does not match the pinned {sha256}; not unpacked")
    tree = cache / f"{archive.name}.src"
    if not tree.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=cache))
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                z.extractall(tmp)
        else:
            with tarfile.open(archive) as t:
                t.extractall(tmp, filter="data")
        (top,) = list(tmp.iterdir())  # an sdist unpacks to one name-version directory
        top.rename(tree)
        tmp.rmdir()
    return tree
