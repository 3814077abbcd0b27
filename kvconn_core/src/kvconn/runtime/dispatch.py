"""The per-chunk hook calls, without pluggy's dispatch when it adds nothing.

A pluggy hook call costs ~1.3 us even with one implementation; a chunk makes
two (on_post, on_done_barrier), a fifth of kvconn's per-chunk budget. When the
transport is a hook's only implementation (no wrapper, no observer, no
monitoring), calling its function is what pluggy would do. Registrations
bump a counter, so an observer registered at any time takes effect from the
next chunk on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pluggy

from kvconn import hookspecs
from kvconn.chunk import Chunk, Segment


class HookManager(pluggy.PluginManager):
    """kvconn's plugin manager: pluggy's, counting changes to its plugins."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self.changes = 0
        self.monitored = False

    def register(self, plugin: object, name: str | None = None) -> str | None:
        self.changes += 1
        return super().register(plugin, name)

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any | None:
        self.changes += 1
        return super().unregister(plugin, name)

    def set_blocked(self, name: str) -> None:
        self.changes += 1
        super().set_blocked(name)

    def add_hookcall_monitoring(self, before: Any, after: Any) -> Callable[[], None]:
        # Tracing sees every call: from now on, always through pluggy.
        self.monitored = True
        self.changes += 1
        return super().add_hookcall_monitoring(before, after)


class ChunkHooks:
    """The four per-chunk hooks of one manager, each a direct call when it can
    be, and whether the per-abort hook has anyone to call."""

    def __init__(self, pm: HookManager) -> None:
        self._pm = pm
        self._seen = -1
        self.refresh()

    def refresh(self) -> None:
        hook = self._pm.hook
        self._seen = self._pm.changes
        self.has_dequeue = bool(hook.on_dequeue.get_hookimpls())
        self.has_skip = bool(hook.on_skip.get_hookimpls())
        #: Something must see on_abort_notification calls (an implementation,
        #: or the hook-call monitoring of tracing); otherwise the call is skipped.
        self.has_abort = self._pm.monitored or bool(hook.on_abort_notification.get_hookimpls())
        self._post = self._lone(hook.on_post, ("chunk", "segments"))
        self._barrier = self._lone(hook.on_done_barrier, ("chunk", "posted", "deadline"))

    def current(self) -> ChunkHooks:
        if self._seen != self._pm.changes:
            self.refresh()
        return self

    def _lone(self, caller: pluggy.HookCaller, argnames: tuple[str, ...]) -> Callable[..., Any] | None:
        impls = caller.get_hookimpls()
        if self._pm.monitored or len(impls) != 1:
            return None
        impl = impls[0]
        if impl.wrapper or impl.hookwrapper or tuple(impl.argnames) != argnames:
            return None
        return impl.function

    def dequeue(self, chunk: Chunk) -> None:
        self._pm.hook.on_dequeue(chunk=chunk)

    def skip(self, chunk: Chunk) -> None:
        self._pm.hook.on_skip(chunk=chunk)

    def post(self, chunk: Chunk, segments: Sequence[Segment]) -> object:
        if self._post is not None:
            return self._post(chunk, segments)
        return self._pm.hook.on_post(chunk=chunk, segments=segments)

    def done_barrier(self, chunk: Chunk, posted: object, deadline: float) -> Any:
        if self._barrier is not None:
            return self._barrier(chunk, posted, deadline)
        return self._pm.hook.on_done_barrier(chunk=chunk, posted=posted, deadline=deadline)
