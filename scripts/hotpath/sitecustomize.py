"""Measurements for scripts/hotpath/pairs.py, loaded into every process of
a `kvconn bench` run through PYTHONPATH; does nothing unless
KVCONN_HOTPATH_DIR names a folder. It works with any kvconn tree since the
control plane moved to ZMQ (it patches only names every such tree has).

Every process records, and writes to KVCONN_HOTPATH_DIR/<pid>.json at exit:

* ``samples``: (CLOCK_MONOTONIC, CPU seconds, voluntary and involuntary
  context switches, minor page faults) of the whole process, every 50 ms,
  so that a window (the bench's workload phase) can be cut out of it;
* ``runs``: in the bench's own process, each ``ModeRun.run`` (the workload
  phase of a mode): its start and end, and the process's CPU, context
  switches and page faults in between;
* with KVCONN_HOTPATH_HOPS set, the abort's hops: decode's ``abort()``
  call, its ABORT sent, a rank's listener taking the ABORT (and returning),
  the rank's ABORT_ACK sent (and on which thread), decode's listener taking
  it, and the release; all on CLOCK_MONOTONIC, one clock for every process.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
import threading
import time

_DIR = os.environ.get("KVCONN_HOTPATH_DIR")
_PERIOD_S = 0.05


def _usage() -> tuple[float, float, int, int, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (time.monotonic(), ru.ru_utime + ru.ru_stime, ru.ru_nvcsw, ru.ru_nivcsw, ru.ru_minflt)


def _install(folder: str) -> None:
    samples: list[tuple[float, float, int, int, int]] = [_usage()]
    runs: list[dict[str, float]] = []
    events: list[tuple[float, str, int, int, str]] = []

    def sample() -> None:
        while True:
            time.sleep(_PERIOD_S)
            samples.append(_usage())

    threading.Thread(target=sample, name="hotpath-sampler", daemon=True).start()

    def dump() -> None:
        samples.append(_usage())
        out = {"pid": os.getpid(), "argv": sys.argv[:2], "samples": samples, "runs": runs, "events": events}
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump(out, f)

    atexit.register(dump)

    def measure_runs(workload) -> None:  # type: ignore[no-untyped-def]
        run = workload.ModeRun.run

        def measured_run(self, *a, **k):  # type: ignore[no-untyped-def]
            before = _usage()
            try:
                return run(self, *a, **k)
            finally:
                after = _usage()
                runs.append(
                    {
                        "t0": before[0],
                        "t1": after[0],
                        "cpu_s": after[1] - before[1],
                        "vcsw": after[2] - before[2],
                        "ivcsw": after[3] - before[3],
                        "minflt": after[4] - before[4],
                    }
                )

        workload.ModeRun.run = measured_run

    _after_import("kvconn.bench.workload", measure_runs)
    if os.environ.get("KVCONN_HOTPATH_HOPS"):
        _after_import("kvconn.runtime.control", lambda control: _trace_messages(control, events))
        _after_import("kvconn.runtime.decode", lambda decode: _trace_releases(decode, events))


def _after_import(name: str, patch) -> None:  # type: ignore[no-untyped-def]
    """Call ``patch(module)`` once module ``name`` is imported (never
    importing it ourselves: most processes never need it)."""
    import importlib.abc
    import importlib.machinery

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):  # type: ignore[no-untyped-def]
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, Finder())


def _trace_messages(control, events: list[tuple[float, str, int, int, str]]) -> None:  # type: ignore[no-untyped-def]
    from kvconn.protocol import wire
    from kvconn.protocol.messages import Abort, AbortAck

    now = time.monotonic
    deliver, send = control.Listener.deliver, control.Outbox.send

    def traced_deliver(self, frame):  # type: ignore[no-untyped-def]
        t = now()
        try:
            msg = wire.decode(frame, self._key)
        except Exception:
            msg = None
        if isinstance(msg, Abort):
            events.append((t, "abort_in", msg.room, msg.generation, ""))
            deliver(self, frame)
            events.append((now(), "abort_done", msg.room, msg.generation, ""))
            return
        if isinstance(msg, AbortAck):
            events.append((t, "ack_in", msg.room, msg.generation, str(msg.rank)))
        deliver(self, frame)

    def traced_send(self, address, message):  # type: ignore[no-untyped-def]
        if isinstance(message, Abort):
            events.append((now(), "abort_out", message.room, message.generation, address))
        elif isinstance(message, AbortAck):
            thread = threading.current_thread().name
            events.append((now(), "ack_out", message.room, message.generation, thread))
        return send(self, address, message)

    control.Listener.deliver = traced_deliver
    control.Outbox.send = traced_send


def _trace_releases(decode, events: list[tuple[float, str, int, int, str]]) -> None:  # type: ignore[no-untyped-def]
    now = time.monotonic
    notify, rx_abort = decode.DecodeEndpoint._notify, decode.Receiver.abort

    def traced_notify(self, releases):  # type: ignore[no-untyped-def]
        t = now()
        for r in releases:
            events.append((t, "release", r.room, 0, r.proof.value))
        return notify(self, releases)

    def traced_abort(self):  # type: ignore[no-untyped-def]
        events.append((now(), "abort_call", self.room, 0, ""))
        rx_abort(self)

    decode.DecodeEndpoint._notify = traced_notify
    decode.Receiver.abort = traced_abort


if _DIR:
    _install(_DIR)
