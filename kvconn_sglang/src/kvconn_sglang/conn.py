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

import kvconn
from kvconn.errors import BootstrapError, KvconnError
from kvconn.plugins import get_backend
from kvconn.runtime.decode import DecodeEndpoint, DrainReport, Release
from kvconn.runtime.decode import Receiver as KvconnReceiver
from kvconn.runtime.drain_signal import drain_on_signal
from kvconn.runtime.prefill import KVPoll as KvconnPoll
from kvconn.runtime.prefill import PrefillRank
from kvconn.runtime.prefill import Sender as KvconnSender
from kvconn.runtime.trace_export import trace_to_file
from kvconn_sglang import __version__
from kvconn_sglang.memory import engine_kv
from kvconn_sglang.metrics import Relay, multiprocess_mode
from kvconn_sglang.poll import to_sglang
from kvconn_sglang.routing import RoutingError, rank_addresses, register, server_info
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


def _kv_heads_per_rank(args: Any, server_args: Any, tp_size: int) -> int:
    """The KV heads this rank's pool holds. SGLang 0.5.23's prefill sets
    ``kv_args.kv_head_num``; its decode sets it only with heterogeneous-TP
    staging on, and after building the manager: read the model's then."""
    heads = getattr(args, "kv_head_num", None)
    if heads:
        return int(heads)
    from sglang.srt.configs.model_config import ModelConfig

    total = int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())
    # More ranks than heads: SGLang replicates a head on several ranks.
    return max(1, total // tp_size)


def _attention_tp(server_args: Any, engine_rank: int) -> tuple[int, int]:
    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False):
        tp_size //= int(getattr(server_args, "dp_size", 1) or 1)
    return tp_size, engine_rank % tp_size


_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


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
        #: kvconn's scrape-time figures into SGLang's /metrics (kvconn_sglang.metrics).
        self.metrics_relay: Relay | None = None
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.settings = settings or Settings.from_env()
        log.info("kvconn-sglang %s (kvconn-core %s)", __version__, kvconn.__version__)
        if self.settings.config.tracing and self.settings.trace_file:
            trace_to_file(self.settings.trace_file)
        self.backend = get_backend(self.settings.transport)
        tp_size, tp_rank = _attention_tp(server_args, int(args.engine_rank))
        self.tp_size, self.tp_rank = tp_size, tp_rank
        heads = None if is_mla_backend else _kv_heads_per_rank(args, server_args, tp_size)
        self.engine_kv = engine_kv(args, tp_size, tp_rank, bool(is_mla_backend), self.settings.memory, heads)
        self._lock = threading.Lock()
        #: Aborted rooms whose pages kvconn has not yet released (decode).
        self._held: set[int] = set()
        self.rank: PrefillRank | None = None
        self.endpoint: DecodeEndpoint | None = None
        #: SGLang's decode queue reads the prefill instances' topology here
        #: (by bootstrap address), filled by try_ensure_parallel_info.
        self.prefill_info_table: dict[str, Any] = {}
        #: (bootstrap address, DP group) -> that group's kvconn rank addresses.
        self._prefill_ranks: dict[tuple[str, int], tuple[str, ...]] = {}
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
            try:
                self.register_to_bootstrap()
            except BaseException:
                self.rank.close()
                raise
        else:
            # One endpoint serves every prefill instance: each request names its own.
            self.endpoint = DecodeEndpoint(
                self.backend,
                config=_with_port(self.settings, 0),
                on_release=self._on_release,
                buffers=self.engine_kv.buffers,
                layout=self.engine_kv.layout,
            )
        if self.settings.drain_on_sigterm and threading.current_thread() is threading.main_thread():
            # The operator asked: SIGTERM drains first, then ends the process as before.
            drain_on_signal([self], self.settings.drain_grace_s)
        if getattr(server_args, "enable_metrics", False) and multiprocess_mode():
            self.metrics_relay = Relay(self.metrics_endpoints)

    def metrics_endpoints(self) -> list[tuple[str, Any]]:
        """This rank's endpoint's metrics, by its ``kvconn_endpoint`` name."""
        if self.rank is not None:
            return [(f"prefill-{self.tp_rank}", self.rank.metrics)]
        assert self.endpoint is not None
        return [(f"decode-{self.tp_rank}", self.endpoint.metrics)]

    # -- SGLang's manager API -------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """Tell SGLang's bootstrap server where this prefill rank's kvconn
        listener is, as SGLang's own backends tell it theirs."""
        assert self.rank is not None
        from sglang.srt.utils.network import NetworkAddress

        args, kv = self.server_args, self.kv_args
        dist_init_addr = getattr(args, "dist_init_addr", None)
        if dist_init_addr:  # multi-node: the bootstrap server is with the first node
            host = NetworkAddress.parse(dist_init_addr).resolved().host
        else:
            host = str(getattr(args, "host", "") or "")
        host = _WILDCARDS.get(host, host)
        port = int(getattr(args, "disaggregation_bootstrap_port", 8998))
        rank_host, _, rank_port = self.rank.address.removeprefix("tcp://").rpartition(":")
        if rank_host in _WILDCARDS:
            from sglang.srt.utils.network import get_local_ip_auto

            rank_host = get_local_ip_auto()
        dp_size = int(getattr(args, "dp_size", 1) or 1)
        attn_dp = dp_size if getattr(args, "enable_dp_attention", False) else 1
        payload = {
            "attn_tp_size": self.tp_size,
            "attn_tp_rank": self.tp_rank,
            "attn_cp_size": 1,
            "attn_cp_rank": 0,
            "attn_dp_size": attn_dp,
            "attn_dp_rank": int(kv.engine_rank) // self.tp_size if attn_dp > 1 else 0,
            "pp_size": 1,
            "pp_rank": 0,
            "system_dp_size": dp_size,
            "system_dp_rank": int(getattr(kv, "system_dp_rank", 0) or 0),
            "rank_ip": rank_host,
            "rank_port": int(rank_port),
            "page_size": int(kv.page_size),
            "kv_cache_dtype": getattr(kv, "kv_cache_dtype_str", None),
            "load_balance_method": getattr(args, "load_balance_method", "follow_bootstrap_room"),
        }
        register(NetworkAddress(host, port).to_url() + "/route", payload)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode queue asks this before it makes receivers for a
        prefill instance: fetch its topology from its bootstrap server once."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        try:
            raw = server_info(bootstrap_addr)
            info = PrefillServerInfo(**raw)
        except (RoutingError, TypeError, ValueError) as exc:
            log.warning("kvconn: no prefill topology from %s yet: %s", bootstrap_addr, exc)
            return False
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def prefill_ranks(self, bootstrap_addr: str, dp_rank: int) -> tuple[str, ...]:
        """The kvconn addresses of the ranks a request names (its prefill
        instance, by bootstrap address, and DP group), from the bootstrap server."""
        key = (bootstrap_addr, dp_rank)
        with self._lock:
            found = self._prefill_ranks.get(key)
        if found is not None:
            # A restarted instance may listen elsewhere: kvconn says when the
            # ranks it knows there cannot serve (down, or their link lost),
            # and they are read again before a request is asked of them.
            stale = self.endpoint.unavailable(found) if self.endpoint is not None else []
            if not stale:
                return found
            log.info("kvconn: reading prefill %s's ranks again: %s", bootstrap_addr, "; ".join(stale))
            self.forget_prefill(bootstrap_addr, dp_rank)
        if not self.try_ensure_parallel_info(bootstrap_addr):
            raise RoutingError(f"no prefill topology from bootstrap server {bootstrap_addr}")
        info = self.prefill_info_table[bootstrap_addr]
        if info.attn_cp_size != 1 or info.pp_size != 1:
            raise RoutingError(
                f"prefill {bootstrap_addr} runs context or pipeline parallelism "
                f"(cp {info.attn_cp_size}, pp {info.pp_size}), which kvconn_sglang does not serve yet"
            )
        addresses = rank_addresses(bootstrap_addr, info.attn_tp_size, dp_rank)
        with self._lock:
            self._prefill_ranks[key] = addresses
        return addresses

    def forget_prefill(self, bootstrap_addr: str, dp_rank: int) -> None:
        """Its ranks did not answer: read them from the bootstrap server again
        for the next request (the instance may have restarted elsewhere)."""
        with self._lock:
            self._prefill_ranks.pop((bootstrap_addr, dp_rank), None)
        self.prefill_info_table.pop(bootstrap_addr, None)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """True once kvconn released the room (or this rank never held it).
        ``required_acks`` is SGLang's count of ABORT_ACKs; kvconn's release
        already needs every rank's proof, so it is not consulted."""
        with self._lock:
            return bootstrap_room not in self._held

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        with self._lock:
            self._held.discard(bootstrap_room)

    def drain(self, grace_s: float | None = None, timeout_s: float | None = None) -> DrainReport:
        """Take this scheduler rank out of service (kvconn's drain): a
        prefill rank refuses new rooms and gives those it holds ``grace_s``
        (default ``drain_grace_s``) to complete, and returns once no write
        of it can land; a decode endpoint takes no new room, aborts the rooms
        left and waits up to ``grace_s`` for their proofs."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        if self.rank is not None:
            report = self.rank.drain(grace, timeout_s)
        else:
            assert self.endpoint is not None
            report = self.endpoint.drain(0.0, grace if timeout_s is None else timeout_s)
        (log.info if report.drained else log.warning)("kvconn drain: %s", report)
        return report

    def teardown(self) -> None:
        """SGLang's role switch: drain, then close."""
        try:
            self.drain()
        finally:
            self.close()

    def close(self) -> None:
        if self.metrics_relay is not None:
            self.metrics_relay.close()
        if self.endpoint is not None:
            self.endpoint.close()
        if self.rank is not None:
            self.rank.close()

    # -- decode helpers -------------------------------------------------------
    def hold(self, room: int) -> None:
        """``room``'s pages are SGLang's "held" until kvconn releases them
        (a receiver calls it before its abort: a release can fire inside it)."""
        with self._lock:
            self._held.add(room)

    def _on_release(self, release: Release) -> None:
        # kvconn's listener thread: only bookkeeping here; SGLang frees the
        # pages on its scheduler thread (resolve_deferred_releases).
        with self._lock:
            self._held.discard(release.room)
        if self.metrics_relay is not None:
            self.metrics_relay.poke()  # the held pages on /metrics now, not up to a second later
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
        self._rank = mgr.rank
        #: Made once decode's first request for the room is here: only it
        #: tells how many decode ranks will ask (see _bound).
        self._sender: KvconnSender | None = None
        self._num_pages: int | None = None
        self._aux_slot: int | None = None
        self._pages_sent = 0
        self._failure: str | None = None
        #: Success or Failed once said: SGLang may poll a sender it cleared.
        self._concluded: int | None = None
        self._failed_everywhere = False

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
        sender = self._bound()
        if sender is None:
            self._fail("send() before decode asked for the room")
            return
        pages = [int(p) for p in kv_indices]
        self._pages_sent += len(pages)
        try:
            last = self._pages_sent >= self._num_pages
            sender.send(pages, last=last, extras_slot=self._aux_slot if last else None)
        except KvconnError as exc:
            self._fail(str(exc))

    def _bound(self) -> KvconnSender | None:
        """kvconn's sender for the room, once a decode asked for it here.

        Every SGLang decode rank asks every prefill rank of the request's
        instance (see KVConnKVReceiver), so with decode TP above prefill TP
        this rank gets one request per decode rank: as many as the TP of the
        decode that asked first. kvconn's fan-out sender waits for all of
        them before SGLang may send, and writes each chunk to each."""
        if self._sender is None:
            decode_tp = self._rank.requesting_tp(self.bootstrap_room)
            if decode_tp is not None:
                self._sender = self._rank.sender(self.bootstrap_room, decodes=decode_tp)
        return self._sender

    def _fail(self, reason: str) -> None:
        self._failure = reason
        sender = self._bound()
        if sender is None:
            # No decode asked yet, so how many will is unknown: the rank
            # fails every request of the room, here now or still to come.
            self._rank.fail_room(self.bootstrap_room, reason)
        else:
            sender.fail(reason)

    def poll(self) -> int:
        if self._concluded is not None:
            return self._concluded
        if self._sender is None and self._failure is not None:
            # Failed before any decode asked: nothing was or will be written.
            self._concluded = int(KVPoll.Failed)
            return self._concluded
        sender = self._bound()
        if sender is None:
            if self._rank.draining:
                # A draining rank takes no decode's request now: nothing will be written.
                self._failure = "the prefill rank is draining"
                self._concluded = int(KVPoll.Failed)
                return self._concluded
            return int(KVPoll.Bootstrapping)
        status = sender.poll()
        if status is KvconnPoll.FAILED and sender.decodes > 1 and not self._failed_everywhere:
            # SGLang fails the request as a whole (its decode ranks take the
            # minimum poll): the other decode ranks are told now, rather than
            # written the rest of a request no one will decode.
            self._failed_everywhere = True
            sender.fail("failed at another decode rank of the request")
        verdict = sender.verdict() if status in _CONCLUDED else None
        if verdict is None:
            return to_sglang(status, KVPoll)
        # SGLang reuses the source pages once told Success or Failed: kvconn's
        # verdict says so only once every decode's chunks are settled.
        if not verdict.settled:
            return int(KVPoll.Transferring)
        self._concluded = to_sglang(verdict.status, KVPoll)
        return self._concluded

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
        sender = self._sender if self._failure is not None else self._bound()
        if sender is None:
            # SGLang gave the request up before decode asked: a request
            # arriving later must be told Failed, not wait for chunks.
            self._fail(self._failure or "cleared by prefill before decode asked for the room")
        else:
            sender.clear()

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
        self._prefill_dp_rank = 0
        #: The request's prefill instance: its kvconn rank addresses.
        self._prefill: tuple[str, ...] | None = None
        self._receiver: KvconnReceiver | None = None
        self._failure: str | None = None
        self._aborted = False
        self._finished = False
        self._cleared = False
        self._forgot = False

    def init(self, prefill_dp_rank: int = 0) -> None:
        self._prefill_dp_rank = int(prefill_dp_rank or 0)
        try:
            self._prefill = self.kv_mgr.prefill_ranks(self.bootstrap_addr, self._prefill_dp_rank)
        except RoutingError as exc:
            self._failure = str(exc)

    def send_metadata(
        self,
        kv_indices: Sequence[int],
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        endpoint = self.kv_mgr.endpoint
        if endpoint is None or self._prefill is None or self._failure is not None or self._aborted:
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
            self._receiver = endpoint.receiver(
                self.bootstrap_room, pages, extras_slot=slot, prefill=self._prefill
            )
        except BootstrapError as exc:
            self.kv_mgr.forget_prefill(self.bootstrap_addr, self._prefill_dp_rank)
            self._failure = f"bootstrap with prefill {self.bootstrap_addr} failed: {exc}"
            return
        except (KvconnError, ValueError) as exc:  # ValueError: an index that is no int
            self._failure = str(exc)
            return
        self.bootstrap_infos = [{"rank": r} for r in range(len(self._prefill))]

    def poll(self) -> int:
        status = self._status()
        if status == int(KVPoll.Failed) and not self._forgot:
            # Its ranks may be gone or draining (a restarted instance
            # registers new addresses at the same bootstrap server): the next
            # request for this instance reads them there again, instead of
            # failing on the old ranks for good.
            self._forgot = True
            self.kv_mgr.forget_prefill(self.bootstrap_addr, self._prefill_dp_rank)
        return status

    def _status(self) -> int:
        if self._failure is not None or self._aborted:
            return int(KVPoll.Failed)
        if self._finished:
            return int(KVPoll.Success)
        if self._cleared:
            return int(KVPoll.Failed)  # cleared before it concluded: it never will
        if self._prefill is None:
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
        self.kv_mgr.hold(self.bootstrap_room)
        if self._failure is None:
            self._failure = self._receiver.failure()
        self._receiver.abort()
        if self._receiver.state() is None:
            # Released already: kvconn had the proof before SGLang gave the
            # room up (its rank drained, or exited), and no later release comes.
            self.kv_mgr.clear_deferred_abort_state(self.bootstrap_room)

    def clear(self) -> None:
        if self._receiver is not None and not self._finished and not self.abort_notified:
            # SGLang drops a room kvconn still has live: stop its writers now;
            # whatever SGLang does with the pages, kvconn can no longer guard them.
            log.warning("kvconn: room %d cleared before it concluded; aborting it", self.bootstrap_room)
            self.ensure_abort_notified()
        self._receiver = None
        self._cleared = True


__all__ = ["KVConnKVManager", "KVConnKVReceiver", "KVConnKVSender", "KVConnTransferError"]
