"""A prefill/decode pair of engines for one connector, and the steps a proxy
takes to serve a request through it (prefill with ``do_remote_decode``,
then decode with the ``kv_transfer_params`` prefill answered)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from kvconn_vllm.faults.connectors import Connector, Ports
from kvconn_vllm.faults.engine import Engine, EngineError, EngineSpec

#: How often the parent looks at an engine while it waits (each look is a
#: pipe round trip the engine answers between two steps).
POLL_S = 0.002


def engine_spec(base: EngineSpec, connector: Connector | None, role: str | None, ports: Ports | None) -> EngineSpec:
    if connector is None or role is None or ports is None:
        return attrs.evolve(base, name="one engine")
    return attrs.evolve(
        base,
        role=role,
        transfer=connector.transfer_config(role, ports),
        env={**base.env, **connector.env(role, ports)},
        name=f"{connector.label} {'prefill' if role == 'kv_producer' else 'decode'}",
    )


@attrs.define
class Pair:
    connector: Connector
    ports: Ports
    base: EngineSpec
    prefill: Engine = attrs.field(init=False)
    decode: Engine = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.prefill = Engine(engine_spec(self.base, self.connector, "kv_producer", self.ports))
        self.decode = Engine(engine_spec(self.base, self.connector, "kv_consumer", self.ports))

    @property
    def label(self) -> str:
        return self.connector.label

    def up(self) -> None:
        assert self.prefill.info and self.decode.info

    def restart_prefill(self) -> float:
        """A new prefill engine at the same address (ports); the old one
        must be gone. Returns the seconds it took to come up."""
        started = time.monotonic()
        self.prefill.close()
        self.prefill = Engine(engine_spec(self.base, self.connector, "kv_producer", self.ports))
        assert self.prefill.info
        return time.monotonic() - started

    def close(self) -> None:
        for engine in (self.prefill, self.decode):
            engine.close()


def wait_until(cond: Callable[[], bool], timeout_s: float, poll_s: float = POLL_S) -> bool:
    """Poll ``cond`` until true (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def finished(engine: Engine, req_id: str, timeout_s: float) -> dict[str, Any] | None:
    """The finished request's event, or None if not within ``timeout_s``."""

    def done() -> bool:
        if req_id not in engine.events:
            engine.poll()
        return req_id in engine.events

    return engine.events[req_id] if wait_until(done, timeout_s) else None


def prefill_only(pair: Pair, req_id: str, prompt: list[int], timeout_s: float = 120.0) -> dict[str, Any]:
    """The request computed at prefill, whose KV it now keeps for decode."""
    pair.prefill.add(req_id, prompt, 1, {"do_remote_decode": True})
    event = finished(pair.prefill, req_id, timeout_s)
    if event is None:
        raise EngineError(f"{pair.label}: prefill did not finish {req_id} within {timeout_s:g} s")
    if not event.get("kv_transfer_params"):
        raise EngineError(f"{pair.label}: prefill answered {req_id} without kv_transfer_params")
    return event
