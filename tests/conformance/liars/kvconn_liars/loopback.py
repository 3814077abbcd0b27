"""``liar-loopback``: kvconn's loopback transport, with four lies to switch on.

The loopback backend ships only honest options. The broken variants the
conformance suite, the bench and the vLLM start-up gate must catch live
here, as a subclass of the loopback writer that a test registers (see
``registry.py``): every loopback option works as on loopback, and each of
these flags (``1/true/yes/on``) adds one lie:

``early_done``
    the DONE barrier answers LANDED without waiting for the bytes.
``linger_after_fail``
    a chunk failed half way (``fail_every``, ``fail_chunks``) is reported
    settled, but the rest of it is written a little later all the same.
``no_fence``
    the fence returns True at once; the NIC thread keeps writing.
``misplace_buffer``
    into a region of several buffers, what is meant for the second buffer
    is written into the first, at the same offset (a layer's slice in the
    wrong layer).

Unlike the other liars this one is written against loopback's internals
(it is loopback, lying), not only the public interface.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvconn.backends.loopback import LoopbackBackend, LoopbackOptions, LoopbackWriter
from kvconn.buffers import Buffer, FlatSpace
from kvconn.chunk import Chunk
from kvconn.hookspecs import hookimpl
from kvconn.options import BackendOptions
from kvconn.transport import Settlement

LIES = ("early_done", "linger_after_fail", "no_fence", "misplace_buffer")
NAME = "liar-loopback"


def _split(options: Mapping[str, str]) -> tuple[frozenset[str], dict[str, str]]:
    """The lies switched on, and the options loopback reads (checked by it)."""
    lies = BackendOptions(NAME, {k: v for k, v in options.items() if k in LIES}, LIES)
    honest = {k: v for k, v in options.items() if k not in LIES}
    LoopbackOptions.parse(honest)
    return frozenset(lie for lie in LIES if lies.flag(lie)), honest


class _MisplacingSpace:
    """A peer's destination space whose second buffer's ranges are located
    in the first buffer, at the same offset."""

    def __init__(self, space: FlatSpace) -> None:
        self._space = space

    def locate(self, offsets: Any, lengths: Any) -> tuple[Any, Any]:
        addresses, buffer = self._space.locate(offsets, lengths)
        first, second = self._space.buffers[0].address, self._space.buffers[1].address
        addresses = np.where(buffer == 1, addresses + first - second, addresses)
        return addresses, buffer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._space, name)


class LyingLoopbackWriter(LoopbackWriter):
    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str]) -> None:
        self.lies, honest = _split(options)
        super().__init__(source, honest)

    def connect(self, peer: str, metadata: bytes) -> None:
        super().connect(peer, metadata)
        if "misplace_buffer" in self.lies:
            with self._lock:
                target = self._peers[peer]
                if len(target.space.buffers) > 1:
                    target.space = _MisplacingSpace(target.space)  # type: ignore[assignment]

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: Any, deadline: float) -> Settlement:
        if "early_done" in self.lies:
            return Settlement.LANDED
        return super().on_done_barrier(chunk, posted, deadline)

    @hookimpl
    def on_fence(self) -> bool:
        if "no_fence" in self.lies:
            return True
        return super().on_fence()

    def _fail_midway(self, peer: Any, pieces: Any, rest: list[tuple[int, int]]) -> str:
        if "linger_after_fail" in self.lies:
            threading.Thread(target=self._linger, args=(peer, pieces, rest), daemon=True).start()
        return super()._fail_midway(peer, pieces, rest)

    def _linger(self, peer: Any, pieces: Any, steps: list[tuple[int, int]]) -> None:
        time.sleep(max(self.options.piece_delay_s, 0.05) * 4)
        for first, end in steps:
            peer.copy(pieces, first, end)


class LyingLoopbackBackend(LoopbackBackend):
    name = NAME
    capabilities = attrs.evolve(
        LoopbackBackend.capabilities, notes="loopback, with lies to switch on: " + ", ".join(LIES)
    )

    def capabilities_for(self, options: Mapping[str, str]) -> Any:
        _split(options)
        return self.capabilities

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> Any:
        return super().open_region(nbytes, _split(options)[1])

    def register_region(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> Any:
        return super().register_region(buffers, _split(options)[1])

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> LyingLoopbackWriter:
        return LyingLoopbackWriter(nbytes, options)

    def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> LyingLoopbackWriter:
        return LyingLoopbackWriter(buffers, options)


backend = LyingLoopbackBackend()
