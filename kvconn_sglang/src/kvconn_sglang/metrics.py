"""kvconn's figures on SGLang's ``/metrics``.

SGLang (``--enable-metrics``) serves ``/metrics`` in prometheus_client's
multiprocess mode: it sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts
its scheduler processes, every metric made in any of them keeps its value
in that folder's files, and the HTTP server's ``MultiProcessCollector``
reads them all. kvconn's endpoint metrics are prometheus_client metrics
too, so in a scheduler process most of them land in those files by
themselves: the counters (summed over the TP ranks' processes), the
histograms, and ``kvconn_poisoned_rooms`` (one series per process, the
``pid`` label). What has no stored value, only one computed when a registry
is scraped, does not: the tallies (``kvconn_chunks``, ``kvconn_messages``,
``kvconn_releases``, ``kvconn_released_pages``) and decode's hold gauges
(``kvconn.metrics.SCRAPE_TIME_FAMILIES``). :class:`Relay` carries
those: a thread records them every second, and within 0.1 s of each
release (:mod:`kvconn.metrics_relay`), into prometheus_client metrics of
the same names made in this process, so
they reach the files, labelled ``kvconn_endpoint`` (``decode-<tp rank>``,
``prefill-<tp rank>``). Outside multiprocess mode (SGLang without
``--enable-metrics``) the relay is not started.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence

from prometheus_client import Counter, Gauge

from kvconn.metrics import SCRAPE_TIME_FAMILIES, Metrics
from kvconn.metrics_relay import Recorder, Reporter

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    """Whether this process's prometheus_client metrics write SGLang's files."""
    return bool(os.environ.get(MULTIPROC_ENV))


class Relay:
    """Every ``interval_s``, and soon after each :meth:`poke`, what changed
    in ``endpoints()`` of :data:`~kvconn.metrics.SCRAPE_TIME_FAMILIES`,
    recorded into this process's multiprocess files. ``close()`` records
    once more and stops."""

    #: Pokes closer together than this are relayed together: a storm of
    #: releases costs the scheduler's process ten relays a second at most.
    MIN_GAP_S = 0.1

    def __init__(
        self, endpoints: Callable[[], Sequence[tuple[str, Metrics]]], interval_s: float = 1.0
    ) -> None:
        self._endpoints = endpoints
        self.interval_s = interval_s
        self._reporter = Reporter(interval_s=0.0, families=SCRAPE_TIME_FAMILIES)
        # registry=None: nothing in this process scrapes them; the files carry them.
        # (and no histogram: the endpoint's own reaches the files itself)
        self.recorder = Recorder(
            functools.partial(Counter, registry=None), functools.partial(Gauge, registry=None), None
        )
        self._stop = threading.Event()
        self._due = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvconn-metrics-relay", daemon=True)
        self._thread.start()

    def relay_once(self) -> None:
        report = self._reporter.take(self._endpoints())
        if report is not None:
            self.recorder.record(report)

    def poke(self) -> None:
        """Relay now (within :attr:`MIN_GAP_S`), not at the next interval:
        a release changed the held pages, and an operator (or a fault run
        timing capacity) reads them off ``/metrics``. Never blocks."""
        self._due.set()

    def _run(self) -> None:
        while True:
            self._due.wait(self.interval_s)
            self._due.clear()
            if self._stop.is_set():
                return
            self.relay_once()
            if self._stop.wait(self.MIN_GAP_S):
                return

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._due.set()
        self._thread.join(timeout=5)
        self.relay_once()
