"""Deployment settings shared by both sides, validated where they meet."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import attrs

from kvconn.protocol.write_deadline import check_writer_deadline


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


@attrs.frozen
class Config:
    """Timeouts, addresses and keys of one kvconn endpoint.

    ``write_timeout_s`` bounds a prefill chunk from post to settled;
    ``abort_timeout_s`` is how long decode holds an aborted room before it
    quarantines it. A live writer must give up (poison, fence, ack) before
    decode has to quarantine, so the first must be shorter than the second:
    this is checked here and again when decode bootstraps a prefill rank.
    """

    write_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    abort_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    resend_interval_s: float = attrs.field(default=1.0, validator=_positive)
    tombstone_ttl_s: float = attrs.field(default=600.0, validator=_positive)
    bootstrap_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    #: Legacy: free aborted pages at the deadline without proof. Unsafe.
    unsafe_release_at_deadline: bool = False
    #: Whether prefill ranks send ABORT_ACK at all (off = timeout-only legacy).
    acks_enabled: bool = True
    #: Decode fails a room (FAILED to the engine, then the abort path: its
    #: pages stay held until proof) that is not complete this long after
    #: ``receiver()``. None: no deadline (the engine keeps its own).
    transfer_timeout_s: float | None = None
    #: Prefill fails a room whose decode request has not arrived this long
    #: after ``sender()`` (SGLang's bootstrap timeout): its Sender says
    #: FAILED, and a request arriving later is refused at once (decode is
    #: told FAILED) and writes nothing. None: the sender waits.
    room_bootstrap_timeout_s: float | None = None
    #: Decode re-sends its Hello to every rank this often: the answer proves
    #: the rank alive and names its session (a restart shows as a new one).
    heartbeat_interval_s: float = attrs.field(default=1.0, validator=_positive)
    #: A rank not heard from this long is down: its open rooms fail (and
    #: are aborted), new rooms on it fail at once, until it answers again.
    #: Not while decode's control link to it is up (its process answers the
    #: link's own heartbeat, which needs none of its Python threads: it runs
    #: and is reachable, only slow): then only after ``peer_hung_timeout_s``
    #: (protocol/liveness.py).
    peer_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    #: A rank whose control link is up but which leaves a Hello unanswered
    #: this long is down too: its process runs, its kvconn threads do not
    #: answer (hung, or starved past any load this should ride out).
    peer_hung_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    #: Decode fences as the page owner (``kvconn.transport.owner_fence``:
    #: its region's whole transport endpoint destroyed, so that no writer on
    #: any host can land a byte) once a room has been quarantined this long
    #: with no proof. It releases every held room and fails every room in
    #: flight (recomputed), and every prefill rank re-bootstraps. Only where
    #: the backend claims ``Capabilities.owner_fence``. None: never.
    owner_fence_after_s: float | None = None
    #: At most one owner fence (tried, ok or not) per this many seconds.
    owner_fence_min_interval_s: float = attrs.field(default=60.0, validator=_positive)
    workers: int = 1
    #: Decode refuses a request whose pages belong to another room not yet
    #: finished or released (one byte per page, one pass over the pages).
    check_pages: bool = True
    host: str = "127.0.0.1"
    port: int = 0
    #: Shared deployment key: every control frame carries an HMAC-SHA256.
    auth_key: bytes | None = attrs.field(default=None, repr=False)
    backend_options: Mapping[str, str] = attrs.field(factory=dict)
    #: ``sys.setswitchinterval`` for this process, or ``None`` to leave it.
    #: kvconn's control plane runs on Python threads: while another thread of
    #: the process computes, a listener waits up to the switch interval (5 ms
    #: by default) for the GIL, at each hop of an abort (decode, rank,
    #: decode). Process-wide, hence opt-in; ``kvconn bench`` sets 0.5 ms.
    gil_switch_interval_s: float | None = None
    #: Serve the endpoint's metrics at ``http://host:metrics_port/metrics``
    #: (:func:`kvconn.metrics.export`: the endpoints of one process share the
    #: port, each sample labelled ``kvconn_endpoint``). 0: a free port (read
    #: it from the endpoint's ``metrics_server``). None: not served.
    metrics_port: int | None = None
    #: Trace each room with OpenTelemetry (the ``kvconn-core[trace]`` extra):
    #: spans go to the process's tracer provider, one trace per room across
    #: decode and its prefill ranks (``kvconn.runtime.tracing``). Off, or
    #: without ``opentelemetry-api``: nothing is traced (no-op calls).
    tracing: bool = False

    def __attrs_post_init__(self) -> None:
        check_writer_deadline(self.write_timeout_s, self.abort_timeout_s)
        for name in ("transfer_timeout_s", "room_bootstrap_timeout_s", "owner_fence_after_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"peer_timeout_s ({self.peer_timeout_s} s) must be longer than heartbeat_interval_s "
                f"({self.heartbeat_interval_s} s)"
            )
        if self.peer_hung_timeout_s < self.peer_timeout_s:
            raise ValueError(
                f"peer_hung_timeout_s ({self.peer_hung_timeout_s} s) must not be shorter than "
                f"peer_timeout_s ({self.peer_timeout_s} s)"
            )
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.host in ("", "*", "0.0.0.0", "::"):
            raise ValueError(f"bind to an explicit address, not {self.host!r}")
        if self.gil_switch_interval_s is not None and self.gil_switch_interval_s <= 0:
            raise ValueError(f"gil_switch_interval_s must be > 0, got {self.gil_switch_interval_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0-65535 or None, got {self.metrics_port}")

    def apply_to_process(self) -> None:
        """Apply the process-wide settings (called by each endpoint)."""
        if self.gil_switch_interval_s is not None:
            sys.setswitchinterval(self.gil_switch_interval_s)


#: The rule itself lives in the protocol core (kvconn.protocol.write_deadline);
#: this name stays for the callers that import it from here.
check_deadlines = check_writer_deadline
