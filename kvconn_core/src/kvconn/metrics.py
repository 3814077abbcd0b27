"""Counters and gauges of one endpoint, in its own Prometheus registry.

Each endpoint gets a fresh :class:`prometheus_client.CollectorRegistry`, so
several endpoints in one process (tests, the bench) never share a series;
``value()`` reads a sample in-process, ``exposition()`` renders the text
format for a scrape handler, and :func:`serve_metrics` / :func:`export` serve
one or more registries over HTTP for an engine that has no metrics endpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvconn.protocol.hold import Proof
from kvconn.protocol.messages import TAGS
from kvconn.transport import Settlement

#: ``kvconn_fences_total{result}`` and ``kvconn_ranks_down_total{cause}``: every value the runtime counts.
FENCE_RESULTS = ("ok", "failed")
RANK_DOWN_CAUSES = ("exited", "silent", "hung")
#: ``kvconn_owner_fences_total{outcome}``: "no_endpoint" held, but left the
#: region without a transport endpoint until a later try makes one.
OWNER_FENCE_OUTCOMES = ("ok", "failed", "no_endpoint")
#: ``kvconn_requests_refused_total{reason}``: why ``receiver()`` asked nothing.
#: "pages_in_use": the engine handed out pages kvconn still guards (a bug of
#: its integration, alerted on); "rank_down" / "endpoint_down": it could only
#: fail (kvconn.errors.UnavailableError); "draining"; "room_in_use"; a new
#: instance's "bootstrap" failed; "invalid" arguments.
REFUSAL_REASONS = (
    "pages_in_use", "rank_down", "endpoint_down", "draining", "room_in_use", "bootstrap", "invalid",
)  # fmt: skip

#: Families whose values exist only when a registry is scraped (the
#: tallies' plain ints, decode's hold gauges computed from its tracker):
#: prometheus_client's multiprocess files, which SGLang's /metrics reads,
#: never see them (kvconn_sglang.metrics relays them).
SCRAPE_TIME_FAMILIES = frozenset(
    {
        "kvconn_chunks",
        "kvconn_messages",
        "kvconn_releases",
        "kvconn_released_pages",
        "kvconn_rooms_held",
        "kvconn_pages_held",
        "kvconn_pages_quarantined",
        "kvconn_quarantine_oldest_seconds",
        "kvconn_acks_awaiting_drain",
        "kvconn_transport_endpoint_up",
        "kvconn_prefill_rank_up",
        "kvconn_rooms_awaiting_rank",
        "kvconn_rank_info",
    }
)
#: The labels that name a prefill rank at decode: its endpoint-wide id (the
#: one decode's log uses, counted across the instances it serves) and its
#: control address (``tcp://HOST:PORT``: the host, and the port it listens on).
RANK_LABELS = ("rank", "address")

#: Seconds: 0.1 ms to 100 s in 1-2-5 steps (a fast ack to past a 30 s deadline).
LATENCY_BUCKETS = (
    1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100,
)  # fmt: skip


#: Seconds: 10 µs to 1 s in 1-2-5 steps (kvconn's own share of an abort at a rank).
FINE_BUCKETS = (
    1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1,
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


class ScrapeGauge:
    """A gauge computed when scraped (:meth:`set_function`), a collector of
    its own rather than a prometheus_client ``Gauge``: it keeps no value, so
    in prometheus_client's multiprocess mode (SGLang's ``/metrics``) it
    leaves no stale series behind in the files; kvconn_sglang relays it."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self._read: Callable[[], float] = lambda: 0.0
        registry.register(self)

    def set_function(self, read: Callable[[], float]) -> None:
        self._read = read

    def set(self, value: float) -> None:
        self._read = lambda: value

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, value=float(self._read()))


class LabelledScrapeGauge:
    """A :class:`ScrapeGauge` with labels: ``set_function(read)``, where
    ``read()`` gives ``(label values, value)`` of every series (every one,
    zeros too: a series left out vanishes from the scrape, and a relayed
    copy would keep its last value)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self._read: Callable[[], Iterable[tuple[Sequence[str], float]]] = list
        registry.register(self)

    def set_function(self, read: Callable[[], Iterable[tuple[Sequence[str], float]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, value in self._read():
            family.add_metric(list(values), float(value))
        yield family


class Metrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.role = role
        self._listeners: list[Callable[[str, Mapping[str, str], float], None]] = []
        self.dropped = Counter("kvconn_dropped_messages", "Control frames dropped", ["reason"], registry=r)
        #: Counted on the listener's thread only, on every message: a tally.
        self.messages = Tally(
            "kvconn_messages", "Control messages handled", "type", (c.__name__ for c in TAGS), registry=r
        )
        #: Labelled children by (metric, label values): see :meth:`child`.
        self._children: dict[tuple[Any, tuple[tuple[str, str], ...]], Any] = {}
        self.trace_contexts_dropped = Counter(
            "kvconn_trace_contexts_dropped",
            "Trace contexts that did not parse (message still handled)",
            registry=r,
        )
        # prefill side
        outcomes = [s.value for s in Settlement] + ["skipped", "plugin_error"]
        self.chunks = Tally("kvconn_chunks", "Chunks by outcome", "outcome", outcomes, registry=r)
        self.acks_sent = Counter("kvconn_acks_sent", "ABORT_ACKs sent", registry=r)
        self.fences = Counter("kvconn_fences", "Writer fences by result", ["result"], registry=r)
        self.plugin_errors = Counter("kvconn_plugin_errors", "Hooks that raised", ["hook"], registry=r)
        self.poisoned_rooms = Gauge("kvconn_poisoned_rooms", "Rooms waiting for a fence", registry=r)
        self.abort_own = Histogram(
            "kvconn_abort_ack_own_seconds",
            "An ABORT reaching the rank's handler to its ABORT_ACK sent, less the wait for the "
            "chunk in flight to settle: the rank's own share of a release",
            registry=r,
            buckets=FINE_BUCKETS,
        )
        self.rank_info = LabelledScrapeGauge(
            "kvconn_rank_info",
            "1, labelled with this prefill rank's control address (what decode's per-rank series name it by)",
            ["address", "rank"],
            r,
        )
        # decode side
        self.acks_received = Counter("kvconn_acks_received", "ABORT_ACKs that proved a rank", registry=r)
        self.aborts_sent = Counter("kvconn_aborts_sent", "ABORT messages sent", registry=r)
        # Counted under the endpoint's lock on every release: tallies.
        proofs = [p.value for p in Proof]
        self.releases = Tally("kvconn_releases", "Held rooms released, by proof", "proof", proofs, registry=r)
        self.released_pages = Tally(
            "kvconn_released_pages", "Held pages released", "proof", proofs, registry=r
        )
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
            "kvconn_ranks_down",
            "Prefill ranks found dead or unreachable, by cause and rank",
            ["cause", *RANK_LABELS],
            registry=r,
        )
        self.rank_restarts = Counter(
            "kvconn_rank_restarts", "Prefill ranks re-bootstrapped with a new session", registry=r
        )
        self.rooms_failed_by_rank = Counter(
            "kvconn_rooms_failed_by_rank",
            "Open rooms failed because a rank died, went silent or restarted",
            registry=r,
        )
        self.owner_fences = Counter(
            "kvconn_owner_fences", "Owner fences decode carried out, by outcome", ["outcome"], registry=r
        )
        self.owner_fence_pages = Counter(
            "kvconn_owner_fence_pages_recovered", "Held pages released by an owner fence", registry=r
        )
        self.requests_refused = Counter(
            "kvconn_requests_refused",
            "Requests decode refused before asking any rank, by reason (pages_in_use: the engine "
            "reused pages kvconn had not released)",
            ["reason"],
            registry=r,
        )
        self.endpoint_up = ScrapeGauge(
            "kvconn_transport_endpoint_up",
            "1 while decode's region has a transport endpoint (0: an owner fence left none yet)",
            r,
        )
        self.endpoint_up.set(1.0)  # a prefill rank's is always up; decode's reads its state
        self.rooms_held = ScrapeGauge("kvconn_rooms_held", "Rooms held after abort", r)
        self.acks_draining = ScrapeGauge(
            "kvconn_acks_awaiting_drain",
            "Fenced acks waiting for decode's ends of the connections the fence closed to drain",
            r,
        )
        self.pages_held = ScrapeGauge("kvconn_pages_held", "Pages held after abort (incl. quarantine)", r)
        self.pages_quarantined = ScrapeGauge("kvconn_pages_quarantined", "Pages in quarantine", r)
        self.quarantine_age = ScrapeGauge(
            "kvconn_quarantine_oldest_seconds", "Time the oldest quarantined room has waited", r
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
            list(RANK_LABELS),
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.rank_up = LabelledScrapeGauge(
            "kvconn_prefill_rank_up",
            "1 while decode hears a prefill rank it bootstrapped, 0 while it finds it down",
            RANK_LABELS,
            r,
        )
        self.awaiting_rank = LabelledScrapeGauge(
            "kvconn_rooms_awaiting_rank",
            "Aborted rooms (held or quarantined) whose pages wait for this prefill rank's proof",
            [*RANK_LABELS, "state"],
            r,
        )
        self.quarantine_seconds = Counter(
            "kvconn_quarantine_seconds", "Time released rooms spent in quarantine", registry=r
        )
        # Known label values are exported at 0 from the start: Prometheus's
        # increase() cannot see a series' first event, so a counter child
        # created by its first inc() would never fire an alert on it.
        for proof in Proof:
            self.release_latency.labels(proof.value)
        for result in FENCE_RESULTS:
            self.fences.labels(result)
        for outcome in OWNER_FENCE_OUTCOMES:
            self.owner_fences.labels(outcome)
        for reason in REFUSAL_REASONS:
            self.requests_refused.labels(reason)

    def labelnames(self) -> dict[str, tuple[str, ...]]:
        """Each family's label names, by family name (``le`` aside): what an
        engine's relay needs to make a family before its first sample."""
        names: dict[str, tuple[str, ...]] = {}
        for value in vars(self).values():
            if isinstance(value, Counter | Gauge | Histogram):
                (family,) = value.describe()
                names[family.name] = tuple(getattr(value, "_labelnames", ()))
            elif isinstance(value, Tally):
                names[value.name] = (value.label,)
            elif isinstance(value, LabelledScrapeGauge):
                names[value.name] = tuple(value.labelnames)
            elif isinstance(value, ScrapeGauge):
                names[value.name] = ()
        return names

    def listen(self, observed: Callable[[str, Mapping[str, str], float], None]) -> None:
        """Call ``observed(histogram name, labels, value)`` for each
        observation made through :meth:`observe` from now on (on the thread
        that observes, under the endpoint's lock: it must only take note):
        how an engine's relay carries histograms exactly."""
        self._listeners.append(observed)

    def child(self, metric: Counter | Histogram, **labels: str) -> Any:
        """``metric.labels(**labels)``, kept: the hot path (a release, an
        ack) asks the same few children every time, and prometheus_client
        checks and looks the values up under a lock at each ``labels()``
        call (a quarter of decode's listener CPU per aborted room, profiled)."""
        key = (metric, tuple(labels.items()))  # a call site names its labels in one order
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**labels)
        return child

    def observe(self, histogram: Histogram, name: str, value: float, **labels: str) -> None:
        """``histogram`` (``name``) observes ``value`` for ``labels``, and the listeners hear of it."""
        self.child(histogram, **labels).observe(value)
        for observed in self._listeners:
            observed(name, labels, value)

    def known_rank(self, rank: int, address: str) -> None:
        """Decode bootstrapped prefill rank ``rank`` at ``address``: its
        series exist from now, at 0 (``kvconn_ranks_down_total`` for each
        cause, so that ``increase()`` sees its first event; its abort-to-ack
        histogram, empty)."""
        labels = (str(rank), address)
        for cause in RANK_DOWN_CAUSES:
            self.ranks_down.labels(cause, *labels)
        self.ack_wait.labels(*labels)

    def count_message(self, kind: type) -> None:
        """One more control message of type ``kind`` handled (on the listener's thread)."""
        self.messages.counts[kind.__name__] += 1

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples ``name`` whose labels include ``labels``
        (0 if none): ``value("kvconn_releases_total", proof="acks")``,
        ``value("kvconn_ranks_down_total", cause="silent")`` (every rank)."""
        total = 0.0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total

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


#: The label the exporter adds to every sample: which endpoint's registry it
#: came from. A decode endpoint and its ranks register the same families, so
#: one scrape of several registries needs it to keep their series apart.
#: Not ``endpoint``: the Prometheus Operator sets that target label itself.
ENDPOINT_LABEL = "kvconn_endpoint"


class _Merged:
    """A collector over several registries, each sample labelled with its
    registry's name; families of one name are merged, since the text format
    allows one HELP/TYPE block per family."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, CollectorRegistry] = {}

    def add(self, name: str, registry: CollectorRegistry) -> None:
        with self._lock:
            if name in self._sources:
                raise ValueError(f"a registry named {name!r} is already served")
            self._sources[name] = registry

    def remove(self, name: str) -> None:
        with self._lock:
            self._sources.pop(name, None)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._sources)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = list(self._sources.items())
        merged: dict[str, Metric] = {}
        for name, registry in sources:
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for s in family.samples:
                    out.samples.append(s._replace(labels={**s.labels, ENDPOINT_LABEL: name}))
        yield from merged.values()


class MetricsServer:
    """An HTTP exporter (``GET /metrics``, Prometheus text format) of one or
    more endpoints' registries on one port, for engines that serve none.

    Scrapes run on its own thread; decode's hold gauges take the endpoint's
    lock for one pass over the held rooms, as an in-process scrape does.
    """

    def __init__(self, port: int = 0, addr: str = "127.0.0.1") -> None:
        self._merged = _Merged()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._merged)
        try:
            self._server, self._thread = start_http_server(port, addr, registry=registry)
        except OSError as exc:  # named: the OS's own message leaves the address out
            named = OSError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}")
            named.errno = exc.errno
            raise named from exc
        self.addr = addr
        #: The bound port (the one the OS chose, for ``port=0``).
        self.port: int = self._server.server_port
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def add(self, name: str, registry: CollectorRegistry) -> None:
        """Serve ``registry`` too, its samples labelled ``kvconn_endpoint=name``."""
        self._merged.add(name, registry)

    def remove(self, name: str) -> None:
        self._merged.remove(name)

    def names(self) -> list[str]:
        return self._merged.names()

    def close(self) -> None:
        """Stop serving and free the port; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(
    registries: Mapping[str, CollectorRegistry | Metrics] | CollectorRegistry | Metrics,
    port: int = 0,
    addr: str = "127.0.0.1",
) -> MetricsServer:
    """Serve endpoints' metrics on ``http://addr:port/metrics``; ``port=0``
    takes a free port (read it from ``.port``). ``registries`` maps a name
    (the ``kvconn_endpoint`` label of its samples) to a registry or an
    endpoint's :class:`Metrics`; a single one is named by its role."""
    if isinstance(registries, (CollectorRegistry, Metrics)):
        registries = {registries.role if isinstance(registries, Metrics) else "kvconn": registries}
    server = MetricsServer(port, addr)
    try:
        for name, r in registries.items():
            server.add(name, r.registry if isinstance(r, Metrics) else r)
    except BaseException:
        server.close()
        raise
    return server


_shared_lock = threading.Lock()
_shared: dict[tuple[str, int], MetricsServer] = {}


class Exported:
    """One endpoint served on its process's shared exporter (:func:`export`)."""

    def __init__(self, key: tuple[str, int], server: MetricsServer, name: str) -> None:
        self._key, self.server, self.name = key, server, name
        self._closed = False

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        """Stop serving this endpoint; the server stops with its last one. Idempotent."""
        with _shared_lock:
            if self._closed:
                return
            self._closed = True
            self.server.remove(self.name)
            if not self.server.names() and _shared.get(self._key) is self.server:
                del _shared[self._key]
                self.server.close()


def export(metrics: Metrics, name: str, port: int, addr: str = "127.0.0.1") -> Exported:
    """Serve ``metrics`` on the process's exporter at ``addr:port``, started
    by the first endpoint that asks and stopped when the last one leaves, so
    a decode endpoint and ranks in one process share one port (``port=0``:
    one free port, shared the same way). ``name`` is made unique
    (``decode``, ``decode-2``, ...)."""
    key = (addr, port)
    with _shared_lock:
        server = _shared.get(key)
        if server is None:
            server = _shared[key] = MetricsServer(port, addr)
        taken = set(server.names())
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}-{n}"
        server.add(unique, metrics.registry)
    return Exported(key, server, unique)
