"""The grader's pytest entry point, run *inside* the grading sandbox as
``python -I -B run.py KEY_FD REPORT ROOTS -- PYTEST_ARGS``.

Standard library and pytest only: this file is bound read-only into the sandbox on its own
(not the package around it, which holds the task files). Order matters:

1. the signing key is read from an inherited pipe and the pipe closed, before any code of
   the workspace is imported (``-I``: no PYTHON* variables, no user site, no script or
   working directory on ``sys.path``; ``-B``: no bytecode written or trusted from the
   workspace's ``__pycache__``, which the grader removes anyway);
2. pytest is imported, then the task's import roots are put on ``sys.path``;
3. pytest runs and writes its own junitxml report;
4. the report's bytes are signed (HMAC-SHA256) next to it, and the process leaves with
   ``os._exit`` so no exit hook the tested code registered runs after the signature: one that
   rewrites the report, or a process it left behind that does, breaks the signature.
"""

import hashlib
import hmac
import os
import sys


def main() -> None:
    key_fd, report, roots = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    args = sys.argv[sys.argv.index("--") + 1:]
    key = b""
    while True:
        chunk = os.read(key_fd, 4096)
        if not chunk:
            break
        key += chunk
    os.close(key_fd)
    signer = hmac.new(key, digestmod=hashlib.sha256)
    del key
    exit_ = os._exit
    import pytest

    sys.path[:0] = [r for r in roots.split(os.pathsep) if r]
    try:
        code = pytest.main(args + [f"--junitxml={report}"])
    except BaseException as e:  # SystemExit / KeyboardInterrupt raised by the tested code
        print(f"grader: pytest stopped by {type(e).__name__}: {e}", flush=True)
        code = -1
    try:
        with open(report, "rb") as f:
            signer.update(f.read())
        with open(report + ".sig", "w") as f:
            f.write(signer.hexdigest())
    except OSError as e:
        print(f"grader: no report to sign: {e}", flush=True)
    sys.stdout.flush()
    exit_(0 if code == 0 else 1)


if __name__ == "__main__":
    main()
