"""Drain on a signal (SIGTERM from an orchestrator scaling down or rolling out).

kvconn never installs a signal handler by itself: an engine that wants its
prefill ranks or decode endpoints drained on SIGTERM calls
:func:`drain_on_signal` from its main thread. The handler only starts a
thread: the drain waits for rooms to finish, which needs the engine to keep
stepping, so blocking the thread the signal interrupted would stall them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Protocol

from kvconn.protocol.drain import DrainReport

log = logging.getLogger(__name__)

#: What ``signal.getsignal`` returns (None: a handler not installed from Python).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Drainable(Protocol):
    """A :class:`~kvconn.runtime.prefill.PrefillRank` or a
    :class:`~kvconn.runtime.decode.DecodeEndpoint`."""

    def drain(self, grace_s: float, timeout_s: float | None = None) -> DrainReport: ...


def _redeliver(signum: int) -> Callable[[list[DrainReport]], None]:
    def then(reports: list[DrainReport]) -> None:
        # The previous handler is back (the handler put it back: only the
        # main thread may): the process ends as it would have without us,
        # once nothing of it can land.
        os.kill(os.getpid(), signum)

    return then


def drain_on_signal(
    endpoints: Sequence[Drainable],
    grace_s: float,
    then: Callable[[list[DrainReport]], None] | None = None,
    signum: int = signal.SIGTERM,
) -> Callable[[], None]:
    """On ``signum``, drain every endpoint (in parallel, on a thread), then
    call ``then(reports)``; by default the signal is delivered again, to the
    handler that was there before, so the process exits as it would have,
    only once no write of it can land. The previous handler is put back as
    the drain starts: a second signal while draining (an operator who
    insists) does at once what the first would have done without kvconn.
    Returns a function that puts the previous handler back. Call it from the
    main thread (Python's rule for signal handlers)."""
    previous = signal.getsignal(signum)
    restore: Handler = signal.SIG_DFL if previous is None else previous
    after = then or _redeliver(signum)
    started = threading.Event()

    def run() -> None:
        reports: list[DrainReport] = [DrainReport(False, 0.0)] * len(endpoints)

        def one(i: int, endpoint: Drainable) -> None:
            try:
                reports[i] = endpoint.drain(grace_s)
            except Exception:
                log.exception("drain of %r raised", endpoint)

        threads = [threading.Thread(target=one, args=(i, e), daemon=True) for i, e in enumerate(endpoints)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for report in reports:
            level = logging.INFO if report.drained else logging.WARNING
            log.log(level, "kvconn drain: %s", report)
        after(reports)

    def handler(sig: int, frame: FrameType | None) -> None:
        if started.is_set():
            return
        started.set()
        signal.signal(signum, restore)
        threading.Thread(target=run, name="kvconn-drain", daemon=True).start()

    signal.signal(signum, handler)

    def uninstall() -> None:
        signal.signal(signum, restore)

    return uninstall


__all__ = ["Drainable", "drain_on_signal"]
