"""Loading and creating Mooncake Transfer Engines, with the environment set first."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvconn.options import OptionError
from kvconn_mooncake._options import read as read_options

#: Engine timeout (seconds) the plugin sets when the operator set none. The
#: engine clamps both variables to at least 5 s.
DEFAULT_TIMEOUT_S = 10
MIN_TIMEOUT_S = 5

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PROTOCOL = "tcp"
PROTOCOLS = ("tcp", "rdma")


class MooncakeUnavailable(ImportError):
    """The Mooncake engine cannot be imported (package or system library missing)."""


def configure_env() -> None:
    """Set quiet logging and bounded timeouts, unless the operator chose others.

    Must run before the first engine is created (the engine reads them then).
    """
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", os.environ["MC_TRANSFER_TIMEOUT"])


def _env_seconds(name: str) -> int:
    try:
        return max(MIN_TIMEOUT_S, int(os.environ.get(name, str(DEFAULT_TIMEOUT_S))))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def engine_timeout_s() -> float:
    """The engine's longest wait for a stalled write, as configured."""
    return float(max(_env_seconds("MC_TRANSFER_TIMEOUT"), _env_seconds("MC_TCP_STATUS_TIMEOUT_SEC")))


def _engine_class() -> Any:
    configure_env()
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise MooncakeUnavailable(
                "the Mooncake engine needs the system library libibverbs.so.1 even for tcp "
                "(Debian/Ubuntu: apt-get install -y libibverbs1): " + str(exc)
            ) from exc
        raise MooncakeUnavailable(
            "cannot import mooncake.engine; install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
            "(CPU) or mooncake-transfer-engine==0.3.13.post1 (CUDA), never both: " + str(exc)
        ) from exc
    apply_glog_minloglevel()
    return TransferEngine


#: glog's minimum level, a global int of the libglog the engine links (C++ name mangled).
_GLOG_MINLOGLEVEL = "_ZN3fLI17FLAGS_minloglevelE"


def apply_glog_minloglevel() -> bool:
    """Give the engine's glog the level ``GLOG_minloglevel`` names (0 INFO,
    1 WARNING, 2 ERROR, 3 FATAL), as glog itself would: importing
    ``mooncake.engine`` sets it from ``MC_LOG_LEVEL``, which stops at ERROR,
    so an ERROR the engine logs on every start ("Local segment descriptor
    not found") could not be quieted. Whether it was set; nothing is done
    without the variable, or where the library is not found (never fatal)."""
    wanted = os.environ.get("GLOG_minloglevel", "").strip()  # noqa: SIM112 (glog spells it so)
    if not wanted.isdigit():
        return False
    path = _loaded_library("libglog")
    if path is None:
        return False
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        ctypes.c_int.in_dll(library, _GLOG_MINLOGLEVEL).value = int(wanted)
    except (OSError, ValueError):
        return False
    return True


def _loaded_library(stem: str) -> str | None:
    """The path of a shared library this process has loaded whose name starts with ``stem``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


def engine_settings(options: Mapping[str, str]) -> tuple[str, str, str]:
    """(host, protocol, device) from open_region / open_writer options."""
    opts = read_options(options)
    return (
        opts.text("host", DEFAULT_HOST),
        opts.choice("protocol", DEFAULT_PROTOCOL, PROTOCOLS),
        opts.text("device"),
    )


def check_host(host: str) -> None:
    """Refuse an address no interface of this host has: the engine would
    start, and tell its peers an address where nobody answers."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OptionError(f"mooncake option host={host!r}: cannot resolve it ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(address)
        except OSError as exc:
            raise OptionError(
                f"mooncake option host={host!r}: no interface of this host has that address "
                f"({exc.strerror}): the engine's peers could not reach it"
            ) from None


def new_engine(host: str, protocol: str, device: str) -> Any:
    """A fresh engine, P2P handshake (no metadata server)."""
    check_host(host)
    engine = _engine_class()()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise RuntimeError(f"mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
    return engine


def session_id(engine: Any, host: str) -> str:
    return f"{host}:{engine.get_rpc_port()}"


_shared: dict[tuple[str, str, str], Any] = {}
_shared_lock = threading.Lock()


def shared_engine(host: str, protocol: str, device: str) -> Any:
    """One engine per process and setting for page regions: teardown costs ~1 s."""
    key = (host, protocol, device)
    with _shared_lock:
        engine = _shared.get(key)
        if engine is None:
            engine = _shared[key] = new_engine(host, protocol, device)
        return engine


def detach_engine(engine: Any) -> list[tuple[str, str, str]]:
    """Stop handing ``engine`` to new regions (an owner fence destroys it);
    the settings it was shared under."""
    with _shared_lock:
        keys = [key for key, shared in _shared.items() if shared is engine]
        for key in keys:
            del _shared[key]
        return keys


def share_again(keys: Sequence[tuple[str, str, str]], engine: Any) -> None:
    """Undo :func:`detach_engine` (a fence that could not destroy it)."""
    with _shared_lock:
        for key in keys:
            _shared.setdefault(key, engine)


def pack_metadata(
    session: str, base: int, nbytes: int, protocol: str, buffers: Sequence[tuple[int, int]] = ()
) -> bytes:
    """``buffers``: (address, bytes) of each registered buffer, when the
    region is several (engine buffers); ``base`` and ``nbytes`` are then the
    first one's address and the total."""
    doc: dict[str, Any] = {
        "backend": "mooncake",
        "session": session,
        "base": base,
        "nbytes": nbytes,
        "protocol": protocol,
    }
    if buffers:
        doc["buffers"] = [list(b) for b in buffers]
    return json.dumps(doc, sort_keys=True).encode()


def unpack_buffers(metadata: bytes) -> tuple[tuple[int, int], ...]:
    """(address, bytes) of each buffer of a region, in offset order."""
    doc = json.loads(metadata)
    _, base, nbytes = unpack_metadata(metadata)
    raw = doc.get("buffers")
    if raw is None:
        return ((base, nbytes),)
    try:
        buffers = tuple((int(a), int(n)) for a, n in raw)
    except (TypeError, ValueError):
        raise ValueError("malformed mooncake region metadata (buffers)") from None
    if not buffers or sum(n for _, n in buffers) != nbytes or buffers[0][0] != base:
        raise ValueError("mooncake region metadata: buffers disagree with base and nbytes")
    return buffers


def unpack_metadata(metadata: bytes) -> tuple[str, int, int]:
    """(session id, base address, length) of a region."""
    doc = json.loads(metadata)
    if not isinstance(doc, dict) or doc.get("backend") != "mooncake":
        raise ValueError("not mooncake region metadata")
    session, base, nbytes = doc["session"], doc["base"], doc["nbytes"]
    if not isinstance(session, str) or not isinstance(base, int) or not isinstance(nbytes, int):
        raise ValueError("malformed mooncake region metadata")
    return session, base, nbytes
