"""Make the ``liar-*`` backends findable, for one test's processes only.

kvconn finds backends through the ``kvconn.backends`` entry points of the
installed distributions. Here a throw-away ``.dist-info`` (no install, no
site-packages change) declares them; putting its folder and the liars'
package on ``PYTHONPATH`` makes every process a test starts see them.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvconn_liars import BACKENDS

HERE = Path(__file__).resolve().parent.parent


def liar_path(root: Path) -> str:
    """A ``PYTHONPATH`` that adds the liars (their dist-info under ``root``)."""
    info = root / "kvconn_liars-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvconn-liars\nVersion: 0.0\n")
    lines = ["[kvconn.backends]"]
    lines += [f"{b.name} = kvconn_liars:{lie.upper()}" for lie, b in BACKENDS.items()]
    lines += [
        "liar-loopback = kvconn_liars.loopback:backend",
        "liar-mooncake = kvconn_liars.mooncake:backend",
        "liar-net = kvconn_liars.net:backend",
        "liar-nixl = kvconn_liars.nixl:backend",
    ]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    parts = [str(root), str(HERE), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)
