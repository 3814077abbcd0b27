"""Every option kvconn-mooncake reads, for regions, writers and the raw
writer alike (one mapping reaches all of them); any other key is refused."""

from __future__ import annotations

from collections.abc import Mapping

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
