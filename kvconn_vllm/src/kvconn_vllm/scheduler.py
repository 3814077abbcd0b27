"""The scheduler-side half: bookkeeping only, no I/O.

Prefill: a request with ``do_remote_decode`` keeps its blocks when it
finishes (``request_finished`` answers True) until the worker reports the
send settled; its output's ``kv_transfer_params`` tell decode where the KV
is. Decode: a request with those params gets its blocks allocated and waits
(WAITING_FOR_REMOTE_KVS) until the worker reports the room received, failed,
or, when the scheduler aborted it meanwhile, released with proof.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvconn_vllm.metadata import KvconnMetadata, Recv, Send
from kvconn_vllm.params import ParamsError, RemotePrefill, room_for, wants_remote_decode

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerSide:
    def __init__(self, engine_id: str, block_size: int) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        #: This engine's prefill rank addresses, in rank order (handshake).
        self.addresses: tuple[str, ...] = ()
        self._sends: list[Send] = []
        self._recvs: list[Recv] = []
        self._aborts: list[str] = []
        #: Decode requests whose KV is on its way (registered, not reported).
        self._recving: set[str] = set()
        #: Prefill requests whose blocks are kept for a send.
        self._sending: set[str] = set()

    # -- decode ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None:
            return 0, False
        count = min(remote.num_tokens, len(request.prompt_token_ids or ())) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        remote = self._remote(request)
        if remote is None or num_external_tokens <= 0:
            return
        # Blocks a local prefix-cache hit filled are hashed; the rest, the
        # tail of the prompt's blocks, are the ones prefill writes.
        (block_ids,) = blocks.get_unhashed_block_ids_all_groups()
        self._recvs.append(Recv(request.request_id, remote.room, remote.prefill, tuple(block_ids)))
        self._recving.add(request.request_id)
        # Registered once: a preempted and rescheduled request must not ask again.
        assert request.kv_transfer_params is not None
        request.kv_transfer_params["do_remote_prefill"] = False

    def _remote(self, request: Request) -> RemotePrefill | None:
        try:
            return RemotePrefill.from_params(request.kv_transfer_params)
        except ParamsError as exc:
            # The request is computed here instead; a proxy bug must not stall it.
            log.warning("request %s: ignoring kv_transfer_params (%s)", request.request_id, exc)
            return None

    # -- both --------------------------------------------------------------
    def build_connector_meta(self, scheduled_tokens: int = 1) -> KvconnMetadata:
        """This step's sends, receives and aborts; ``idle`` when the step
        computes nothing (``scheduled_tokens`` 0)."""
        meta = KvconnMetadata(self._sends, self._recvs, self._aborts, idle=scheduled_tokens == 0)
        self._sends, self._recvs, self._aborts = [], [], []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if req_id in self._recving:
            # Aborted while its KV was on its way: the scheduler keeps the
            # blocks until the worker reports them released with proof.
            self._recving.discard(req_id)
            self._aborts.append(req_id)
            return False, None
        if not wants_remote_decode(request.kv_transfer_params):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted at prefill: decode is never told
        if not self.addresses:
            log.error("request %s: no prefill rank address (is kv_role a producer?)", req_id)
            return False, None
        num_tokens = request.num_computed_tokens
        blocks = tuple(block_ids[: _cdiv(num_tokens, self.block_size)])
        if not blocks:
            return False, None
        room = room_for(self.engine_id, req_id)
        self._sends.append(Send(req_id, room, blocks))
        self._sending.add(req_id)
        return True, RemotePrefill(room, self.addresses, num_tokens).to_params()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_sending or ():
            self._sending.discard(req_id)
        for req_id in output.finished_recving or ():
            self._recving.discard(req_id)

    def has_pending_push_work(self) -> bool:
        # Blocks kept for a send keep the engine stepping until the worker
        # reports the send settled; vLLM 0.32 steps for them anyway (a
        # finished request with blocks kept counts as finished work), earlier
        # versions only for this. The worker waits out idle steps instead
        # (KvconnMetadata.idle), so this costs no busy loop.
        return bool(self._sends or self._recvs or self._aborts or self._sending)
