"""Counters and gauges of one endpoint, in its own Prometheus registry.

Each endpoint gets a fresh :class:`prometheus_client.CollectorRegistry`, so
several endpoints in one process (tests, the bench) never share a series;
``value()`` reads a sample in-process, ``exposition()`` renders the text
format for a scrape handler.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from kvconn.transport import Settlement

#: Seconds: 0.1 ms to 100 s in 1-2-5 steps (a fast ack to past a 30 s deadline).
LATENCY_BUCKETS = (
    1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100,
)  # fmt: skip


class Tally:
    """A counter by one label, kept as plain ints for a per-chunk path.

    ``counts[value] += 1`` under its owner's lock costs ~0.1 us; a
    ``prometheus_client`` ``Counter.inc`` measured ~5 us a chunk inside a
    transfer worker (its own lock and checks, cold after a transfer). The
    registry reads the ints when scraped, as ``<name>_total{<label>=...}``.
    """

    def __init__(
        self, name: str, documentation: str, label: str, values: Iterable[str], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.counts: dict[str, int] = dict.fromkeys(values, 0)  # fixed keys: safe to read while counted
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, n in self.counts.items():
            family.add_metric([value], n)
        yield family


class Metrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.role = role
        self.dropped = Counter("kvconn_dropped_messages", "Control frames dropped", ["reason"], registry=r)
        self.messages = Counter("kvconn_messages", "Control messages handled", ["type"], registry=r)
        # prefill side
        outcomes = [s.value for s in Settlement] + ["skipped", "plugin_error"]
        self.chunks = Tally("kvconn_chunks", "Chunks by outcome", "outcome", outcomes, registry=r)
        self.acks_sent = Counter("kvconn_acks_sent", "ABORT_ACKs sent", registry=r)
        self.fences = Counter("kvconn_fences", "Writer fences by result", ["result"], registry=r)
        self.plugin_errors = Counter("kvconn_plugin_errors", "Hooks that raised", ["hook"], registry=r)
        self.poisoned_rooms = Gauge("kvconn_poisoned_rooms", "Rooms waiting for a fence", registry=r)
        # decode side
        self.acks_received = Counter("kvconn_acks_received", "ABORT_ACKs that proved a rank", registry=r)
        self.aborts_sent = Counter("kvconn_aborts_sent", "ABORT messages sent", registry=r)
        self.releases = Counter("kvconn_releases", "Held rooms released, by proof", ["proof"], registry=r)
        self.released_pages = Counter("kvconn_released_pages", "Held pages released", ["proof"], registry=r)
        self.quarantines = Counter("kvconn_quarantines", "Rooms moved to quarantine", registry=r)
        self.room_bootstrap_timeouts = Counter(
            "kvconn_room_bootstrap_timeouts",
            "Rooms a prefill sender gave up on: decode's request did not arrive in time",
            registry=r,
        )
        self.room_deadlines = Counter(
            "kvconn_room_deadlines", "Open rooms failed by their transfer deadline", registry=r
        )
        self.ranks_down = Counter(
            "kvconn_ranks_down", "Prefill ranks found dead or unreachable, by cause", ["cause"], registry=r
        )
        self.rank_restarts = Counter(
            "kvconn_rank_restarts", "Prefill ranks re-bootstrapped with a new session", registry=r
        )
        self.rooms_failed_by_rank = Counter(
            "kvconn_rooms_failed_by_rank",
            "Open rooms failed because a rank died, went silent or restarted",
            registry=r,
        )
        self.rooms_held = Gauge("kvconn_rooms_held", "Rooms held after abort", registry=r)
        self.acks_draining = Gauge(
            "kvconn_acks_awaiting_drain",
            "Fenced acks waiting for decode's ends of the connections the fence closed to drain",
            registry=r,
        )
        self.pages_held = Gauge("kvconn_pages_held", "Pages held after abort (incl. quarantine)", registry=r)
        self.pages_quarantined = Gauge("kvconn_pages_quarantined", "Pages in quarantine", registry=r)
        self.quarantine_age = Gauge(
            "kvconn_quarantine_oldest_seconds", "Time the oldest quarantined room has waited", registry=r
        )
        self.release_latency = Histogram(
            "kvconn_abort_to_release_seconds",
            "Abort to release, by proof",
            ["proof"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.ack_wait = Histogram(
            "kvconn_abort_to_ack_seconds",
            "Abort to a rank's accepted ABORT_ACK, by rank: which rank holds aborted pages",
            ["rank"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.quarantine_seconds = Counter(
            "kvconn_quarantine_seconds", "Time released rooms spent in quarantine", registry=r
        )

    def value(self, name: str, **labels: str) -> float:
        """A sample's value (0 if never set): ``value("kvconn_releases_total", proof="acks")``."""
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else float(v)

    def buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        """A histogram's cumulative buckets, ``(upper bound, count)`` in order
        (``+Inf`` last); empty if never observed with these labels."""
        out = []
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == f"{name}_bucket" and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    out.append((float(sample.labels["le"]), sample.value))
        return sorted(out)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
