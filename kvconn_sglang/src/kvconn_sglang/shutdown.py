"""kvconn's drain on SGLang's own stop of a server.

How SGLang 0.5.23 stops a server (SIGTERM to its main process, ``kill PID``):
the tokenizer manager waits until no request is in flight, sends every
scheduler a ``ShutdownReq``, and SIGKILLs the schedulers still alive
:data:`SGLANG_SCHEDULER_EXIT_S` later. A scheduler gets no signal; its
handler, ``Scheduler.handle_shutdown``, only sets ``gracefully_exit``, which
ends its event loop at the next pass, and nothing calls the disaggregation
KV manager (its ``teardown`` is the P/D role switch's).

The plugin wraps that handler (SGLang's HookRegistry, AROUND;
:func:`around_handle_shutdown`): where the scheduler's KV manager is
kvconn's, the handler starts kvconn's drain on a thread and returns, so the
event loop keeps stepping meanwhile (a room in flight sends its chunks and
SGLang sees it conclude); once the drain returned, SGLang's own handler runs
and the loop ends as before. The drain is bounded to end before SGLang's
SIGKILL (:func:`budget`); a drain cut short by it is still safe for decode
(the writer's exit proof on one host, the owner fence across hosts).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvconn_sglang.settings import Settings

if TYPE_CHECKING:  # kvconn's runtime (prometheus_client with it) is imported where a manager is built
    from kvconn.runtime.decode import DrainReport

log = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_shutdown"
#: SGLang 0.5.23 SIGKILLs a scheduler this long after its ShutdownReq
#: (``tokenizer_manager._SCHEDULER_EXIT_TIMEOUT_SECS``; a test checks the
#: installed SGLang's value).
SGLANG_SCHEDULER_EXIT_S = 15.0
#: Left of that for the event loop to end and the process to exit.
EXIT_MARGIN_S = 3.0
#: Where SGLang's scheduler keeps its KV manager, per role (as its P/D role
#: switch finds it): prefill's bootstrap queue, decode's prealloc queue.
_QUEUES = ("disagg_prefill_bootstrap_queue", "disagg_decode_prealloc_queue")

_lock = threading.Lock()
#: Managers whose shutdown drain started (SGLang may repeat a ShutdownReq).
_draining: weakref.WeakSet[Any] = weakref.WeakSet()


def budget(settings: Settings) -> tuple[float, float]:
    """(grace, limit) of a drain at SGLang's shutdown: the limit ends it
    :data:`EXIT_MARGIN_S` before SGLang's SIGKILL; the grace (at most
    ``KVCONN_SGLANG_DRAIN_GRACE_S``) leaves the writes in flight when it
    ends their write deadline plus 1 s to settle before that limit."""
    limit = SGLANG_SCHEDULER_EXIT_S - EXIT_MARGIN_S
    settle = settings.config.write_timeout_s + 1.0
    return min(settings.drain_grace_s, max(0.0, limit - settle)), limit


def kvconn_manager(scheduler: Any) -> Any:
    """The scheduler's KV manager if it is kvconn's, else None."""
    from kvconn_sglang.conn import KVConnKVManager

    for name in _QUEUES:
        manager = getattr(getattr(scheduler, name, None), "kv_manager", None)
        if isinstance(manager, KVConnKVManager):
            return manager
    return None


def around_handle_shutdown(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ShutdownReq handler: kvconn's drain first, on a thread,
    then SGLang's handler (which ends the event loop)."""
    manager = kvconn_manager(scheduler)
    if manager is None:
        return original(scheduler, *args, **kwargs)
    with _lock:
        if manager in _draining:
            return None  # a second ShutdownReq: the first one's drain ends the loop
        _draining.add(manager)

    def drain_then_stop() -> None:
        try:
            drain_for_shutdown(manager)
        finally:
            original(scheduler, *args, **kwargs)

    threading.Thread(target=drain_then_stop, name="kvconn-shutdown-drain", daemon=True).start()
    return None


def drain_for_shutdown(manager: Any) -> DrainReport | None:
    """Drain ``manager`` within :func:`budget`; its report (None if it raised)."""
    grace, limit = budget(manager.settings)
    try:
        report: DrainReport = manager.drain(grace, timeout_s=limit)
    except Exception:
        log.exception("kvconn drain at SGLang's shutdown raised")
        return None
    (log.info if report.drained else log.warning)(
        "kvconn drain at SGLang's shutdown (grace %.1f s): %s", grace, report
    )
    return report


__all__ = ["SGLANG_SCHEDULER_EXIT_S", "TARGET", "around_handle_shutdown", "budget", "kvconn_manager"]
