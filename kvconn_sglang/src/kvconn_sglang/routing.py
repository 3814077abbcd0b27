"""Where a decode rank finds the kvconn addresses of a prefill server's ranks.

Interim and deliberately small: kvconn's per-request routing (a decode that
learns a prefill's ranks per request, from SGLang's bootstrap server) is
being built in kvconn-core; until it lands, a decode endpoint bootstraps with
a fixed list of prefill rank addresses per SGLang ``bootstrap_addr``.

The operator sets ``KVCONN_SGLANG_PREFILL`` on decode, one entry per prefill
server, ``;``-separated: ``BOOTSTRAP_HOST:PORT=RANK0_ADDR,RANK1_ADDR``
(the rank addresses are what each prefill rank logs at start, "kvconn
prefill rank N listening at ...", or sets with ``KVCONN_SGLANG_PORT_BASE``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence

ENV = "KVCONN_SGLANG_PREFILL"


class RoutingError(LookupError):
    """No prefill ranks are known for a bootstrap address."""


def parse(text: str) -> dict[str, tuple[str, ...]]:
    """``host:port=addr,addr;host:port=addr`` as a mapping."""
    table: dict[str, tuple[str, ...]] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        key, sep, value = entry.partition("=")
        addresses = tuple(filter(None, (a.strip() for a in value.split(","))))
        if not sep or not key.strip() or not addresses:
            raise RoutingError(f"{ENV}: expected BOOTSTRAP_HOST:PORT=ADDR[,ADDR...], got {entry!r}")
        table[key.strip()] = addresses
    return table


class PrefillDirectory:
    """bootstrap address -> the kvconn addresses of that prefill's ranks, in rank order."""

    def __init__(self, table: Mapping[str, Sequence[str]] | None = None) -> None:
        self._lock = threading.Lock()
        self._table = {k: tuple(v) for k, v in (table or {}).items()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> PrefillDirectory:
        return cls(parse(environ.get(ENV, "")))

    def add(self, bootstrap_addr: str, addresses: Sequence[str]) -> None:
        with self._lock:
            self._table[bootstrap_addr] = tuple(addresses)

    def ranks_of(self, bootstrap_addr: str) -> tuple[str, ...]:
        with self._lock:
            found = self._table.get(bootstrap_addr)
        if not found:
            raise RoutingError(
                f"no kvconn prefill ranks known for bootstrap address {bootstrap_addr!r} (set {ENV})"
            )
        return found


#: Tests and embedders may install their own directory (the scheduler builds
#: managers itself, so there is no constructor argument to pass one through).
DirectoryFactory = Callable[[], PrefillDirectory]
_factory: DirectoryFactory = PrefillDirectory.from_env


def set_directory_factory(factory: DirectoryFactory) -> None:
    global _factory
    _factory = factory


def directory() -> PrefillDirectory:
    return _factory()


__all__ = ["ENV", "PrefillDirectory", "RoutingError", "directory", "parse", "set_directory_factory"]
