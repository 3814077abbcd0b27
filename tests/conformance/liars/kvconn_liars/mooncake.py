"""``liar-mooncake``: kvconn-mooncake whose DONE barrier answers LANDED once
the engine took the write, without asking whether it arrived.

On one host that lie hides behind a fast link: the bytes are in decode's
region by the time anyone looks. Across hosts, with the writer's host cut
off, they are not, and a rank would ack a chunk whose bytes may still cross
after decode gave its pages to another request. The liar every cross-host
LANDED check must catch (``test_landed_across_a_partition_means_delivered``).

Written against kvconn-mooncake's classes (it is that transport, lying):
every mooncake option works as on ``mooncake``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvconn.buffers import Buffer
from kvconn.chunk import Chunk
from kvconn.hookspecs import hookimpl
from kvconn.transport import Settlement
from kvconn_mooncake import MooncakeBackend, MooncakeWriter, Posted

NAME = "liar-mooncake"


class SubmittedMeansLandedWriter(MooncakeWriter):
    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement | None:
        if isinstance(posted, Posted) and not posted.failed:
            return Settlement.LANDED  # the lie: accepted for sending is not delivered
        return super().on_done_barrier(chunk, posted, deadline)


@attrs.frozen
class LyingMooncakeBackend(MooncakeBackend):
    name: str = NAME

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> Any:
        return SubmittedMeansLandedWriter(nbytes, options)

    def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> Any:
        return SubmittedMeansLandedWriter(buffers, options)


backend = LyingMooncakeBackend()
