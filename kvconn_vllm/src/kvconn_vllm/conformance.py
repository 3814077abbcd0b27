"""Refuse a transport that fails kvconn's conformance suite before vLLM uses it.

With ``"conformance": true`` in ``kv_connector_extra_config``, each worker
runs ``kvconn conformance BACKEND`` with the configured backend options (in
a child process, as an operator would) before it registers any KV memory,
and the engine does not start if a check fails: a plugin that, say, reports
a write landed before it did would let decode hand out blocks still being
written. The suite needs pytest in the engine's environment and takes a
minute or more; operators who run it once per deployment instead can leave
the option off.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping

#: Generous: the suite starts real processes and waits on real deadlines.
TIMEOUT_S = 1800.0


class TransportRefused(RuntimeError):
    """The configured transport failed kvconn's conformance suite."""


def check_transport(backend: str, options: Mapping[str, str], timeout_s: float = TIMEOUT_S) -> None:
    command = [
        sys.executable,
        "-c",
        "import sys; from kvconn.cli import main; sys.exit(main(sys.argv[1:]))",
        "conformance",
        backend,
        "-q",
        "--exitfirst",  # one failed check is enough to refuse
        *(f"--option={key}={value}" for key, value in sorted(options.items())),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise TransportRefused(f"kvconn conformance {backend} did not finish within {timeout_s} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise TransportRefused(
            f"transport {backend!r} (options {dict(options)}) failed kvconn conformance "
            f"(exit {done.returncode}); the engine will not use it:\n{tail}"
        )
