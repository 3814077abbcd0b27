"""kvconn's figures carried into an engine's own metrics.

An engine that serves ``/metrics`` from metrics it makes itself (vLLM: in
its API server process, from stats its workers send; SGLang: from
prometheus_client's multiprocess files) cannot scrape kvconn's per-endpoint
registries. :class:`Reporter` turns what changed in them into a plain
report (lists and str keys: it crosses processes as msgpack or JSON), and
:class:`Recorder` records reports into metric classes the engine hands it,
under kvconn's own names, so ``monitoring/``'s rules and dashboard apply:

* a counter travels as its increase since the last report (the recorder
  adds it up), first reported at 0 so that every series exists from the
  start (``increase()`` cannot see a series' first sample);
* a gauge as its value, when it changed;
* a histogram as each observation (exact: ``Metrics.observe`` tells the
  reporter, on the thread that observed), and each of its series once,
  when first seen, so that an empty one exists too (a rank's abort-to-ack
  before any abort).

:func:`initial_report` is every family of an endpoint at its start: what
an engine records before its workers report anything, so that kvconn's
series are on its ``/metrics`` from the start, not from the first request.

Each sample keeps kvconn's labels, gets ``kvconn_endpoint`` (the name the
reporter was given for the endpoint) and the engine's own labels first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from kvconn.metrics import ENDPOINT_LABEL, LATENCY_BUCKETS, Metrics

#: Seconds between reports: a pass over a registry costs ~0.1-1 ms, too
#: much for every engine step.
REPORT_INTERVAL_S = 1.0
RELEASE_HISTOGRAM = "kvconn_abort_to_release_seconds"
KINDS = ("counters", "gauges", "histograms", "observations")

_Key = tuple[str, str, tuple[tuple[str, str], ...]]


def empty() -> dict[str, Any]:
    """A report with nothing in it: ``families`` (name -> [type, help,
    label names]) seen for the first time, ``counters`` ([name, endpoint, labels, increase]),
    ``gauges`` ([name, endpoint, labels, value]), ``histograms`` ([name,
    endpoint, labels]: series seen for the first time), ``observations``
    ([name, endpoint, labels, value]); ``labels`` is [[key, value], ...]."""
    return {"families": {}, "counters": [], "gauges": [], "histograms": [], "observations": []}


def merge(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``other``'s report to ``into`` (later entries win for gauges)."""
    for name, info in other.get("families", {}).items():
        into["families"].setdefault(name, info)
    for kind in KINDS:
        into.setdefault(kind, []).extend(other.get(kind, []))
    return into


def releases(report: Mapping[str, Any]) -> int:
    """How many releases ``report`` carries (abort-to-release observations)."""
    return sum(1 for entry in report.get("observations", []) if entry[0] == RELEASE_HISTOGRAM)


class Reporter:
    """What changed in some endpoints' registries since the last report,
    and the histogram observations made since (``Metrics.observe``, any
    thread); ``families``: only these (default: every one)."""

    def __init__(
        self,
        interval_s: float = REPORT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        families: Collection[str] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.only = None if families is None else frozenset(families)
        self.clock = clock
        self._lock = threading.Lock()
        self._observations: list[list[Any]] = []
        self._counted: dict[_Key, float] = {}
        self._gauges: dict[_Key, float] = {}
        self._histograms: set[_Key] = set()
        self._families: set[str] = set()
        #: The endpoints whose observations this reporter hears, by id.
        self._listening: set[int] = set()
        self._next = 0.0

    def _listen(self, endpoint: str, metrics: Metrics) -> None:
        if id(metrics) in self._listening:
            return
        self._listening.add(id(metrics))

        def observed(name: str, labels: Mapping[str, str], value: float) -> None:
            if self.only is None or name in self.only:
                with self._lock:
                    self._observations.append(
                        [name, endpoint, [list(kv) for kv in sorted(labels.items())], value]
                    )

        metrics.listen(observed)

    def take(self, endpoints: Sequence[tuple[str, Metrics]], now_due: bool = False) -> dict[str, Any] | None:
        """The report due now, or None (within the interval, or nothing
        changed). ``now_due``: report even within the interval."""
        for endpoint, metrics in endpoints:
            self._listen(endpoint, metrics)
        now = self.clock()
        if now < self._next and not now_due:
            return None
        self._next = now + self.interval_s
        report = empty()
        with self._lock:
            report["observations"], self._observations = self._observations, []
        for endpoint, metrics in endpoints:
            labelnames = metrics.labelnames()
            for family in metrics.registry.collect():
                if self.only is not None and family.name not in self.only:
                    continue
                if family.type not in ("counter", "gauge", "histogram"):
                    continue
                if family.name not in self._families:
                    self._families.add(family.name)
                    keys = sorted(labelnames.get(family.name, ()))
                    report["families"][family.name] = [family.type, family.documentation, keys]
                for sample in family.samples:
                    if family.type == "histogram":
                        if sample.name.endswith("_count"):
                            self._declare(report, family.name, endpoint, sample.labels)
                        continue
                    if family.type == "counter" and not sample.name.endswith("_total"):
                        continue  # _created
                    labels = tuple(sorted(sample.labels.items()))
                    key = (family.name, endpoint, labels)
                    entry = [family.name, endpoint, [list(kv) for kv in labels]]
                    if family.type == "counter":
                        before = self._counted.get(key)
                        if before is None or sample.value != before:
                            report["counters"].append([*entry, sample.value - (before or 0.0)])
                            self._counted[key] = sample.value
                    elif self._gauges.get(key) != sample.value:
                        report["gauges"].append([*entry, sample.value])
                        self._gauges[key] = sample.value
        if not any(report[kind] for kind in KINDS):
            return None
        return report

    def _declare(self, report: dict[str, Any], name: str, endpoint: str, labels: Mapping[str, str]) -> None:
        pairs = tuple(sorted(labels.items()))
        key = (name, endpoint, pairs)
        if key not in self._histograms:
            self._histograms.add(key)
            report["histograms"].append([name, endpoint, [list(kv) for kv in pairs]])


def initial_report(endpoints: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Every family of fresh endpoints (``(name, role)`` each), at its start:
    counters at 0 (with every label value kvconn exports from the start),
    gauges, empty histograms. An engine records it before its workers
    report, so that kvconn's series exist on its ``/metrics`` from the start."""
    report = Reporter().take([(name, Metrics(role)) for name, role in endpoints], now_due=True)
    assert report is not None  # a fresh endpoint has families
    return report


class Recorder:
    """Records reports into metrics made by ``counter``, ``gauge`` and
    ``histogram`` (prometheus_client's classes, or an engine's wrappers of
    them, called as ``cls(name=, documentation=, labelnames=, ...)``); each
    family is made the first time it is reported, its labels known then.
    ``made`` collects every metric made, for an engine that must unregister
    them. ``base_labelnames``: the engine's labels, given first.
    ``histogram=None``: histograms are not recorded."""

    def __init__(
        self,
        counter: Callable[..., Any],
        gauge: Callable[..., Any],
        histogram: Callable[..., Any] | None,
        base_labelnames: Sequence[str] = (),
    ) -> None:
        self._counter, self._gauge, self._histogram = counter, gauge, histogram
        self._base = list(base_labelnames)
        self._lock = threading.Lock()
        self._metrics: dict[str, tuple[Any, list[str]]] = {}
        self.made: list[Any] = []

    def _metric(self, name: str, kind: str, doc: str, keys: list[str]) -> tuple[Any, list[str]]:
        with self._lock:
            found = self._metrics.get(name)
            if found is None:
                labelnames = [*self._base, ENDPOINT_LABEL, *keys]
                if kind == "counter":
                    metric = self._counter(name=name, documentation=doc, labelnames=labelnames)
                elif kind == "histogram":
                    assert self._histogram is not None
                    metric = self._histogram(
                        name=name, documentation=doc, labelnames=labelnames, buckets=list(LATENCY_BUCKETS)
                    )
                else:  # one process's value, the most recent, not one series per pid
                    metric = self._gauge(
                        name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"
                    )
                self.made.append(metric)
                found = self._metrics[name] = (metric, keys)
            return found

    def record(self, report: Mapping[str, Any], base_labelvalues: Sequence[object] = ()) -> None:
        base = list(base_labelvalues)
        families = report.get("families", {})
        for name, (family_type, doc, *keys) in families.items():
            # made now, with no series yet: its name is on the scrape before
            # its first event (a labelled family's series come with events)
            if keys and (family_type != "histogram" or self._histogram is not None):
                self._metric(name, family_type, doc, list(keys[0]))

        def child(name: str, kind: str, endpoint: str, pairs: Sequence[Sequence[str]]) -> Any:
            labels: dict[str, str] = {k: v for k, v in pairs}
            family_type, doc = families.get(name, [kind, name])[:2]
            metric, keys = self._metric(name, family_type, doc, sorted(labels))
            return metric.labels(*base, endpoint, *(labels.get(k, "") for k in keys))

        for name, endpoint, pairs, value in report.get("counters", []):
            child(name, "counter", endpoint, pairs).inc(value)
        for name, endpoint, pairs, value in report.get("gauges", []):
            child(name, "gauge", endpoint, pairs).set(value)
        if self._histogram is None:
            return
        for name, endpoint, pairs in report.get("histograms", []):
            child(name, "histogram", endpoint, pairs)  # the series, empty
        for name, endpoint, pairs, value in report.get("observations", []):
            child(name, "histogram", endpoint, pairs).observe(value)
