"""A page region in its own process for the owner-fence check (in cross-host
mode on decode's host): its own process, so that its endpoint is not shared
with any other region (a Mooncake engine is one per process and setting).

It lays a canary over the whole region and reports its metadata, then obeys
one JSON line at a time on stdin:

``{"cmd": "canary"}``  lay the canary again -> ``{"event": "canaried"}``;
``{"cmd": "fence"}``  ``owner_fence()``, then a snapshot of the whole region
    taken right after it returned -> ``{"event": "fenced", "metadata": hex,
    "fence_s": s, "landed_before": bytes that had left the canary}``;
``{"cmd": "watch", "seconds": s}``  compare the whole region with the
    snapshot until ``s`` passed -> ``{"event": "watched", "changed": bytes,
    "first": offset or -1, "at_s": seconds after the watch began, "polls": n}``
    (it stops at the first change);
``{"cmd": "rebase"}``  the region as it is now becomes the snapshot (what a
    later watch compares with) -> ``{"event": "rebased"}``;
``{"cmd": "check", "rounds": [[round, rows], ...]}``  the region must hold
    the snapshot with each round's pattern in its rows, and nothing else ->
    ``{"event": "checked", "bad": "" or what differs}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from kvconn.conformance.harness import RegionImage
from kvconn.plugins import get_backend
from kvconn.testing.child import emit, load_args
from kvconn.testing.patterns import shard_bytes
from kvconn.transport import owner_fence

#: Seconds between two comparisons of the whole region during a watch.
WATCH_POLL_S = 0.05


def main() -> None:
    args = load_args(sys.argv[1])
    nbytes = int(args["nbytes"])
    region = get_backend(args["backend"]).open_region(nbytes, dict(args["options"]))
    image = RegionImage(region, nbytes)
    snapshot = image.want.copy()
    emit({"event": "ready", "pid": os.getpid(), "metadata": region.metadata.hex()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "canary":
                image.recanary()
                snapshot = image.want.copy()
                emit({"event": "canaried"})
            elif cmd["cmd"] == "fence":
                t0 = time.monotonic()
                metadata = owner_fence(region)
                fence_s = time.monotonic() - t0
                snapshot = np.frombuffer(region.read(0, nbytes), dtype=np.uint8).copy()
                landed = int(np.count_nonzero(snapshot != image.want))
                emit(
                    {
                        "event": "fenced",
                        "metadata": metadata.hex(),
                        "fence_s": fence_s,
                        "landed_before": landed,
                    }
                )
            elif cmd["cmd"] == "watch":
                t0 = time.monotonic()
                deadline = t0 + float(cmd["seconds"])
                changed, first, at, polls = 0, -1, 0.0, 0
                while True:
                    got = np.frombuffer(region.read(0, nbytes), dtype=np.uint8)
                    polls += 1
                    bad = np.flatnonzero(got != snapshot)
                    if bad.size:
                        changed, first, at = int(bad.size), int(bad[0]), time.monotonic() - t0
                        break
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(min(WATCH_POLL_S, max(0.0, deadline - time.monotonic())))
                emit({"event": "watched", "changed": changed, "first": first, "at_s": at, "polls": polls})
            elif cmd["cmd"] == "rebase":
                snapshot = np.frombuffer(region.read(0, nbytes), dtype=np.uint8).copy()
                emit({"event": "rebased"})
            elif cmd["cmd"] == "check":
                image.want = snapshot.copy()
                for round_no, rows in cmd["rounds"]:
                    for j, (_, dst, n) in enumerate(rows):
                        image.want[dst : dst + n] = np.frombuffer(
                            shard_bytes(round_no, 0, j, n), dtype=np.uint8
                        )
                    image.last = [list(r) for r in rows]
                emit({"event": "checked", "bad": image.diff()})
    finally:
        region.close()


if __name__ == "__main__":
    main()
