"""A bench prefill rank: :mod:`kvconn.testing.prefill_proc` plus its metrics.

Same arguments and protocol (prints ``{"address": ...}``, serves until stdin
closes), and a line ``cpu`` on stdin is answered ``{"cpu": {...}}`` (its
threads' CPU so far: :func:`cpu_now`); before it exits it prints one more JSON line, ``{"metrics": {...}}``,
so the bench can report prefill-side counters (acks sent, fences, poisoned
rooms) that live in this process's registry.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import sys
from collections.abc import Sequence
from typing import Any

from kvconn.bench import cpu
from kvconn.metrics import Metrics
from kvconn.runtime.trace_export import write_spans_to
from kvconn.testing.child import Child, ChildError, StderrLog, quiet_interrupts
from kvconn.testing.prefill_proc import Driver


def snapshot(m: Metrics) -> dict[str, float]:
    return {
        "acks_sent": m.value("kvconn_acks_sent_total"),
        "fences_ok": m.value("kvconn_fences_total", result="ok"),
        "fences_failed": m.value("kvconn_fences_total", result="failed"),
        "poisoned_rooms_end": m.value("kvconn_poisoned_rooms"),
        **{
            f"chunks_{outcome}": m.value("kvconn_chunks_total", outcome=outcome)
            for outcome in ("landed", "skipped", "failed_settled", "unsettled", "plugin_error")
        },
    }


def cpu_now(driver: Driver) -> dict[str, Any]:
    """This process's CPU so far: by thread (CPU and run-queue wait
    seconds, :func:`kvconn.bench.cpu.thread_seconds`), in kvconn's calls on
    the driver's thread, its page faults, and the chunks its workers took."""
    return {
        "threads": cpu.thread_seconds(),
        "calls_s": driver.calls.total,
        "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
        "chunks": sum(driver.rank.metrics.chunks.counts.values()),
        # kvconn's own share of each release here (an ABORT in, its ack out,
        # less the wait for the chunk in flight): a histogram so far
        "abort_own": driver.rank.metrics.buckets("kvconn_abort_ack_own_seconds"),
        "abort_own_sum": driver.rank.metrics.value("kvconn_abort_ack_own_seconds_sum"),
    }


def main() -> None:
    quiet_interrupts()
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    args = json.loads(sys.argv[1])
    provider = write_spans_to(args["trace_file"]) if args.get("trace_file") else None
    driver = Driver(args)
    print(json.dumps({"address": driver.rank.address}), flush=True)
    for line in sys.stdin:  # "cpu": say how much so far; the end of stdin: exit
        if line.strip() == "cpu":
            print(json.dumps({"cpu": cpu_now(driver)}), flush=True)
    print(json.dumps({"metrics": snapshot(driver.rank.metrics)}), flush=True)
    driver.rank.close()
    if provider is not None:
        provider.shutdown()


class PrefillProcs:
    """N prefill rank processes, each running :func:`main` (started by the bench)."""

    def __init__(self, args: Sequence[dict[str, Any]]) -> None:
        self.procs: list[Child] = []
        self.addresses: list[str] = []
        self.metrics: list[dict[str, float]] = []
        try:
            for a in args:
                self.procs.append(
                    Child(
                        "kvconn.bench.prefill_worker",
                        a,
                        log=StderrLog(),
                        name="a prefill rank process",
                        failure=ChildError,
                        # In the bench's session: a session of its own is a
                        # scheduling group of its own (Child's docstring).
                        own_session=False,
                    )
                )
            for i, p in enumerate(self.procs):
                self.addresses.append(
                    str(p.next_with("address", 120, f"prefill rank {i}'s start")["address"])
                )
        except BaseException:
            self.close()
            raise

    def cpu(self) -> list[dict[str, Any]]:
        """Each rank's CPU so far (:func:`cpu_now`)."""
        for p in self.procs:
            p.send_line("cpu")
        return [p.next_with("cpu", 30, f"prefill rank {i}'s CPU")["cpu"] for i, p in enumerate(self.procs)]

    def close(self) -> None:
        for p in self.procs:  # all at once: each exits once its stdin closes
            if p.proc.stdin is not None and not p.proc.stdin.closed:
                with contextlib.suppress(OSError):
                    p.proc.stdin.close()
        for p in self.procs:
            p.close(15)
            metrics = p.last_with("metrics")  # printed on its way out
            if metrics is not None:
                self.metrics.append(metrics)
        self.procs = []


if __name__ == "__main__":
    main()
