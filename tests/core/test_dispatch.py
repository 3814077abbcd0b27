"""runtime/dispatch.py: a lone transport implementation is called directly,
and any change to the plugins takes effect from the next chunk on."""

from __future__ import annotations

from collections.abc import Generator, Sequence

from kvconn.chunk import Chunk, Segment
from kvconn.hookspecs import hookimpl
from kvconn.runtime.dispatch import ChunkHooks, HookManager
from kvconn.transport import Settlement

CHUNK = Chunk(1, 0, True, 0, "d", (0,), (0,))


class Transport:
    @hookimpl
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> object:
        return ("posted", chunk.room)

    @hookimpl
    def on_done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Settlement:
        return Settlement.LANDED


class Observer:
    def __init__(self) -> None:
        self.seen: list[str] = []

    @hookimpl(wrapper=True)
    def on_post(self, chunk: Chunk, segments: Sequence[Segment]) -> Generator[None, object, object]:
        self.seen.append("post")
        return (yield)

    @hookimpl
    def on_dequeue(self, chunk: Chunk) -> None:
        self.seen.append("dequeue")


def test_direct_until_an_observer_registers_then_direct_again() -> None:
    pm = HookManager()
    pm.register(Transport(), name="transport")
    hooks = ChunkHooks(pm)
    assert hooks.current()._post is not None and not hooks.has_dequeue
    assert hooks.current().post(CHUNK, []) == ("posted", 1)
    observer = Observer()
    pm.register(observer)
    current = hooks.current()
    assert current._post is None and current.has_dequeue
    current.dequeue(CHUNK)
    assert current.post(CHUNK, []) == ("posted", 1)
    assert current.done_barrier(CHUNK, None, 0.0) is Settlement.LANDED
    assert observer.seen == ["dequeue", "post"]
    pm.unregister(observer)
    assert hooks.current()._post is not None and not hooks.current().has_dequeue


def test_monitoring_sends_every_call_through_pluggy() -> None:
    pm = HookManager()
    pm.register(Transport(), name="transport")
    hooks = ChunkHooks(pm)
    calls: list[str] = []
    pm.add_hookcall_monitoring(lambda name, impls, kw: calls.append(name), lambda *a: None)
    assert hooks.current().post(CHUNK, []) == ("posted", 1)
    assert calls == ["on_post"]
