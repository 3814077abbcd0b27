"""SGLang's KVManager / KVSender / KVReceiver on kvconn.

Thin by design: every protocol decision (when pages may be reused, what an
abort waits for) is kvconn's. This module maps SGLang's calls onto
:class:`kvconn.runtime.prefill.PrefillRank` / ``Sender`` (prefill) and
:class:`kvconn.runtime.decode.DecodeEndpoint` / ``Receiver`` (decode), and
kvconn's answers back onto SGLang's :class:`KVPoll` by name.

Decode: an aborted room's pages stay SGLang's "held" until kvconn's
``on_release`` fired for it (an ABORT_ACK of every prefill rank, a writer's
fence, or its proven exit); :meth:`KVConnKVManager.is_abort_release_safe`
says so, and :mod:`kvconn_sglang.plugin` stops SGLang from freeing a held
room at its own deadline.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
)

from kvconn.plugins import get_backend
from kvconn.protocol.hold import Release
from kvconn.protocol.ledger import KVPoll as KvconnPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.decode import Receiver as KvconnReceiver
from kvconn.runtime.prefill import PrefillRank
from kvconn_sglang.memory import engine_kv
from kvconn_sglang.poll import to_sglang
from kvconn_sglang.routing import RoutingError, directory
from kvconn_sglang.settings import Settings

log = logging.getLogger(__name__)

_CONCLUDED = (KvconnPoll.SUCCESS, KvconnPoll.FAILED)


class KVConnTransferError(RuntimeError):
    """A room's transfer failed; ``failure_reason`` says why (SGLang reads it)."""

    def __init__(self, room: int, reason: str, is_from_another_rank: bool = False) -> None:
        super().__init__(f"kvconn: room {room} failed: {reason}")
        self.room = room
        self.failure_reason = reason
        #: SGLang logs a failure that another rank already reported at debug level.
        self.is_from_another_rank = is_from_another_rank


def _attention_tp(server_args: Any, engine_rank: int) -> tuple[int, int]:
    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False):
        tp_size //= int(getattr(server_args, "dp_size", 1) or 1)
    return tp_size, engine_rank % tp_size


class KVConnKVManager(BaseKVManager):  # type: ignore[misc]
    """One SGLang scheduler rank's kvconn endpoint (prefill or decode)."""

    supports_deferred_decode_kv_release = True
    enable_deferred_decode_kv_release = True

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
        settings: Settings | None = None,
    ) -> None:
        if int(getattr(server_args, "pp_size", 1) or 1) > 1:
            raise NotImplementedError("kvconn_sglang: pipeline-parallel prefill/decode is not supported yet")
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.settings = settings or Settings.from_env()
        self.backend = get_backend(self.settings.transport)
        tp_size, tp_rank = _attention_tp(server_args, int(args.engine_rank))
        self.tp_rank = tp_rank
        self.engine_kv = engine_kv(args, tp_size, tp_rank, bool(is_mla_backend), self.settings.memory)
        self._lock = threading.Lock()
        #: Aborted rooms whose pages kvconn has not yet released (decode).
        self._held: set[int] = set()
        self._endpoints: dict[str, DecodeEndpoint] = {}
        self.rank: PrefillRank | None = None
        if _mode_name(disaggregation_mode) == "prefill":
            port = self.settings.port_base + tp_rank if self.settings.port_base else 0
            config = _with_port(self.settings, port)
            self.rank = PrefillRank(
                self.backend,
                tp_rank,
                config=config,
                buffers=self.engine_kv.buffers,
                layout=self.engine_kv.layout,
            )
            log.info("kvconn prefill rank %d listening at %s", tp_rank, self.rank.address)

    # -- SGLang's manager API -------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """Decode finds prefill ranks through kvconn_sglang.routing, not SGLang's registry."""

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """True once kvconn released the room (or this rank never held it).
        ``required_acks`` is SGLang's count of ABORT_ACKs; kvconn's release
        already needs every rank's proof, so it is not consulted."""
        with self._lock:
            return bootstrap_room not in self._held

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        with self._lock:
            self._held.discard(bootstrap_room)

    def teardown(self) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            endpoints, self._endpoints = list(self._endpoints.values()), {}
        for endpoint in endpoints:
            endpoint.close()
        if self.rank is not None:
            self.rank.close()

    # -- decode helpers -------------------------------------------------------
    def endpoint_for(self, bootstrap_addr: str) -> DecodeEndpoint:
        """The decode endpoint bootstrapped with the prefill at ``bootstrap_addr``."""
        with self._lock:
            found = self._endpoints.get(bootstrap_addr)
        if found is not None:
            return found
        addresses = directory().ranks_of(bootstrap_addr)
        endpoint = DecodeEndpoint(
            self.backend,
            prefill=addresses,
            config=_with_port(self.settings, 0),
            on_release=self._on_release,
            buffers=self.engine_kv.buffers,
            layout=self.engine_kv.layout,
        )
        with self._lock:
            raced = self._endpoints.setdefault(bootstrap_addr, endpoint)
        if raced is not endpoint:
            endpoint.close()
        return raced

    def _hold(self, room: int) -> None:
        with self._lock:
            self._held.add(room)

    def _on_release(self, release: Release) -> None:
        # kvconn's listener thread: only bookkeeping here; SGLang frees the
        # pages on its scheduler thread (resolve_deferred_releases).
        with self._lock:
            self._held.discard(release.room)
        log.debug("kvconn released room %d (%s)", release.room, release.proof)


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "value", mode))


def _with_port(settings: Settings, port: int) -> Any:
    import attrs

    return attrs.evolve(settings.config, port=port)


class KVConnKVSender(BaseKVSender):  # type: ignore[misc]
    """A request's transfer at one prefill rank."""

    def __init__(
        self,
        mgr: KVConnKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        if mgr.rank is None:
            raise TypeError("a KVConnKVSender needs a prefill-mode KVConnKVManager")
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self._sender = mgr.rank.sender(bootstrap_room)
        self._num_pages: int | None = None
        self._aux_slot: int | None = None
        self._pages_sent = 0
        self._failure: str | None = None
        #: Success or Failed once said: SGLang may poll a sender it cleared.
        self._concluded: int | None = None

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._num_pages = int(num_kv_indices)
        self._aux_slot = None if aux_index is None else int(aux_index)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # A last chunk with no page still has to conclude the room.
        return num_pages > 0 or last_chunk

    def send(
        self,
        kv_indices: Sequence[int],
        state_indices: Any = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        if self._failure is not None:
            return
        if self._num_pages is None:
            self._fail("send() before init()")
            return
        if state_indices is not None and len(state_indices) > 0:
            self._fail("state buffers (Mamba/SWA/DSA) are not carried by kvconn yet")
            return
        pages = [int(p) for p in kv_indices]
        self._pages_sent += len(pages)
        try:
            last = self._pages_sent >= self._num_pages
            self._sender.send(pages, last=last, extras_slot=self._aux_slot if last else None)
        except (RuntimeError, ValueError) as exc:
            self._fail(str(exc))

    def _fail(self, reason: str) -> None:
        self._failure = reason
        self._sender.fail(reason)

    def poll(self) -> int:
        if self._concluded is not None:
            return self._concluded
        status = self._sender.poll()
        # SGLang reuses the source pages once told Success or Failed: say so
        # only when no chunk of the room is still being read from them.
        if status in _CONCLUDED and not self._sender.settled():
            return int(KVPoll.Transferring)
        value = to_sglang(status, KVPoll)
        if status in _CONCLUDED:
            self._concluded = value
        return value

    def poll_pp_consensus(self) -> int:
        return self.poll()

    def failure_exception(self) -> None:
        raise KVConnTransferError(
            self.bootstrap_room,
            self._failure or "failed at the decode or another rank",
            is_from_another_rank=self._failure is None,
        )

    def abort(self) -> None:
        self._fail("aborted by prefill")

    def clear(self) -> None:
        self._sender.clear()

    def get_transfer_metric(self) -> Any:
        return KVTransferMetric()


class KVConnKVReceiver(BaseKVReceiver):  # type: ignore[misc]
    """A request's transfer at one decode rank."""

    def __init__(self, mgr: KVConnKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        #: SGLang's decode queue reads these.
        self.abort_notified = False
        self.require_staging = False
        #: One entry per prefill rank asked for the room (SGLang counts acks by it).
        self.bootstrap_infos: list[dict[str, int]] | None = None
        self._endpoint: DecodeEndpoint | None = None
        self._receiver: KvconnReceiver | None = None
        self._failure: str | None = None
        self._aborted = False
        self._finished = False
        self._cleared = False

    def init(self, prefill_dp_rank: int = 0) -> None:
        try:
            self._endpoint = self.kv_mgr.endpoint_for(self.bootstrap_addr)
        except (RoutingError, RuntimeError, OSError) as exc:
            self._failure = f"bootstrap with {self.bootstrap_addr} failed: {exc}"

    def send_metadata(
        self,
        kv_indices: Sequence[int],
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        if self._endpoint is None or self._failure is not None or self._aborted:
            return
        if state_indices is not None and len(state_indices) > 0:
            self._failure = "state buffers (Mamba/SWA/DSA) are not carried by kvconn yet"
            return
        if decode_prefix_len:
            self._failure = "a decode-side radix-cache prefix is not supported by kvconn yet"
            return
        try:
            pages = [int(p) for p in kv_indices]
            slot = None if aux_index is None or not self.kv_mgr.engine_kv.layout.extras else int(aux_index)
            self._receiver = self._endpoint.receiver(self.bootstrap_room, pages, extras_slot=slot)
        except ValueError as exc:
            self._failure = str(exc)
            return
        self.bootstrap_infos = [{"rank": r} for r in sorted(self._endpoint.ranks)]

    def poll(self) -> int:
        if self._failure is not None or self._aborted:
            return int(KVPoll.Failed)
        if self._finished:
            return int(KVPoll.Success)
        if self._cleared:
            return int(KVPoll.Failed)  # cleared before it concluded: it never will
        if self._endpoint is None:
            return int(KVPoll.Bootstrapping)
        if self._receiver is None:
            return int(KVPoll.WaitingForInput)
        status = self._receiver.poll()
        if status is KvconnPoll.SUCCESS and not self._finished:
            # The pages are decode's again: kvconn stops tracking the room.
            self._receiver.finish()
            self._finished = True
        return to_sglang(status, KVPoll)

    def failure_exception(self) -> None:
        reason = self._failure
        if reason is None and self._receiver is not None:
            reason = self._receiver.failure()
        raise KVConnTransferError(self.bootstrap_room, reason or "aborted")

    def abort(self) -> None:
        self._aborted = True
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Give the room up at kvconn, once. Its pages are then held until
        kvconn's ``on_release``; a room no prefill rank was asked to write
        holds nothing (``abort_notified`` stays False, SGLang frees at once)."""
        if self.abort_notified or self._receiver is None or self._finished:
            return
        self.abort_notified = True
        # Held before the abort: a release can fire inside abort() itself.
        self.kv_mgr._hold(self.bootstrap_room)
        if self._failure is None:
            self._failure = self._receiver.failure()
        self._receiver.abort()

    def clear(self) -> None:
        if self._receiver is not None and not self._finished and not self.abort_notified:
            # SGLang drops a room kvconn still has live: stop its writers now;
            # whatever SGLang does with the pages, kvconn can no longer guard them.
            log.warning("kvconn: room %d cleared before it concluded; aborting it", self.bootstrap_room)
            self.ensure_abort_notified()
        self._receiver = None
        self._cleared = True


__all__ = ["KVConnKVManager", "KVConnKVReceiver", "KVConnKVSender", "KVConnTransferError"]
