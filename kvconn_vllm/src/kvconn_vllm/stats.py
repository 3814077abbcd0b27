"""kvconn's figures on vLLM's own ``/metrics``, through its KV connector stats.

vLLM carries a connector's figures in three steps: each worker's connector
returns a :class:`KVConnectorStats` from ``get_kv_connector_stats()`` after
every step (its ``data`` dict travels to the engine core and on to the API
server, TP workers' merged with ``aggregate``); there the connector class's
``build_prom_metrics`` object gets each one in ``observe(data, engine_idx)``
and records it into metrics made from the classes vLLM hands it, which vLLM
serves on ``/metrics`` (through Ray's wrappers, or prometheus_client's
multiprocess mode, where vLLM uses those).

The report is :mod:`kvconn.metrics_relay`'s: every counter, gauge and
histogram of the worker's endpoints under kvconn's own names
(``kvconn_releases_total``, ``kvconn_pages_quarantined``,
``kvconn_abort_to_ack_seconds``, ...; ``monitoring/``'s rules apply
unchanged), ``kvconn_endpoint`` = ``decode-<tp rank>`` / ``prefill-<tp
rank>``, and vLLM's ``model_name`` and ``engine`` labels. The API server
records every family of the endpoints its engines run, at their start
values, when vLLM builds this connector's metrics: kvconn's series are on
``/metrics`` from the server's start, before any request (a rank's own
series, from when decode first asks that prefill instance).

Figures move when the engine steps: a worker reports at most once a second,
and at once on the step that ends its last pending transfer; an idle engine
runs no step, so a gauge (the quarantine's age) stands still on ``/metrics``
while the engine is idle. (vLLM keeps stepping while a request waits for its
KV, held pages included.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvconn.metrics_relay import KINDS, Recorder, empty, initial_report, merge, releases

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The metrics the last KvconnPromMetrics made: vLLM makes its stat loggers
#: again in one process (tests; its own clean-up unregisters only ``vllm:``
#: names), and prometheus_client refuses a name registered twice.
_MADE: list[Any] = []


@dataclass
class KvconnConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """One or more workers' :mod:`kvconn.metrics_relay` reports."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(kind) for kind in KINDS)

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line: releases in the interval, and the
        last pages held / quarantined of every endpoint, summed."""
        last: dict[tuple[str, str], float] = {}
        for name, endpoint, _labels, value in self.data["gauges"]:
            last[(name, endpoint)] = value
        return {
            "kvconn releases": releases(self.data),
            "kvconn pages held": sum(v for (n, _), v in last.items() if n == "kvconn_pages_held"),
            "kvconn pages quarantined": sum(
                v for (n, _), v in last.items() if n == "kvconn_pages_quarantined"
            ),
        }


def expected_endpoints(vllm_config: Any) -> list[tuple[str, str]]:
    """``(kvconn_endpoint, role)`` of every endpoint the engine's workers
    run: by ``kv_role`` (both roles when unknown), one per TP rank."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    role = getattr(transfer, "kv_role", None)
    roles = {"kv_producer": ["prefill"], "kv_consumer": ["decode"]}.get(str(role), ["prefill", "decode"])
    parallel = getattr(vllm_config, "parallel_config", None)
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    return [(f"{r}-{rank}", r) for r in roles for rank in range(tp_size)]


class KvconnPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The API server's side: records reports into vLLM's metric classes."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        while _MADE:
            with contextlib.suppress(KeyError):  # not in the default registry (Ray's wrappers)
                REGISTRY.unregister(_MADE.pop())
        self.recorder = Recorder(self._counter_cls, self._gauge_cls, self._histogram_cls, labelnames)
        start = initial_report(expected_endpoints(vllm_config))
        for labelvalues in per_engine_labelvalues.values():
            self.recorder.record(start, labelvalues)
        _MADE.extend(self.recorder.made)
        self._made = len(self.recorder.made)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.recorder.record(transfer_stats_data, self.per_engine_labelvalues[engine_idx])
        _MADE.extend(self.recorder.made[self._made :])
        self._made = len(self.recorder.made)
