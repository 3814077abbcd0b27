"""Decode's page memory registered with Mooncake, and its owner-side fence."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvconn.buffers import Buffer
from kvconn.transport import OwnerFenceFailed, OwnerFenceUnsupported
from kvconn_mooncake._engine import (
    detach_engine,
    engine_settings,
    new_engine,
    pack_metadata,
    session_id,
    share_again,
    shared_engine,
)
from kvconn_mooncake._memory import MemoryOptions, open_space, register_space, unregister_space


class MooncakeRegion:
    """Decode's page memory (DRAM, or VRAM with ``memory=vram``), or the
    engine's buffers, registered with the process's shared engine."""

    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str]) -> None:
        """``source``: bytes to allocate, or the engine's buffers to register."""
        if isinstance(source, int) and source <= 0:
            raise ValueError("region size must be positive")
        host, protocol, device = engine_settings(options)
        self.memory = MemoryOptions.parse(options)
        self._mem = open_space(source, self.memory)
        self.nbytes = self._mem.nbytes
        self.base: int = self._mem.addr
        self._settings = (host, protocol, device)
        self._engine: Any = shared_engine(host, protocol, device)
        register_space(self._engine, self._mem)
        self.metadata: bytes = self._describe()
        self._closed = False
        #: Seconds the last owner_fence took (teardown + new engine).
        self.last_owner_fence_s = 0.0

    def _describe(self) -> bytes:
        host, protocol, _ = self._settings
        self.session = session_id(self._engine, host)
        ranges = () if self._mem.single else self._mem.ranges()
        return pack_metadata(self.session, self.base, self.nbytes, protocol, ranges)

    def owner_fence(self) -> bytes:
        """Destroy the region's engine (every connection a writer reached it
        through; its RPC port closes) and register the same memory with an
        engine of the region's own; the new metadata (a new session).
        Measured over tcp: no byte posted to the old engine lands after it.

        Refused (:class:`OwnerFenceFailed`, nothing changed) while another
        region of this process still uses the same engine: destroying it
        would fence that region too, behind its back."""
        host, protocol, device = self._settings
        if protocol != "tcp":
            raise OwnerFenceUnsupported(f"mooncake owner fence: not proven for protocol={protocol}")
        if self._closed:
            raise OwnerFenceFailed("mooncake owner fence: the region is closed")
        t0 = time.monotonic()
        if self._engine is not None:
            old, self._engine = self._engine, None
            keys = detach_engine(old)  # no new region may pick it up
            gc.collect()
            # Only ``old`` and getrefcount's argument may hold it.
            if sys.getrefcount(old) > 2:
                self._engine = old
                share_again(keys, old)
                raise OwnerFenceFailed(
                    "mooncake owner fence: another region of this process shares the engine "
                    "(open regions that may need an owner fence in a process of their own)"
                )
            unregister_space(old, self._mem)
            del old  # joins the engine's transport threads, closes its sockets
            gc.collect()
        # Its own engine, not the shared one: the next fence must be able to destroy it.
        self._engine = new_engine(host, protocol, device)
        register_space(self._engine, self._mem)
        self.metadata = self._describe()
        self.last_owner_fence_s = time.monotonic() - t0
        return self.metadata

    def array(self) -> npt.NDArray[np.uint8]:
        """The region's DRAM buffer, without a copy (DRAM only). A method, not
        a property: pluggy reads every attribute of a registered plugin."""
        return self._mem.array()

    def read(self, offset: int, nbytes: int) -> bytes:
        return self._mem.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self._mem.write(offset, data)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            engine, self._engine = self._engine, None  # a closed region keeps no engine alive
            if engine is not None:
                unregister_space(engine, self._mem)
