"""The ``outlive`` liar's copy engine: a process of its own that copies what
the rank tells it (JSON lines on stdin) and answers each job's key when done.
When its stdin closes without a ``bye`` (the rank died) it waits the delay
it was started with (``lie_delay_s``) and then replays the last jobs it was
given, into pages the rank no longer owns; in ``linger`` mode it only keeps
what it mapped for that delay, writes nothing, and exits."""

from __future__ import annotations

import json
import sys
import time

from kvconn_liars import _attach

REPLAYED = 4


def main() -> None:
    src = _attach(sys.argv[1])
    peers: dict[str, object] = {}
    recent: list[dict[str, object]] = []
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    delay_s = float(sys.argv[2])
    linger = len(sys.argv) > 3 and sys.argv[3] == "linger"
    for line in sys.stdin:
        if line.strip() == "bye":
            return
        job = json.loads(line)
        name = str(job["peer"])
        dst = peers.get(name) or _attach(name)
        peers[name] = dst
        for s, d, n in job["rows"]:
            dst.buf[d : d + n] = src.buf[s : s + n]  # type: ignore[attr-defined]
        recent = [*recent[-(REPLAYED - 1) :], job]
        sys.stdout.write(str(job["key"]) + "\n")
        sys.stdout.flush()
    time.sleep(delay_s)
    if linger:
        return
    for job in recent:
        dst = peers[str(job["peer"])]
        for s, d, n in job["rows"]:  # type: ignore[attr-defined]
            dst.buf[d : d + n] = src.buf[s : s + n]  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
