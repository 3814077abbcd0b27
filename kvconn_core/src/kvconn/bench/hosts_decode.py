"""Decode of ``kvconn bench --hosts``, in a process on decode's host: one
kvconn-mode run of the seeded workload (:class:`~kvconn.bench.workload.ModeRun`)
against ranks whose addresses it is given, wherever they run.

``python -m kvconn.bench.hosts_decode ARGS_JSON``; it reports one JSON line,
``{"event": "result", "summary": ..., "stream": ..., "window_s": ...}``,
and exits.
"""

from __future__ import annotations

import logging
import sys

from kvconn.bench.prefill_worker import PrefillProcs
from kvconn.bench.workload import ModeRun, Settings, Workload, plan
from kvconn.testing.child import emit, load_args, quiet_interrupts


def main() -> None:
    quiet_interrupts()
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    args = load_args(sys.argv[1])
    wl = Workload(**args["workload"])
    ranks = PrefillProcs([])  # they run on other hosts, started by the bench
    ranks.addresses = list(args["addresses"])
    run = ModeRun(wl, Settings(**args["settings"]), procs=ranks)
    try:
        work, stream_rooms = plan(wl)
        stream = run.stream(stream_rooms, lambda n: None) if stream_rooms else {}
        window = float(args["window_s"])
        result = run.run(work, window, lambda n: None)
    finally:
        run.close()
    emit({"event": "result", "summary": result.summary(), "stream": stream, "window_s": window})


if __name__ == "__main__":
    main()
