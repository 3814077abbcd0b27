"""``liar-mooncake``: kvconn-mooncake with two lies to switch on, each a
mistake a partition between hosts shows.

``early_landed``
    the DONE barrier answers LANDED once the engine took the write, without
    asking whether it arrived: with the writer's host cut off, a rank would
    ack a chunk whose bytes may still cross after decode gave its pages to
    another request (``test_landed_across_a_partition_means_delivered``
    must fail).
``closing_fence``
    the fence tears its engines down as kvconn-mooncake did before it reset
    their connections: closed, the kernel keeps their queued bytes and
    sends them once a partition heals
    (``test_writer_fence_holds_across_a_partition`` must fail).

Every other mooncake option works as on ``mooncake``; with no lie switched
on this is kvconn-mooncake. Written against kvconn-mooncake's classes and
internals (it is that transport, lying), not only the public interface.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping, Sequence
from typing import Any
from unittest import mock

import attrs

from kvconn.buffers import Buffer
from kvconn.chunk import Chunk
from kvconn.hookspecs import hookimpl
from kvconn.options import BackendOptions
from kvconn.transport import Capabilities, Settlement
from kvconn_mooncake import MooncakeBackend, MooncakeWriter, Posted

NAME = "liar-mooncake"
LIES = ("early_landed", "closing_fence")
#: The module (``kvconn_mooncake.backend`` names the backend object there).
_MODULE = importlib.import_module("kvconn_mooncake.backend")


def _split(options: Mapping[str, str]) -> tuple[frozenset[str], dict[str, str]]:
    """The lies switched on, and the options mooncake reads (checked by it)."""
    lies = BackendOptions(NAME, {k: v for k, v in options.items() if k in LIES}, LIES)
    return frozenset(lie for lie in LIES if lies.flag(lie)), {
        k: v for k, v in options.items() if k not in LIES
    }


class LyingMooncakeWriter(MooncakeWriter):
    def __init__(self, source: int | Sequence[Buffer], options: Mapping[str, str]) -> None:
        self.lies, honest = _split(options)
        super().__init__(source, honest)

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement | None:
        if "early_landed" in self.lies and isinstance(posted, Posted) and not posted.failed:
            return Settlement.LANDED  # accepted for sending is not delivered
        return super().on_done_barrier(chunk, posted, deadline)

    @hookimpl
    def on_fence(self) -> bool | None:
        if "closing_fence" not in self.lies:
            return super().on_fence()
        with mock.patch.object(_MODULE, "resetting_closed_sockets", contextlib.nullcontext):
            return super().on_fence()


@attrs.frozen
class LyingMooncakeBackend(MooncakeBackend):
    name: str = NAME

    def capabilities_for(self, options: Mapping[str, str]) -> Capabilities:
        return super().capabilities_for(_split(options)[1])

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> Any:
        return super().open_region(nbytes, _split(options)[1])

    def register_region(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> Any:
        return super().register_region(buffers, _split(options)[1])

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> LyingMooncakeWriter:
        return LyingMooncakeWriter(nbytes, options)

    def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> LyingMooncakeWriter:
        return LyingMooncakeWriter(buffers, options)


backend = LyingMooncakeBackend()
