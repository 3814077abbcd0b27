"""What the scheduler-side connector tells the worker-side one each step,
and what a worker tells the scheduler once at start-up (its rank address)."""

from __future__ import annotations

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)


@attrs.frozen
class Send:
    """Prefill: ``req_id`` finished; its KV lies in ``block_ids`` (in token
    order), to be written into whatever pages decode asks for as ``room``."""

    req_id: str
    room: int
    block_ids: tuple[int, ...]


@attrs.frozen
class Recv:
    """Decode: ``req_id``'s ``block_ids`` wait for ``room`` from ``prefill``."""

    req_id: str
    room: int
    prefill: tuple[str, ...]
    block_ids: tuple[int, ...]


@attrs.define
class KvconnMetadata(KVConnectorMetadata):  # type: ignore[misc]
    sends: list[Send] = attrs.Factory(list)
    recvs: list[Recv] = attrs.Factory(list)
    #: Decode requests the scheduler finished while their KV was on its way.
    aborts: list[str] = attrs.Factory(list)
    #: No request runs in this step (vLLM steps only to hear from the
    #: connector): the worker may wait for kvconn's next event before it
    #: answers, instead of the engine stepping again at once.
    idle: bool = False


@attrs.frozen
class KvconnHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """A worker's prefill rank address ("" when it runs no prefill rank)."""

    address: str
