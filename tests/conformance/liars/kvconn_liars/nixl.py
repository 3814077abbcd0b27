"""``liar-nixl``: kvconn-nixl with two lies to switch on, each a mistake a
partition between hosts shows (beside ``liar-mooncake``'s).

``early_landed``
    the DONE barrier answers LANDED once the transfer was handed to UCX
    (its state PROC), without waiting for DONE: with the writer's host cut
    off, a rank would ack a chunk whose bytes still wait to cross
    (``test_landed_across_a_partition_means_delivered`` must fail).
``keep_agent``
    the fence releases the transfer handles and answers True, but keeps the
    agent, and with it UCX's connections and what they still carry
    (releasing handles stops nothing: docs/writing-a-transport-plugin.md):
    the fence checks fail it, on one host and across hosts (across a cut,
    what the released transfers still carried did not land after the heal
    in our runs: ``test_writer_fence_holds_across_a_partition`` passes it).

Every other nixl option works as on ``nixl``; with no lie switched on this
is kvconn-nixl. Written against kvconn-nixl's classes and internals (it is
that transport, lying), not only the public interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from kvconn.buffers import Buffer
from kvconn.chunk import Chunk
from kvconn.hookspecs import hookimpl
from kvconn.options import BackendOptions
from kvconn.transport import Capabilities, Settlement
from kvconn_nixl import NixlBackend, NixlWriter, Posted

NAME = "liar-nixl"
LIES = ("early_landed", "keep_agent")


def _split(options: Mapping[str, str]) -> tuple[frozenset[str], dict[str, str]]:
    """The lies switched on, and the options nixl reads (checked by it)."""
    lies = BackendOptions(NAME, {k: v for k, v in options.items() if k in LIES}, LIES)
    return frozenset(lie for lie in LIES if lies.flag(lie)), {
        k: v for k, v in options.items() if k not in LIES
    }


class LyingNixlWriter(NixlWriter):
    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str]) -> None:
        self.lies, honest = _split(options)
        super().__init__(source, honest)

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement | None:
        if (
            "early_landed" in self.lies
            and isinstance(posted, Posted)
            and posted.generation == self._generation
        ):
            return Settlement.LANDED  # handed to UCX is not delivered
        return super().on_done_barrier(chunk, posted, deadline)

    @hookimpl
    def on_fence(self) -> bool | None:
        if "keep_agent" not in self.lies:
            return super().on_fence()
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            self._generation += 1
            self._destroyed_below = self._generation
        while handles:
            with contextlib.suppress(Exception):
                handles.pop().release()
        return True


class LyingNixlBackend(NixlBackend):
    name = NAME

    @staticmethod
    def capabilities_for(options: Mapping[str, str]) -> Capabilities:
        return NixlBackend.capabilities_for(_split(options)[1])

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> Any:
        return super().open_region(nbytes, _split(options)[1])

    def register_region(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> Any:
        return super().register_region(buffers, _split(options)[1])

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> LyingNixlWriter:
        return LyingNixlWriter(nbytes, options)

    def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> LyingNixlWriter:
        return LyingNixlWriter(buffers, options)


backend = LyingNixlBackend()
