"""Faults between hosts (``kvconn bench --hosts N``), each met by kvconn's
mode and by the timeout-only mode, on a transport that crosses hosts.

Decode (:mod:`kvconn.testing.host_decode`) runs on host ``decode``; rank 0
(the victim) on ``prefill0``, rank 1 on ``prefill1``. The victim's room is
written one page a chunk with a gap between chunks, so it is mid-transfer
when the fault strikes; decode then aborts it.

* ``partition``: prefill0's link down, healed past decode's deadline;
* ``lost``: prefill0's link down, then every process on it killed (no FIN
  or RST reaches decode); rank 1 idle;
* ``frozen``: every process on prefill0 SIGSTOPped past every deadline,
  then continued;
* ``decode_restart``: decode's link down and its processes killed while
  both ranks write a room, then a fresh decode on the same host;
* ``lost_one_of_two``: as ``lost``, while rank 1 serves a stream of rooms.

Per fault and mode: pages a late write reached after decode handed them
back (canary changed), pages still held, the time from the abort until the
pages came back and the proof, and the other host's requests that failed
meanwhile (its stream of rooms on rank 1, each checked byte for byte).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.runtime.procs import wait_until_stopped
from kvconn.testing.child import Child
from kvconn.testing.hosts import Fabric, Host, processes_in
from kvconn.testing.waiting import wait_for
from kvconn.transport import capabilities_of

FAULTS = ("partition", "lost", "frozen", "decode_restart", "lost_one_of_two")
PAGES, PAGE_BYTES, STREAM_PAGES = 16, 16 << 10, 2
CHUNK_GAP_S = 0.15  #: the victim's gap between chunks: its room takes ~2.4 s to write
PAST_S = 1.0  #: a link is healed, a host continued, this long past decode's deadline
OWNER_FENCE_AFTER_S = 2.0  #: kvconn's mode: quarantined rooms this old are fenced by decode


@attrs.frozen
class HostOutcome:
    fault: str
    mode: str  #: "kvconn" or "legacy"
    pages: int = 0  #: pages of the aborted room(s)
    corrupted_pages: int = 0  #: written after decode handed them back
    held_pages: int = 0  #: still held (quarantined) when the fault's wait ended
    back_s: float | None = None  #: abort (or restart) until the pages were back
    proof: str = ""  #: what brought them back ("" while held)
    others_done: int = 0  #: the other host's rooms completed meanwhile
    others_failed: int = 0  #: ... and failed meanwhile
    others_wrong: int = 0  #: ... and completed with wrong bytes
    owner_fence: bool = False  #: decode ran with Config.owner_fence_after_s
    skipped: str = ""

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


def owner_fence_config(seconds: float, config: type[Any] = Config) -> dict[str, float]:
    """``Config.owner_fence_after_s``, where this kvconn has it ({} before)."""
    names = {a.name for a in attrs.fields(config)}
    return {"owner_fence_after_s": seconds} if "owner_fence_after_s" in names else {}


@attrs.frozen
class Deadlines:
    """The writers' deadline, and decode's: longer than the transport's own
    longest wait for a write (Mooncake's engine timeout), which kvconn requires."""

    write_s: float
    decode_s: float

    @classmethod
    def of(cls, backend: str, options: Mapping[str, str]) -> Deadlines:
        limit = capabilities_of(get_backend(backend), options).max_write_timeout_s
        decode = 1.5 if limit is None else limit + 1.0
        return cls(write_s=0.5, decode_s=decode)


class _Run:
    """One fault in one mode: a decode process and two rank processes."""

    def __init__(
        self, fabric: Fabric, backend: str, options: Mapping[str, str], legacy: bool, quiet: bool = True
    ) -> None:
        self.fabric, self.backend, self.legacy = fabric, backend, legacy
        #: the children's stderr (a transport library's log lines): one file
        #: for all, read back when a wait fails; ours unless quiet
        self.stderr: Any = tempfile.TemporaryFile("w+", errors="replace") if quiet else None  # noqa: SIM115 (closed in close)
        self.options = dict(options)
        self.dl = Deadlines.of(backend, self._options_on(fabric["decode"]))
        self.ranks: list[Child] = []
        self.decode: Child | None = None
        self.addresses: list[str] = []
        try:
            # The ranks and decode import their libraries at once (the seconds
            # a start takes); decode bootstraps once the ranks say where they are.
            for r, name in enumerate(("prefill0", "prefill1")):
                self.ranks.append(self._rank(r, fabric[name]))
            self.spawn_decode()
            self.addresses = [
                str(c.next_with("address", 60, f"rank {r} start")["address"])
                for r, c in enumerate(self.ranks)
            ]
            self.bootstrap_decode()
        except BaseException:
            self.close()
            raise

    def _options_on(self, host: Host) -> dict[str, str]:
        templates: Mapping[str, str] = getattr(get_backend(self.backend), "host_options", None) or {}
        return {**self.options, **{k: v.format(ip=host.ip, iface=host.iface) for k, v in templates.items()}}

    def _rank(self, r: int, host: Host) -> Child:
        args = {
            "backend": self.backend,
            "rank": r,
            "num_ranks": 2,
            "page_bytes": PAGE_BYTES,
            "chunk_pages": 1,
            "chunk_gap_s": CHUNK_GAP_S if r == 0 else 0.0,
            "source_pages": 512,
            "write_timeout_s": self.dl.write_s,
            "abort_timeout_s": self.dl.decode_s,
            "acks_enabled": not self.legacy,
            "backend_options": self._options_on(host),
            "host": host.ip,
        }
        return Child("kvconn.testing.faults", args, env=_ENV, host=host, stderr=self.stderr)

    def start_decode(self) -> None:
        self.spawn_decode()
        self.bootstrap_decode()

    def spawn_decode(self) -> None:
        """Decode's process, importing its transport until :meth:`bootstrap_decode`."""
        host = self.fabric["decode"]
        config: dict[str, Any] = {
            "write_timeout_s": self.dl.write_s,
            "abort_timeout_s": self.dl.decode_s,
            "resend_interval_s": 0.2,
            "bootstrap_timeout_s": 30.0,
            "host": host.ip,
            "backend_options": self._options_on(host),
            "unsafe_release_at_deadline": self.legacy,
            "acks_enabled": not self.legacy,
        }
        if not self.legacy:
            config.update(owner_fence_config(OWNER_FENCE_AFTER_S))
        args = {
            "backend": self.backend,
            "prefill": None,
            "num_pages": 4096,
            "page_bytes": PAGE_BYTES,
            "num_ranks": 2,
            "config": config,
        }
        self.decode = Child("kvconn.testing.host_decode", args, env=_ENV, host=host, stderr=self.stderr)

    def bootstrap_decode(self) -> None:
        self.dec.send_line(json.dumps({"op": "bootstrap", "prefill": self.addresses}))
        self.dec.expect(60, "decode start", event="ready")

    @property
    def dec(self) -> Child:
        assert self.decode is not None
        return self.decode

    def command(self, op: str, answer: str, **args: Any) -> dict[str, Any]:
        self.dec.send_line(json.dumps({"op": op, **args}))
        return self.dec.expect(45, f"decode: {op}", event=answer)

    def released(self, room: int) -> dict[str, Any] | None:
        return next(
            (e for e in self.dec.history() if e.get("event") == "released" and e["room"] == room), None
        )

    def stderr_tail(self, lines: int = 3) -> str:
        """The children's last lines on stderr ("" when they went to ours)."""
        if self.stderr is None:
            return ""
        self.stderr.seek(0)
        return " | ".join(line.strip() for line in self.stderr.read().splitlines()[-lines:])

    def close(self) -> None:
        """Kill every child: a fault's figures are taken, and a graceful exit
        (endpoints and transports closing) took seconds a fault."""
        for c in [*self.ranks, *([self.decode] if self.decode else [])]:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                c.kill()
            c.close()
        if self.stderr is not None:
            self.stderr.close()


_ENV = {"NIXL_LOG_LEVEL": "WARN", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "ERROR"}


def _signal_host(host: Host, sig: int) -> None:
    for pid in processes_in(host.netns):
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
    if sig == signal.SIGSTOP:
        for pid in processes_in(host.netns):
            with contextlib.suppress(Exception):
                wait_until_stopped(pid, timeout=10)


def _until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def measure(run: _Run, fault: str) -> HostOutcome:
    mode = "legacy" if run.legacy else "kvconn"
    victim = run.fabric["prefill0"]
    stream = fault in ("partition", "frozen", "lost_one_of_two")
    if stream:
        run.dec.send_line(json.dumps({"op": "stream", "rank": 1, "pages": STREAM_PAGES}))
    room = 1
    ranks = None if fault == "decode_restart" else [0]
    run.command("open", "opened", room=room, pages=PAGES, ranks=ranks)
    wait_for(lambda: run.command("landed", "landed", room=room)["bytes"] > 0, 30, "the room's first bytes")
    if fault == "decode_restart":
        return _decode_restart(run, mode)
    if fault == "frozen":
        _signal_host(victim, signal.SIGSTOP)
    elif fault == "partition":
        victim.cut()
    else:
        victim.lose()
    t0 = float(run.command("abort", "aborted", room=room)["t"])
    deadline = run.dl.decode_s
    _until(t0 + deadline + PAST_S)
    if fault == "frozen":
        _signal_host(victim, signal.SIGCONT)
    elif fault == "partition":
        victim.heal()
    # Wait (bounded) for the pages: by proof in kvconn's mode, at the deadline
    # in the timeout-only one; a lost host's pages only by the owner fence.
    wait = deadline + OWNER_FENCE_AFTER_S + 6.0
    with contextlib.suppress(AssertionError):
        wait_for(lambda: run.released(room) is not None, wait, f"release of room {room}")
    time.sleep(2 * run.dl.write_s + 1.0)  # late bytes of a healed or continued writer land now, or never
    late = run.command("late", "late")
    others = run.command("stream_stop", "streamed") if stream else {}
    rel = run.released(room)
    return HostOutcome(
        fault,
        mode,
        PAGES,
        corrupted_pages=len(late["pages"]),
        held_pages=int(late["held"]),
        back_s=None if rel is None else float(rel["t"]) - t0,
        proof="" if rel is None else str(rel["proof"]),
        others_done=int(others.get("done", 0)),
        others_failed=int(others.get("failed", 0)),
        others_wrong=int(others.get("wrong", 0)),
        owner_fence=bool(owner_fence_config(1.0)) and not run.legacy,
    )


def _decode_restart(run: _Run, mode: str) -> HostOutcome:
    """Decode's host goes down mid-room (link first, then its processes) and
    comes back with a fresh decode: back once a new room on every rank
    completes; its pages are checked for late writes of the old room."""
    host = run.fabric["decode"]
    host.lose()
    run.dec.close()
    host.heal()
    t0 = time.monotonic()
    run.start_decode()
    fetched = run.command("fetch", "fetched", room=2, pages=PAGES, timeout_s=25.0)
    back = time.monotonic() - t0
    ok = fetched["state"] == "success" and not fetched["wrong"]
    time.sleep(2 * run.dl.write_s + 1.0)
    late = run.command("late", "late")
    return HostOutcome(
        "decode_restart",
        mode,
        PAGES,
        corrupted_pages=len(late["pages"]),
        held_pages=int(late["held"]),
        back_s=back if ok else None,
        proof="fresh decode: a new room completed" if ok else f"fresh decode: a new room {fetched['state']}",
        others_failed=0 if ok else 1,
        owner_fence=bool(owner_fence_config(1.0)) and not run.legacy,
    )


def run_all(
    fabric: Fabric,
    backend: str,
    options: Mapping[str, str],
    faults: tuple[str, ...] = FAULTS,
    on_step: Callable[[str], None] = print,
    quiet: bool = True,
    modes: tuple[str, ...] = ("kvconn", "legacy"),
) -> list[HostOutcome]:
    """Every fault in each of ``modes``, one after the other (few cores: no
    overlap); ``quiet``: the children's stderr dropped."""
    out = []
    for fault in faults:
        for legacy in [m == "legacy" for m in modes]:
            on_step(f"{backend}: {fault} ({'timeout-only' if legacy else 'kvconn'})")
            with _fresh(fabric, backend, options, legacy, quiet) as run:
                try:
                    out.append(measure(run, fault))
                except AssertionError as exc:  # a bounded wait ran out: say what the children said
                    tail = run.stderr_tail()
                    raise AssertionError(
                        f"{fault}: {exc}" + (f"; children's stderr: {tail}" if tail else "")
                    ) from None
    return out


@contextlib.contextmanager
def _fresh(
    fabric: Fabric, backend: str, options: Mapping[str, str], legacy: bool, quiet: bool
) -> Iterator[_Run]:
    for host in fabric.hosts.values():
        host.heal()
    run = _Run(fabric, backend, options, legacy, quiet)
    try:
        yield run
    finally:
        run.close()
