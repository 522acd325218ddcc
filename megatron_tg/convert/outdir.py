"""All-or-nothing output directories.

A conversion writes into a hidden temporary sibling of the output dir (same filesystem, so
the final ``rename`` is atomic) and renames it into place only after everything succeeded.
Any failure, including Ctrl-C or a worker crash, removes the temporary dir: the output
path is either untouched or holds a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from megatron_tg.convert.common import ConversionError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an output path that already holds something, unless ``overwrite``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        held = sorted(p.name for p in out.iterdir())
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ConversionError(f"output dir {out} already holds a checkpoint or other files "
                              f"({shown}); pass --overwrite to replace it")
    return out


@contextlib.contextmanager
def staged_output(out_dir: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary dir; on success it replaces ``out_dir``, on failure it vanishes."""
    out = check_output_dir(out_dir, overwrite).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary dir
    try:
        yield tmp
        # Re-check: something may have appeared in out_dir while we were converting.
        check_output_dir(out, overwrite)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            old.rmdir()
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
