"""The real-transport tests skip, saying why, where a plugin distribution is
installed but its library is not (nixl is installed apart; Mooncake's engine
fails to import without libibverbs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REAL_BACKEND_TESTS = [
    "nixl",
    "mooncake",
    "faults/test_real_backends.py",
    "conformance/test_real_backends_conformance.py",
]


def test_real_backend_tests_skip_when_their_library_does_not_import(tmp_path: Path) -> None:
    # Packages named like the libraries, first on the path, that fail to
    # import as a missing shared object does; the plugins stay importable.
    for name, lib in (("nixl", "libnixl.so"), ("mooncake", "libibverbs.so.1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('{lib}: cannot open shared object file (simulated)')\n"
        )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--timeout",
            "60",
            "--rootdir",
            str(TESTS.parent),
            *(str(TESTS / t) for t in REAL_BACKEND_TESTS),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=TESTS.parent,
    )
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1]
    assert proc.returncode == 5 or (proc.returncode == 0 and "skipped" in summary), out
    for word in ("failed", "error", "passed"):
        assert word not in summary, out
    assert "cannot import nixl._api" in out and "libnixl.so" in out, out
    assert "cannot import mooncake.engine" in out and "libibverbs.so.1" in out, out
