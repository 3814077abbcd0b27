"""The faults, each run on one connector's pair of engines, and what each
request and block went through.

Every fault is placed at the same point of a request's hand-off for every
connector, by the engines themselves (:meth:`Engine.arm`) or by signals
from here, never by a guess at how long a transfer takes:

* ``abort``: decode aborts the request (as a client leaving would) at the
  end of the engine step that started its KV load.
* ``prefill_frozen``: prefill stopped (SIGSTOP) while it keeps two finished
  requests' KV for decode; decode handed both, aborts one after 1 s; thawed
  past every lease and deadline (``freeze_s``).
* ``decode_frozen``: decode stops itself as the step that scheduled the
  request's KV load begins (its blocks allocated, its connector not yet
  acting); past prefill's lease a later request is prefilled (vLLM hands
  the most recently freed blocks out first), then decode is thawed.
* ``prefill_killed``: prefill stopped while it keeps the request's KV,
  decode handed it, prefill SIGKILLed once decode's load started.
* ``prefill_restarted``: a new prefill engine at the same address; decode
  handed a request the killed prefill had computed (its params name the
  dead engine), then new requests through the new prefill.
* ``decode_killed``: decode stops itself at the end of the step that
  started the load, then is SIGKILLed; prefill's blocks watched.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvconn_vllm.faults.engine import Engine, EngineError
from kvconn_vllm.faults.pairs import POLL_S, Pair, finished, prefill_only, wait_until

FAULTS = ("abort", "prefill_frozen", "decode_frozen", "prefill_killed", "prefill_restarted", "decode_killed")
#: How often the engines' blocks are sampled while a fault runs.
SAMPLE_S = 0.05
GOOD_FINISH = ("length", "stop")


def prompt(index: int, tokens: int) -> list[int]:
    """A prompt of ``tokens`` ids in 3..502 (0-2 are special), one per index."""
    return [(index * 37 + j * 11 + (j * j) % 7) % 500 + 3 for j in range(tokens)]


@attrs.define
class Request:
    """One request served through the pair during a fault."""

    req_id: str
    prompt_len: int
    reference: list[int]
    sent: list[str] | None = None
    client_abort: bool = False
    #: answered (the reference tokens), wrong (other tokens), failed (ended
    #: without its tokens, not by a client), aborted (by the client), hung
    #: (no end by the fault's bound), pending (still running).
    outcome: str = "pending"
    finish_reason: str | None = None
    #: Decode's blocks as its KV landed against prefill's as it kept them;
    #: None when decode received nothing (recomputed, aborted).
    received_match: bool | None = None
    #: Seconds from the client's abort to the request's last decode block
    #: back in vLLM's free pool; None while still held.
    release_s: float | None = None
    #: Seconds from the fault to prefill's blocks of this request freed.
    prefill_release_s: float | None = None


@attrs.define
class FaultResult:
    connector: str
    fault: str
    requests: list[Request] = attrs.field(factory=list)
    late_writes: dict[str, list[dict[str, Any]]] = attrs.field(factory=lambda: {"prefill": [], "decode": []})
    #: Blocks the fault's requests hold, per engine: the most seen, and at
    #: the end of the fault's window.
    pinned_max: dict[str, int] = attrs.field(factory=dict)
    pinned_end: dict[str, int] = attrs.field(factory=dict)
    #: (seconds since the fault started, blocks its requests hold) per engine.
    series: dict[str, list[tuple[float, int]]] = attrs.field(factory=lambda: {"prefill": [], "decode": []})
    proofs: dict[str, int] = attrs.field(factory=dict)
    #: Per engine: its pid and kvconn's proof counters when the fault began
    #: (or when it was first seen), so that ``proofs`` counts this fault's.
    proofs_at_start: dict[str, tuple[int, dict[str, int]]] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    seconds: float = 0.0

    @property
    def wrong(self) -> list[Request]:
        return [r for r in self.requests if r.outcome == "wrong" or r.received_match is False]

    @property
    def corrupted(self) -> int:
        """Requests whose KV or tokens were another's, plus late writes
        into free blocks."""
        return len(self.wrong) + sum(len(w) for w in self.late_writes.values())

    @property
    def hung(self) -> int:
        return sum(r.outcome == "hung" for r in self.requests)

    @property
    def failed(self) -> int:
        return sum(r.outcome == "failed" for r in self.requests)

    @property
    def release_times(self) -> list[float]:
        return [r.release_s for r in self.requests if r.release_s is not None]

    @property
    def never_released(self) -> int:
        return sum(r.client_abort and r.release_s is None for r in self.requests)


@attrs.define
class Settings:
    lease_s: float
    prompt_tokens: int = 100
    max_tokens: int = 8
    aborts: int = 3
    #: How long a request may take after the fault's last action before it
    #: counts as hung, and blocks still held then count as pinned.
    bound_s: float = 0.0
    freeze_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.bound_s = self.bound_s or 3 * self.lease_s + 15
        self.freeze_s = self.freeze_s or 2 * self.lease_s + 3


class FaultRun:
    """Runs the faults on one pair, in order, recording each."""

    def __init__(self, pair: Pair, reference: Callable[[list[int]], list[int]], settings: Settings) -> None:
        self.pair = pair
        self.reference = reference
        self.settings = settings
        self._n = 0
        self.stale: tuple[str, list[int], dict[str, Any], list[str] | None] | None = None

    # -- helpers -------------------------------------------------------------
    def _next(self, fault: str) -> tuple[str, list[int]]:
        self._n += 1
        # The n-th request of every connector's run gets the same prompt.
        index = 1000 + self._n
        return f"{fault}-{self._n}", prompt(index, self.settings.prompt_tokens)

    def _request(self, req_id: str, tokens: list[int], sent: list[str] | None) -> Request:
        return Request(req_id, len(tokens), self.reference(tokens), sent)

    def _begin(self, fault: str) -> tuple[FaultResult, dict[str, int], float]:
        result = FaultResult(self.pair.label, fault)
        base: dict[str, int] = {}
        for role, engine in self._engines():
            if engine.alive() and not engine.stopped():
                engine.watch(True)
                stats = engine.stats()
                base[role] = int(stats["used_blocks"])
                result.proofs_at_start[role] = (engine.pid, dict(stats["proofs"]))
        return result, base, time.monotonic()

    def _engines(self) -> list[tuple[str, Engine]]:
        return [("prefill", self.pair.prefill), ("decode", self.pair.decode)]

    def _sample(self, result: FaultResult, base: dict[str, int], t0: float) -> dict[str, dict[str, Any]]:
        """Each live, running engine's stats, recorded in ``result``."""
        seen: dict[str, dict[str, Any]] = {}
        for role, engine in self._engines():
            if role not in base or not engine.alive() or engine.stopped():
                continue
            try:
                stats = engine.call("stats", unless_stopped=True, timeout_s=30)
            except EngineError:
                continue
            if stats is None:
                continue
            seen[role] = stats
            # This fault's requests only: a block an earlier fault left
            # pinned is that fault's.
            held = stats["held_blocks"]
            used = sum(held.get(r.req_id, 0) for r in result.requests)
            result.series[role].append((round(time.monotonic() - t0, 3), used))
            result.pinned_max[role] = max(result.pinned_max.get(role, 0), used)
            result.pinned_end[role] = used
            result.late_writes[role] = list(stats["late_writes"])
            # kvconn's release proofs counted during this fault (the
            # engine's counters less their values at its start).
            pid, start = result.proofs_at_start.setdefault(role, (engine.pid, dict(stats["proofs"])))
            if pid != engine.pid:
                # An engine started during this fault (a restarted prefill):
                # its counters began at zero, all within the fault.
                start = {}
                result.proofs_at_start[role] = (engine.pid, start)
            for proof, count in stats["proofs"].items():
                if count - start.get(proof, 0):
                    result.proofs[f"{role}:{proof}"] = count - start.get(proof, 0)
        return seen

    def _hold(self, result: FaultResult, base: dict[str, int], t0: float, seconds: float) -> None:
        """Sample for ``seconds``."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._sample(result, base, t0)
            time.sleep(SAMPLE_S)

    def _observe(
        self, result: FaultResult, base: dict[str, int], t0: float, since: float, extra_s: float = 0.0
    ) -> None:
        """Until every request ended (and an aborted one's blocks are back),
        or ``bound_s + extra_s`` after ``since``; then what is left is hung
        or pinned."""
        deadline = since + self.settings.bound_s + extra_s
        while True:
            stats = self._sample(result, base, t0)
            decode = self.pair.decode
            if decode.alive() and not decode.stopped():
                with contextlib.suppress(EngineError):
                    decode.poll()
            self._settle(result, stats)
            pending = [
                r
                for r in result.requests
                if r.outcome == "pending" or (r.client_abort and r.release_s is None)
            ]
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(SAMPLE_S)
        for request in result.requests:
            if request.outcome == "pending":
                request.outcome = "hung"
        self._sample(result, base, t0)

    def _settle(self, result: FaultResult, stats: dict[str, dict[str, Any]]) -> None:
        """Each request's outcome from what the engines reported."""
        decode = stats.get("decode")
        for request in result.requests:
            event = self.pair.decode.events.get(request.req_id)
            if request.client_abort and event is not None:
                request.client_abort = False  # it ended before the abort could land
            if request.outcome == "pending" and event is not None:
                request.finish_reason = event["finish_reason"]
                if event["finish_reason"] not in GOOD_FINISH:
                    request.outcome = "failed"
                else:
                    request.outcome = "answered" if event["tokens"] == request.reference else "wrong"
                if "received" in event and request.sent is not None:
                    request.received_match = event["received"] == request.sent
            if decode is not None and request.client_abort:
                aborted = decode["aborted"].get(request.req_id)
                released = decode["released"].get(request.req_id)
                if aborted is not None and released is not None and request.release_s is None:
                    request.release_s = max(0.0, released - aborted)
                if aborted is not None and request.outcome == "pending":
                    request.outcome = "aborted"

    def _finish(self, result: FaultResult, t0: float) -> FaultResult:
        result.seconds = time.monotonic() - t0
        return result

    def _load_started(self, req_id: str, timeout_s: float = 30.0) -> bool:
        decode = self.pair.decode
        return wait_until(lambda: req_id in decode.stats()["load_started"], timeout_s, 0.01)

    # -- the faults ----------------------------------------------------------
    def run(self, fault: str) -> FaultResult:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        method: Callable[[], FaultResult] = getattr(self, fault)
        return method()

    def abort(self) -> FaultResult:
        result, base, t0 = self._begin("abort")
        for _ in range(self.settings.aborts):
            req_id, tokens = self._next("abort")
            sent = prefill_only(self.pair, req_id, tokens)
            request = self._request(req_id, tokens, sent.get("sent"))
            request.client_abort = True
            result.requests.append(request)
            self.pair.decode.arm(req_id, "after_load", "abort")
            self.pair.decode.add(req_id, tokens, self.settings.max_tokens, sent["kv_transfer_params"])
            self._observe(result, base, t0, time.monotonic())
        time.sleep(0.5)  # prefill's side settles too
        for request in result.requests:
            aborted = self.pair.decode.stats()["aborted"].get(request.req_id)
            if aborted is not None:
                self._prefill_released_one(request, aborted)
        return self._finish(result, t0)

    def _prefill_released_one(self, request: Request, since: float) -> None:
        engine = self.pair.prefill
        if engine.alive() and not engine.stopped():
            released = engine.stats()["released"].get(request.req_id)
            if released is not None:
                request.prefill_release_s = max(0.0, released - since)

    def prefill_frozen(self) -> FaultResult:
        result, base, t0 = self._begin("prefill_frozen")
        pair = self.pair
        kept = []
        for _ in range(2):
            req_id, tokens = self._next("pfrozen")
            sent = prefill_only(pair, req_id, tokens)
            kept.append((req_id, tokens, sent))
            result.requests.append(self._request(req_id, tokens, sent.get("sent")))
        pair.prefill.freeze()
        frozen_at = time.monotonic()
        try:
            for req_id, tokens, sent in kept:
                pair.decode.add(req_id, tokens, self.settings.max_tokens, sent["kv_transfer_params"])
            for req_id, _, _ in kept:
                if not self._load_started(req_id, 15):
                    result.notes.append(f"decode did not start loading {req_id}")
            self._hold(result, base, t0, 1.0)
            aborted = result.requests[1]
            aborted.client_abort = True
            pair.decode.abort(aborted.req_id)
            self._hold(result, base, t0, max(0.0, frozen_at + self.settings.freeze_s - time.monotonic()))
        finally:
            pair.prefill.thaw()
        thawed = time.monotonic()
        result.notes.append(f"prefill frozen {thawed - frozen_at:.1f} s")
        self._observe(result, base, t0, thawed)
        return self._finish(result, t0)

    def decode_frozen(self) -> FaultResult:
        result, base, t0 = self._begin("decode_frozen")
        pair = self.pair
        req_id, tokens = self._next("dfrozen")
        sent = prefill_only(pair, req_id, tokens)
        request = self._request(req_id, tokens, sent.get("sent"))
        result.requests.append(request)
        pair.decode.arm(req_id, "before_load", "freeze")
        pair.decode.add(req_id, tokens, self.settings.max_tokens, sent["kv_transfer_params"])
        if not wait_until(pair.decode.stopped, 30, 0.005):
            result.notes.append("decode never scheduled a KV load for the request (not frozen)")
            self._observe(result, base, t0, time.monotonic())
            return self._finish(result, t0)
        frozen_at = time.monotonic()
        try:
            # Past prefill's lease (its heartbeats stopped with decode), a
            # later request at prefill: vLLM hands out the most recently
            # freed blocks first, so it takes this request's if they were freed.
            self._hold(result, base, t0, self.settings.lease_s + 2)
            later_id, later_tokens = self._next("later")
            later = prefill_only(pair, later_id, later_tokens)
            self._prefill_released_one(request, frozen_at)
            result.notes.append(
                f"prefill's blocks of the request freed {request.prefill_release_s:.1f} s into the freeze"
                if request.prefill_release_s is not None
                else "prefill kept the request's blocks through the freeze"
            )
            if set(later.get("blocks", ())) & set(sent.get("blocks", ())):
                result.notes.append("a later request's KV now in those blocks at prefill")
            self._hold(result, base, t0, max(0.0, frozen_at + self.settings.freeze_s - time.monotonic()))
        finally:
            pair.decode.thaw()
        thawed = time.monotonic()
        self._observe(result, base, t0, thawed)
        return self._finish(result, t0)

    def prefill_killed(self) -> FaultResult:
        result, base, t0 = self._begin("prefill_killed")
        pair = self.pair
        req_id, tokens = self._next("pkilled")
        sent = prefill_only(pair, req_id, tokens)
        stale_id, stale_tokens = self._next("stale")
        stale = prefill_only(pair, stale_id, stale_tokens)
        self.stale = (stale_id, stale_tokens, stale["kv_transfer_params"], stale.get("sent"))
        result.requests.append(self._request(req_id, tokens, sent.get("sent")))
        pair.prefill.freeze()
        pair.decode.add(req_id, tokens, self.settings.max_tokens, sent["kv_transfer_params"])
        if not self._load_started(req_id, 15):
            result.notes.append("decode did not start loading the request")
        self._hold(result, base, t0, 0.3)
        pair.prefill.kill()
        killed = time.monotonic()
        base.pop("prefill", None)
        self._observe(result, base, t0, killed)
        return self._finish(result, t0)

    def prefill_restarted(self) -> FaultResult:
        result, base, t0 = self._begin("prefill_restarted")
        pair = self.pair
        if self.stale is None:  # run alone: a request, then the kill
            stale_id, stale_tokens = self._next("stale")
            stale = prefill_only(pair, stale_id, stale_tokens)
            self.stale = (stale_id, stale_tokens, stale["kv_transfer_params"], stale.get("sent"))
            pair.prefill.kill()
        stale_id, stale_tokens, params, stale_sent = self.stale
        try:
            up_s = pair.restart_prefill()
        except EngineError as exc:
            result.notes.append(f"the prefill engine did not restart at the same address: {exc}")
            return self._finish(result, t0)
        result.notes.append(f"new prefill up in {up_s:.0f} s")
        base["prefill"] = int(pair.prefill.stats()["used_blocks"])
        pair.prefill.watch(True)
        # The request the killed prefill computed: its params name the dead engine.
        result.requests.append(self._request(stale_id, stale_tokens, stale_sent))
        pair.decode.add(stale_id, stale_tokens, self.settings.max_tokens, params)
        self._observe(result, base, t0, time.monotonic())
        for _ in range(2):
            req_id, tokens = self._next("restarted")
            try:
                sent = prefill_only(pair, req_id, tokens, timeout_s=self.settings.bound_s)
            except EngineError as exc:
                result.notes.append(str(exc))
                continue
            result.requests.append(self._request(req_id, tokens, sent.get("sent")))
            pair.decode.add(req_id, tokens, self.settings.max_tokens, sent["kv_transfer_params"])
            self._observe(result, base, t0, time.monotonic())
        return self._finish(result, t0)

    def decode_killed(self) -> FaultResult:
        result, base, t0 = self._begin("decode_killed")
        pair = self.pair
        req_id, tokens = self._next("dkilled")
        sent = prefill_only(pair, req_id, tokens)
        request = self._request(req_id, tokens, sent.get("sent"))
        result.requests.append(request)
        pair.decode.arm(req_id, "after_load", "freeze")
        pair.decode.add(req_id, tokens, self.settings.max_tokens, sent["kv_transfer_params"])
        if not wait_until(pair.decode.stopped, 30, 0.005):
            result.notes.append("decode never started a KV load for the request")
        pair.decode.kill()
        killed = time.monotonic()
        base.pop("decode", None)
        result.pinned_end.pop("decode", None)
        request.outcome = "killed with decode"
        deadline = killed + self.settings.bound_s
        while time.monotonic() < deadline:
            self._sample(result, base, t0)
            released = pair.prefill.stats()["released"].get(req_id)
            if released is not None:
                request.prefill_release_s = max(0.0, released - killed)
                break
            time.sleep(SAMPLE_S)
        self._hold(result, base, t0, 1.0)
        if request.prefill_release_s is None:
            result.notes.append(
                f"prefill still held the request's blocks {self.settings.bound_s:.0f} s after"
            )
        return self._finish(result, t0)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


__all__ = ["FAULTS", "POLL_S", "FaultResult", "FaultRun", "Request", "Settings", "finished", "prompt"]
