"""Every option kvconn-mooncake reads, for regions, writers and the raw
writer alike (one mapping reaches all of them); any other key is refused."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kvconn.options import BackendOptions

OPTIONS = frozenset(
    {
        # the engine (_engine.py)
        "host",
        "protocol",
        "device",
        # page and source memory (_memory.py)
        "memory",
        "gpu_device",
        # writers (backend.py, raw.py)
        "max_inflight",
        "max_batch",
        "poll_interval_s",
        "hot_poll_s",
        "batch_status",
        "max_engines",
    }
)


def read(options: Mapping[str, str]) -> BackendOptions:
    return BackendOptions("mooncake", options, OPTIONS)


DEFAULT_MAX_INFLIGHT = 512
BATCH_STATUS_MODES = ("auto", "on", "off")
DEFAULT_POLL_INTERVAL_S = 0.0001  # a longer cap noticed completion late: 78% of raw at 1 MiB
#: How long a DONE barrier polls hot (None: until the chunk settles or its
#: deadline passes), then it sleeps between polls. None, as the raw API's
#: blocking status call spins: side by side with it (`kvconn bench
#: --transport`, 2-core VM, 15 pairs, two rounds each) spinning gave 95.0 and
#: 95.6% of raw for 1024 scattered 4 KiB pages against 76.7 and 94.8% with
#: 2 ms, 97.7 and 94.6% at 1 MiB against 92.8 and 92.2%, 104.1 and 104.4% at
#: 64 MiB against 108.3 and 106.6% (all met there); release p99 at 3,000
#: requests 8.64 and 5.51 ms against 8.87 and 8.38. (Interleaved chunk by
#: chunk in one process, 64 MiB chunks had taken 62.6 ms spinning against
#: 52.2 with 2 ms: there the spinner took a core from the engine's copies.)
DEFAULT_HOT_POLL_S: float | None = None
#: Engines a writer keeps before a channel that needs one takes an idle
#: channel's instead: a decode that left (a restart has a new name) would
#: otherwise keep its engine (~3 threads, a port) for the writer's lifetime.
DEFAULT_MAX_ENGINES = 64


@attrs.frozen
class WriterOptions:
    """A writer's own options (see the README for each)."""

    #: At most 1000: the engine rejects ~1024 pieces in flight per peer.
    max_inflight: int
    max_batch: int
    poll_interval_s: float
    #: How long a DONE barrier polls without sleeping (None: until the chunk
    #: settles or its deadline passes), then every poll_interval_s.
    hot_poll_s: float | None
    batch_status: str
    #: Above this many engines, a channel that needs one takes the least
    #: recently used idle channel's (see DEFAULT_MAX_ENGINES).
    max_engines: int

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriterOptions:
        opts = read(options)
        max_inflight = opts.integer("max_inflight", DEFAULT_MAX_INFLIGHT, low=1, high=1000)
        return cls(
            max_inflight=max_inflight,
            max_batch=opts.integer("max_batch", max_inflight, low=1),
            poll_interval_s=opts.number("poll_interval_s", DEFAULT_POLL_INTERVAL_S, low=0.0),
            hot_poll_s=opts.seconds_or_none("hot_poll_s", DEFAULT_HOT_POLL_S),
            batch_status=opts.choice("batch_status", "auto", BATCH_STATUS_MODES),
            max_engines=opts.integer("max_engines", DEFAULT_MAX_ENGINES, low=1),
        )
