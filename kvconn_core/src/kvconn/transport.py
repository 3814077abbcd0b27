"""The transport interface a backend plugin implements.

A backend is found through the ``kvconn.backends`` entry-point group; the
object behind the entry point satisfies :class:`Backend`. It opens two kinds
of endpoints:

* on decode, a :class:`PageRegion`: the page owner's registered memory, plus
  the metadata a writer needs to reach it;
* on each prefill rank, a :class:`Writer`: the rank's registered source
  memory and its connections to page owners.

Either is opened over memory the backend allocates (``open_region(nbytes)``,
``open_writer(nbytes)``: for the bench and tests) or over memory the engine
already owns (``register_region(buffers)``, ``register_writer(buffers)``: a
list of :class:`kvconn.buffers.Buffer`, e.g. an engine's per-layer K and V
tensors). Offsets in segments address the buffers laid end to end in list
order; a segment never straddles two. Registered memory stays the engine's:
``close()`` deregisters it and frees nothing.

The per-chunk work (post the writes, wait at the DONE barrier, fence) is not
a method here: the writer registers itself as a pluggy plugin and implements
the hooks in :mod:`kvconn.hookspecs`, so the core can fire them around its
own bookkeeping and observers can watch the same points.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Protocol, cast, runtime_checkable

import attrs

from kvconn.buffers import Buffer, buffers_of
from kvconn.errors import KvconnError


class Settlement(enum.Enum):
    """What the DONE barrier proved about a posted chunk."""

    #: Every byte of every segment is in the destination.
    LANDED = "landed"
    #: The chunk failed and the transport proved nothing more of it can land
    #: (every handle settled).
    FAILED_SETTLED = "failed_settled"
    #: The chunk failed or ran past its deadline and some bytes may still land
    #: (also a chunk that landed only after its deadline). The core poisons
    #: the room: no ack until a fence or the writer's exit.
    UNSETTLED = "unsettled"


@attrs.frozen(slots=True)
class Capabilities:
    """What a backend promises; the conformance suite holds it to each claim.

    ``writer_fence``: the writer's ``on_fence`` hook stops every late byte of
    everything posted before it (proven by a frozen-then-resumed writer
    landing nothing). Without it, poisoned rooms wait for the writer's exit.
    ``memory``: the memory kinds a region can live in ("dram", "vram").
    ``cross_host``: writers may run on another host than the page owner,
    once each endpoint is bound to its host's interface (the backend's
    ``host_options``: option templates with ``{ip}`` and ``{iface}``, which
    the conformance suite's cross-host mode fills in for each host); options
    that bind it to loopback say False (``capabilities_for``).
    ``max_write_timeout_s``: the transport's own longest wait for a write
    (e.g. Mooncake's engine timeout); ``None`` if it imposes none. kvconn
    refuses a decode deadline that is not longer.
    ``owner_fence``: the page owner can stop every late byte from every
    writer, including one frozen or partitioned on another host, by tearing
    down its whole endpoint (:meth:`PageRegion.owner_fence`). It is the one
    proof decode can make without any writer's help; it costs every peer of
    that region a re-bootstrap (each writer must ``connect`` again with the
    new metadata) and fails the region's other in-flight writes.
    """

    writer_fence: bool = False
    memory: frozenset[str] = frozenset({"dram"})
    cross_host: bool = False
    max_write_timeout_s: float | None = None
    owner_fence: bool = False
    notes: str = ""


class PageRegion(Protocol):
    """Decode's registered page memory (the page owner's side)."""

    #: Opaque bytes a :class:`Writer` passes to ``connect`` to reach this region.
    metadata: bytes
    nbytes: int

    def read(self, offset: int, nbytes: int) -> bytes:
        """Copy bytes out of the region (for verification and the engine)."""

    def write(self, offset: int, data: bytes) -> None:
        """Copy bytes into the region locally (used to lay canaries)."""

    def close(self) -> None:
        """Unregister the region; free it only if the backend allocated it."""

    # Optional, present when the backend claims ``Capabilities.owner_fence``:
    #
    # def owner_fence(self) -> bytes:
    #     """Tear down the region's whole endpoint and open a new one; return the NEW metadata.
    #
    #     After it returns, no write posted against the old metadata can land,
    #     from any writer on any host, frozen, partitioned or resumed. The
    #     region's memory and contents stay (same offsets, same bytes);
    #     ``metadata`` is the new value. Writers must ``connect`` again with the
    #     new metadata; every write in flight to this region fails.
    #
    #     Raise FencedWithoutEndpoint when the old endpoint is gone (so the
    #     fence holds) but the new one could not be made yet: the core calls
    #     again later (with no endpoint to tear down, the call only makes one).
    #     Raise OwnerFenceFailed when the old endpoint may still be reachable:
    #     nothing is proven then.
    #     """


class OwnerFenceUnsupported(TypeError):
    """The region's backend cannot fence as the page owner."""


class OwnerFenceFailed(KvconnError, RuntimeError):
    """The owner fence did not happen (the old endpoint could not be
    destroyed): nothing is proven; the region's pages stay held."""


class FencedWithoutEndpoint(KvconnError, RuntimeError):
    """The owner fence held (the old endpoint is gone: nothing sent to it can
    land) but the region's new endpoint could not be made yet (the message
    says why: UCX refuses an agent while the interface it is pinned to has
    no carrier). The core releases what the fence proved, refuses requests
    meanwhile and calls ``owner_fence()`` again on a bounded schedule."""


def owner_fence(region: PageRegion) -> bytes:
    """``region.owner_fence()``: stop every late byte to ``region``; the
    region's new metadata (:class:`FencedWithoutEndpoint` if the fence held
    but left the region without an endpoint for now: call again to make one).

    Only for a region whose backend claims ``Capabilities.owner_fence``; the
    caller checks the claim (``capabilities_of``) and hands the returned
    metadata to every writer that is to reach the region again.
    """
    fence = getattr(region, "owner_fence", None)
    if fence is None:
        raise OwnerFenceUnsupported(f"{type(region).__name__} cannot fence as the page owner")
    metadata = fence()
    if not isinstance(metadata, bytes):
        raise TypeError(f"{type(region).__name__}.owner_fence returned {type(metadata).__name__}, not bytes")
    return metadata


@runtime_checkable
class Writer(Protocol):
    """A prefill rank's transport endpoint.

    Implements the hooks ``on_post``, ``on_done_barrier`` and (if capable)
    ``on_fence`` from :mod:`kvconn.hookspecs`; the core registers it with the
    rank's plugin manager.
    """

    nbytes: int

    def read(self, offset: int, nbytes: int) -> bytes:
        """Copy bytes out of the source region."""

    def write(self, offset: int, data: bytes) -> None:
        """Fill the source region (the engine's KV lands here before sending)."""

    def connect(self, peer: str, metadata: bytes) -> None:
        """Make ``peer`` (a page owner's id) reachable, given its region metadata.

        Called once per peer, when that decode's first Hello reaches the rank.
        A restarted decode has a new id and gets a call of its own; so does
        a decode after it fenced as the page owner (a new id, with its
        region's new metadata: the old id's metadata then reaches nothing,
        and writes through it fail). Nothing says when an old one is gone. Never called again after a fence: the
        fence must leave the writer able to write to every peer it knew.
        """

    def close(self) -> None:
        """Release every transport resource (engine-owned memory is deregistered, not freed)."""


class Backend(Protocol):
    """What the ``kvconn.backends`` entry point yields.

    ``capabilities`` are those of the default options. A backend whose
    claims depend on its options (NIXL's fence holds for some UCX transports
    only) also defines ``capabilities_for(options)``; the core asks that,
    before it starts any process, so it is also where a backend refuses bad
    options early (:class:`kvconn.options.BackendOptions`).
    """

    name: str
    capabilities: Capabilities

    def open_region(self, nbytes: int, options: Mapping[str, str]) -> PageRegion:
        """Allocate and register ``nbytes`` of page memory on the page owner."""

    def open_writer(self, nbytes: int, options: Mapping[str, str]) -> Writer:
        """Allocate and register ``nbytes`` of source memory on a prefill rank."""

    # Optional (a backend without them serves self-allocated memory only):
    #
    # def register_region(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> PageRegion:
    #     """Register the page owner's engine-owned ``buffers`` as one region."""
    #
    # def register_writer(self, buffers: Sequence[Buffer], options: Mapping[str, str]) -> Writer:
    #     """Register a prefill rank's engine-owned source ``buffers``."""


class EngineMemoryUnsupported(KvconnError, TypeError):
    """The backend cannot register memory the engine owns. (Also a
    TypeError: what it was before.)"""


def register_region(backend: Backend, buffers: Sequence[object], options: Mapping[str, str]) -> PageRegion:
    """``backend.register_region`` over ``buffers`` (anything :meth:`Buffer.of` takes)."""
    return cast(PageRegion, _register(backend, "register_region", buffers, options))


def register_writer(backend: Backend, buffers: Sequence[object], options: Mapping[str, str]) -> Writer:
    """``backend.register_writer`` over ``buffers`` (anything :meth:`Buffer.of` takes)."""
    return cast(Writer, _register(backend, "register_writer", buffers, options))


def _register(backend: Backend, method: str, buffers: Sequence[object], options: Mapping[str, str]) -> object:
    register = getattr(backend, method, None)
    if register is None:
        raise EngineMemoryUnsupported(f"backend {backend.name!r} cannot register engine-owned memory")
    bufs = buffers_of(buffers)
    _check_kind(backend, bufs, options)
    return register(bufs, options)


def _check_kind(backend: Backend, buffers: Sequence[Buffer], options: Mapping[str, str]) -> None:
    kind = buffers[0].kind
    if kind not in capabilities_of(backend, options).memory:
        raise EngineMemoryUnsupported(f"backend {backend.name!r} cannot register {kind} memory")


def capabilities_of(backend: Backend, options: Mapping[str, str]) -> Capabilities:
    """What ``backend`` claims with these ``options``."""
    for_options = getattr(backend, "capabilities_for", None)
    if for_options is None:
        return backend.capabilities
    caps = for_options(options)
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{backend.name}.capabilities_for returned {caps!r}")
    return caps
