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
* abort-to-release as one observation per release (exact; from
  ``on_release``); the other histograms do not travel (``Config.metrics_port``
  serves them where they are needed).

Each sample keeps kvconn's labels, gets ``kvconn_endpoint`` (the name the
reporter was given for the endpoint) and the engine's own labels first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from kvconn.metrics import ENDPOINT_LABEL, LATENCY_BUCKETS, Metrics
from kvconn.protocol.hold import Release

#: Seconds between reports: a pass over a registry costs ~0.1-1 ms, too
#: much for every engine step.
REPORT_INTERVAL_S = 1.0
RELEASE_HISTOGRAM = "kvconn_abort_to_release_seconds"
KINDS = ("counters", "gauges", "releases")

_Key = tuple[str, str, tuple[tuple[str, str], ...]]


def empty() -> dict[str, Any]:
    """A report with nothing in it: ``families`` (name -> [type, help]) seen
    for the first time, ``counters`` ([name, endpoint, labels, increase]),
    ``gauges`` ([name, endpoint, labels, value]), ``releases`` ([endpoint,
    proof, seconds]); ``labels`` is [[key, value], ...]."""
    return {"families": {}, "counters": [], "gauges": [], "releases": []}


def merge(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``other``'s report to ``into`` (later entries win for gauges)."""
    for name, info in other.get("families", {}).items():
        into["families"].setdefault(name, info)
    for kind in KINDS:
        into[kind].extend(other.get(kind, []))
    return into


class Reporter:
    """What changed in some endpoints' registries since the last report,
    plus the releases seen (from ``on_release``, any thread); ``families``:
    only these (default: every counter and gauge)."""

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
        self._releases: list[list[Any]] = []
        self._counted: dict[_Key, float] = {}
        self._gauges: dict[_Key, float] = {}
        self._families: set[str] = set()
        self._next = 0.0

    def released(self, endpoint: str, release: Release) -> None:
        with self._lock:
            self._releases.append([endpoint, release.proof.value, release.held_for])

    def take(self, endpoints: Sequence[tuple[str, Metrics]], now_due: bool = False) -> dict[str, Any] | None:
        """The report due now, or None (within the interval, or nothing
        changed). ``now_due``: report even within the interval."""
        now = self.clock()
        if now < self._next and not now_due:
            return None
        self._next = now + self.interval_s
        report = empty()
        with self._lock:
            report["releases"], self._releases = self._releases, []
        for endpoint, metrics in endpoints:
            for family in metrics.registry.collect():
                if family.type not in ("counter", "gauge") or (
                    self.only is not None and family.name not in self.only
                ):
                    continue
                if family.name not in self._families:
                    self._families.add(family.name)
                    report["families"][family.name] = [family.type, family.documentation]
                for sample in family.samples:
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


class Recorder:
    """Records reports into metrics made by ``counter``, ``gauge`` and
    ``histogram`` (prometheus_client's classes, or an engine's wrappers of
    them, called as ``cls(name=, documentation=, labelnames=, ...)``); each
    family is made the first time it is reported, its labels known then.
    ``made`` collects every metric made, for an engine that must unregister
    them. ``base_labelnames``: the engine's labels, given first.
    ``histogram=None``: releases are not recorded."""

    def __init__(
        self,
        counter: Callable[..., Any],
        gauge: Callable[..., Any],
        histogram: Callable[..., Any] | None,
        base_labelnames: Sequence[str] = (),
    ) -> None:
        self._counter, self._gauge = counter, gauge
        self._base = list(base_labelnames)
        self._lock = threading.Lock()
        self._metrics: dict[str, tuple[Any, list[str]]] = {}
        self.releases = (
            None
            if histogram is None
            else histogram(
                name=RELEASE_HISTOGRAM,
                documentation="Abort to release, by proof",
                buckets=list(LATENCY_BUCKETS),
                labelnames=[*self._base, ENDPOINT_LABEL, "proof"],
            )
        )
        self.made: list[Any] = [] if self.releases is None else [self.releases]

    def _metric(self, name: str, kind: str, doc: str, keys: list[str]) -> tuple[Any, list[str]]:
        with self._lock:
            found = self._metrics.get(name)
            if found is None:
                labelnames = [*self._base, ENDPOINT_LABEL, *keys]
                if kind == "counter":
                    metric = self._counter(name=name, documentation=doc, labelnames=labelnames)
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
        for kind in ("counters", "gauges"):
            for name, endpoint, pairs, value in report.get(kind, []):
                labels = dict(pairs)
                family_type, doc = families.get(name, ["counter" if kind == "counters" else "gauge", name])
                metric, keys = self._metric(name, family_type, doc, sorted(labels))
                child = metric.labels(*base, endpoint, *(labels.get(k, "") for k in keys))
                if kind == "counters":
                    child.inc(value)
                else:
                    child.set(value)
        if self.releases is not None:
            for endpoint, proof, seconds in report.get("releases", []):
                self.releases.labels(*base, endpoint, proof).observe(seconds)
