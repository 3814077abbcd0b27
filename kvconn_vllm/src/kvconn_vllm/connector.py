"""``KvconnConnector``: vLLM's KVConnectorBase_V1, loaded out of tree with
``kv_connector="KvconnConnector", kv_connector_module_path="kvconn_vllm"``.

vLLM builds one instance per role: in the scheduler process it delegates to
:class:`~kvconn_vllm.scheduler.SchedulerSide`, in each worker to
:class:`~kvconn_vllm.worker.WorkerSide`. This class only translates.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

import kvconn
from kvconn_vllm import __version__
from kvconn_vllm.layout import KVGeometry
from kvconn_vllm.metadata import KvconnHandshake, KvconnMetadata
from kvconn_vllm.scheduler import SchedulerSide
from kvconn_vllm.settings import Settings
from kvconn_vllm.stats import KvconnConnectorStats, KvconnPromMetrics
from kvconn_vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _log_through_vllm() -> None:
    """kvconn's log lines (a drain's report at shutdown, a rank's address)
    in vLLM's log, at vLLM's level: vLLM configures only its own "vllm"
    logger, and a library's INFO lines otherwise go nowhere."""
    vllm = logging.getLogger("vllm")
    for name in ("kvconn", "kvconn_vllm"):
        ours = logging.getLogger(name)
        if ours.handlers or not vllm.handlers:
            continue  # configured by the operator, or vLLM logs nothing
        for handler in vllm.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm.getEffectiveLevel())
        ours.propagate = False


class KvconnConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        logging.getLogger("kvconn_vllm").info(
            "kvconn-vllm %s (kvconn-core %s), %s side", __version__, kvconn.__version__, role.name.lower()
        )
        transfer = self._kv_transfer_config
        settings = Settings.parse(transfer.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(str(transfer.engine_id), block_size)
            return
        (group,) = kv_cache_config.kv_cache_groups  # one group: the hybrid manager is off
        spec = group.kv_cache_spec
        geometry = KVGeometry(kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        parallel = vllm_config.parallel_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.worker_side = WorkerSide(
            settings,
            producer=bool(transfer.is_kv_producer),
            consumer=bool(transfer.is_kv_consumer),
            geometry=geometry,
            tp_size=parallel.tensor_parallel_size,
            tp_rank=get_tensor_model_parallel_rank(),
        )

    @property
    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-side method called on a worker connector"
        return self.scheduler_side

    @property
    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side method called on a scheduler connector"
        return self.worker_side

    # -- worker side -------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return KvconnHandshake(self._worker.address)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvconnMetadata)
        if meta.sends and torch.cuda.is_available():
            # The finished requests' last forward may still run on the stream.
            torch.cuda.current_stream().synchronize()
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # push mode: a request runs only once its whole KV landed

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # push mode: decode's request starts the send, not the forward

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(results.finished_sending),
            finished_recving=set(results.finished_recving),
            failed_recving=set(results.failed_recving),
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    # -- metrics (kvconn_vllm.stats) ---------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is None:  # the scheduler's connector: no endpoint there
            return None
        data = self.worker_side.stats()
        return None if data is None else KvconnConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        # A copy: vLLM's log accumulator extends the lists of the first it
        # builds, and the same dict goes to the Prometheus observer.
        copied = {
            key: (dict(value) if isinstance(value, dict) else list(value))
            for key, value in (data or {}).items()
        }
        return KvconnConnectorStats(data=copied)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvconnPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()

    # -- scheduler side ----------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        addresses = []
        for _, meta in sorted(metadata.items()):
            assert isinstance(meta, KvconnHandshake)
            if meta.address:
                addresses.append(meta.address)
        self._scheduler.addresses = tuple(addresses)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return (0,)  # every block of the request's one group is written by prefill

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output.total_num_scheduled_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # HND and NHD both work (whole blocks, or heads sliced)
