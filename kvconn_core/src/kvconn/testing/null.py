"""A transport that does nothing: posting returns at once, every DONE
barrier says LANDED, the fence returns True, reads give zeros.

For tests of the runtime's own logic (control plane, liveness, routing,
page bookkeeping) where no byte needs to move, and for the bench's
measurement of kvconn's per-chunk cost. Not registered as an entry point:
a test passes ``NullBackend()`` where a backend is wanted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvconn.chunk import Chunk, Segment
from kvconn.hookspecs import hookimpl
from kvconn.transport import Capabilities, Settlement

__all__ = ["NullBackend", "NullRegion", "NullWriter"]


class NullRegion:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.metadata = b"null"

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(nbytes)

    def write(self, offset: int, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class NullWriter:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(nbytes)

    def write(self, offset: int, data: bytes) -> None:
        pass

    def connect(self, peer: str, metadata: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> object:
        return segments

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement:
        return Settlement.LANDED

    @hookimpl
    def on_fence(self) -> bool:
        return True


class NullBackend:
    name = "null"
    capabilities = Capabilities(writer_fence=True, notes="does nothing: for overhead measurement")

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> NullRegion:
        return NullRegion(nbytes)

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> NullWriter:
        return NullWriter(nbytes)
