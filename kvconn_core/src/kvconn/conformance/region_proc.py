"""A page region in its own process (for the cross_host check, in another
network namespace): reports its metadata, then checks rounds on request.

stdin: ``{"rows": [[src, dst, nbytes], ...]}`` (round 1's segments) ->
stdout ``{"event": "checked", "bad": ""}`` ("" or what differs).
"""

from __future__ import annotations

import json
import os
import sys

from kvconn.conformance.harness import RegionImage
from kvconn.plugins import get_backend
from kvconn.testing.child import emit, load_args


def main() -> None:
    args = load_args(sys.argv[1])
    nbytes = int(args["nbytes"])
    region = get_backend(args["backend"]).open_region(nbytes, dict(args["options"]))
    image = RegionImage(region, nbytes)
    emit({"event": "ready", "pid": os.getpid(), "metadata": region.metadata.hex()})
    try:
        for line in sys.stdin:
            image.land(1, json.loads(line)["rows"])
            emit({"event": "checked", "bad": image.diff()})
    finally:
        region.close()


if __name__ == "__main__":
    main()
