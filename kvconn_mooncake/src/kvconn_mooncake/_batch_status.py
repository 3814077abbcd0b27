"""A non-blocking status check for a many-task Mooncake batch, through the C++ engine.

The Python binding of Mooncake TE 0.3.13 has no non-blocking status call for a
batch of several tasks: ``transfer_check_status`` reads task 0 only and
``get_batch_transfer_status`` busy-waits (no deadline; it frees the batches it
saw complete and leaves a failed one half-freed). The C++ engine has one:
``mooncake::TransferEngine::getBatchTransferStatus(batch_id, TransferStatus&)``
polls every task once and returns (measured from the 0.3.13.post1 ``engine.so``
disassembly, ``MultiTransport::getBatchTransferStatus``):

* COMPLETED (4) when every task completed (then it marks the batch finished);
  FAILED (6) at the first task that failed or timed out (the tasks after it
  are not looked at and may still be in flight); WAITING (0) otherwise.
  The returned ``Status`` is always OK in 0.3.13. It frees nothing.
* ``freeBatchID`` frees the batch only when every task was seen finished;
  otherwise it answers BatchBusy (code 4) and frees nothing.

This module calls both through ``ctypes`` on the engine object that the
binding's ``get_engine_ptr()`` returns. It is a C++ ABI hack, so it is
guarded: x86-64 Linux, the ``mooncake`` wheel 0.3.13.x, the mangled symbols
present, their first instructions those of the known build (``Status`` is
returned through a hidden pointer in ``rdi``, ``this`` in ``rsi``), and per
engine a self-test (``getRpcPort`` through the pointer equals the binding's,
and an empty batch is allocated, reads COMPLETED with 0 bytes and frees). Any
miss: :func:`bind` returns ``None`` and the caller keeps the one-task-batch
path.

Rules for the caller (the writer's lock serialises every call): poll a batch
id only while its engine lives; after :meth:`BatchPoller.poll` said done or
failed, never pass that id again (done: freed; failed: deliberately leaked,
since tasks of it may still be in flight and freeing could free memory the
transport threads still use).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import platform
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["DONE", "FAILED", "PENDING", "BatchPoller", "api_problem", "bind"]

#: :meth:`BatchPoller.poll` results.
DONE, PENDING, FAILED = 1, 0, -1

# mooncake::Transport::TransferStatusEnum
_WAITING, _PENDING, _COMPLETED = 0, 1, 4

_DISTS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
_VERSION_PREFIX = "0.3.13"

_SYM_BATCH_STATUS = "_ZN8mooncake14TransferEngine22getBatchTransferStatusEmRNS_9Transport14TransferStatusE"
_SYM_FREE = "_ZN8mooncake14TransferEngine11freeBatchIDEm"
_SYM_ALLOC = "_ZN8mooncake14TransferEngine15allocateBatchIDEm"
_SYM_RPC_PORT = "_ZN8mooncake14TransferEngine10getRpcPortEv"
_SYM_DELETE_ARRAY = "_ZdaPv"  # operator delete[](void*): frees a Status message

#: The first bytes of the two Status-returning wrappers in 0.3.13.post1:
#: ``push %rbx; mov (%rsi),%rsi|%rax; mov %rdi,%rbx``: the hidden return
#: pointer in rdi, ``this`` in rsi (its impl_ loaded from offset 0).
_PROLOGUES = {
    _SYM_BATCH_STATUS: bytes.fromhex("53488b364889fb"),
    _SYM_FREE: bytes.fromhex("53488b064889fb"),
}

_U64_MAX = 2**64 - 1


class _TransferStatus(ctypes.Structure):
    """mooncake::Transport::TransferStatus {TransferStatusEnum s; size_t transferred_bytes;}."""

    _fields_ = [("s", ctypes.c_int32), ("transferred_bytes", ctypes.c_uint64)]


class _Status(ctypes.Structure):
    """mooncake::Status {Code code_ (uint16); const char* message_ (new[])}."""

    _fields_ = [("code", ctypes.c_uint16), ("message", ctypes.c_void_p)]


class _Api:
    """The engine library's functions, typed."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.batch_status: Any = lib[_SYM_BATCH_STATUS]
        self.batch_status.argtypes = [
            ctypes.POINTER(_Status),
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.POINTER(_TransferStatus),
        ]
        self.batch_status.restype = ctypes.c_void_p
        self.free: Any = lib[_SYM_FREE]
        self.free.argtypes = [ctypes.POINTER(_Status), ctypes.c_void_p, ctypes.c_uint64]
        self.free.restype = ctypes.c_void_p
        self.alloc: Any = lib[_SYM_ALLOC]
        self.alloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.alloc.restype = ctypes.c_uint64
        self.rpc_port: Any = lib[_SYM_RPC_PORT]
        self.rpc_port.argtypes = [ctypes.c_void_p]
        self.rpc_port.restype = ctypes.c_int
        self.delete_array: Any = lib[_SYM_DELETE_ARRAY]
        self.delete_array.argtypes = [ctypes.c_void_p]
        self.delete_array.restype = None


_api: _Api | None = None
_api_problem: str | None = None
_api_lock = threading.Lock()


def _installed_version() -> str | None:
    for dist in _DISTS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _load() -> _Api:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise OSError(f"needs x86-64 Linux, not {sys.platform}/{platform.machine()}")
    version = _installed_version()
    if version is None or not version.startswith(_VERSION_PREFIX):
        raise OSError(f"needs a mooncake wheel {_VERSION_PREFIX}.x, found {version}")
    import mooncake.engine as engine_module

    path = engine_module.__file__
    if path is None:
        raise OSError("mooncake.engine has no file")
    lib = ctypes.CDLL(path)
    for sym in (_SYM_BATCH_STATUS, _SYM_FREE, _SYM_ALLOC, _SYM_RPC_PORT, _SYM_DELETE_ARRAY):
        if not hasattr(lib, sym):
            raise OSError(f"{path} lacks {sym}")
    for sym, expected in _PROLOGUES.items():
        addr = ctypes.cast(lib[sym], ctypes.c_void_p).value
        if addr is None or ctypes.string_at(addr, len(expected)) != expected:
            raise OSError(f"{sym} does not start as in the known build (ABI unverified)")
    return _Api(lib)


def api_problem() -> str | None:
    """Why the batch path cannot be used in this process, or ``None`` (loads once)."""
    global _api, _api_problem
    with _api_lock:
        if _api is None and _api_problem is None:
            try:
                _api = _load()
            except (OSError, ImportError, AttributeError, ValueError) as exc:
                _api_problem = str(exc)
        return _api_problem


class BatchPoller:
    """Non-blocking status and release of batches of one engine. Not
    thread-safe: the caller serialises (the writer's lock)."""

    def __init__(self, api: _Api, engine: Any, this: int) -> None:
        self._api = api
        self._engine = engine  # keeps the C++ object alive as long as this poller
        self._this = ctypes.c_void_p(this)
        self._ts = _TransferStatus()
        self._st = _Status()
        self._ts_ref = ctypes.byref(self._ts)
        self._st_ref = ctypes.byref(self._st)

    def _code(self) -> int:
        """The last returned Status's code; frees its message (new[]) if any."""
        code = int(self._st.code)
        if self._st.message:
            self._api.delete_array(self._st.message)
        self._st.code, self._st.message = 0, None
        return code

    def status(self, batch_id: int) -> tuple[int, int]:
        """(TransferStatusEnum, transferred bytes) of a live batch: one
        non-blocking pass over its tasks. (-1, 0) if the call itself failed."""
        self._api.batch_status(self._st_ref, self._this, batch_id, self._ts_ref)
        if self._code() != 0:
            return -1, 0
        return int(self._ts.s), int(self._ts.transferred_bytes)

    def free(self, batch_id: int) -> bool:
        """Free a batch whose every task was seen finished. False: not freed."""
        self._api.free(self._st_ref, self._this, batch_id)
        return self._code() == 0

    def poll(self, batch_id: int) -> int:
        """DONE (completed; the id is freed), PENDING, or FAILED (a task failed
        or timed out; the id is left alone for good: it may still be writing)."""
        s, _ = self.status(batch_id)
        if s in (_WAITING, _PENDING):
            return PENDING
        if s == _COMPLETED:
            if not self.free(batch_id):  # cannot happen after COMPLETED; never retry it
                log.warning("mooncake freeBatchID refused a completed batch; leaking it")
            return DONE
        return FAILED

    def self_test(self, rpc_port: int) -> str | None:
        """None if the calls behave as expected on this engine, else why not."""
        if self._api.rpc_port(self._this) != rpc_port:
            return "getRpcPort through get_engine_ptr() disagrees with the binding"
        bid = int(self._api.alloc(self._this, 1))
        if bid in (0, _U64_MAX):
            return "allocateBatchID failed"
        s, nbytes = self.status(bid)
        if (s, nbytes) != (_COMPLETED, 0):
            return f"an empty batch read ({s}, {nbytes}), not (COMPLETED, 0)"
        if not self.free(bid):
            return "freeBatchID of an empty batch failed"
        return None


def bind(engine: Any) -> BatchPoller | None:
    """A poller for ``engine`` (a ``mooncake.engine.TransferEngine``), or
    ``None`` (logged) when the guards or the self-test say no."""
    problem = api_problem()
    api = _api
    if problem is None and api is not None:
        try:
            this = int(engine.get_engine_ptr())
            poller = BatchPoller(api, engine, this)
            problem = "null engine pointer" if this == 0 else poller.self_test(int(engine.get_rpc_port()))
        except (AttributeError, TypeError, ValueError, ctypes.ArgumentError) as exc:
            problem = str(exc)
        if problem is None:
            return poller
    log.info("mooncake batch status unavailable, one transfer per segment: %s", problem)
    return None
