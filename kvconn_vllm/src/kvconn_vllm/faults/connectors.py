"""The connectors a fault run compares: how each is configured per role, and
the settings that bring its own deadlines and leases within the run.

A connector is named on the command line as one of :data:`BUILTIN` (vLLM's
own NIXL connectors, kvconn over a transport), or as ``CLASS@MODULE`` for
any connector vLLM can load (``kv_connector=CLASS``,
``kv_connector_module_path=MODULE``); ``--extra NAME=JSON`` adds to its
``kv_connector_extra_config``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

#: Seconds: the lease, registration and transfer deadlines every connector
#: is given in a fault run, short so that their expiry is reached within it
#: (vLLM's NIXL lease defaults to 30 s, kvconn's deadlines to 120 s).
DEFAULT_LEASE_S = 6


class ConnectorError(ValueError):
    """A connector name or extra setting the run cannot use."""


@attrs.frozen
class Ports:
    """The ports one prefill/decode pair listens on (fixed, so that a
    restarted prefill comes back at the same address)."""

    prefill: int
    decode: int


@attrs.frozen
class Connector:
    """One connector under test: ``label`` names its rows in the report."""

    label: str
    kv_connector: str
    module_path: str | None = None
    #: Who moves the bytes: "pull" (decode reads prefill's blocks) or
    #: "push" (prefill writes decode's blocks); "?" for a connector named
    #: by module path.
    direction: str = "?"
    extra: Mapping[str, Any] = attrs.field(factory=dict)
    #: Extra config for one role only ("kv_producer" / "kv_consumer").
    role_extra: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    #: The environment variables that carry a pair's ports, by role.
    kind: str = "generic"

    def transfer_config(self, role: str, ports: Ports) -> dict[str, Any]:
        """vLLM's ``kv_transfer_config`` for ``role`` (``kv_producer`` or
        ``kv_consumer``) of the pair listening on ``ports``."""
        extra: dict[str, Any] = {**self.extra, **self.role_extra.get(role, {})}
        if self.kind == "kvconn" and role == "kv_producer":
            extra["port"] = ports.prefill
        config: dict[str, Any] = {
            "kv_connector": self.kv_connector,
            "kv_role": role,
            "kv_buffer_device": "cpu",
            # Every connector recomputes a request whose KV it failed to
            # load, instead of failing it (vLLM's default is "fail").
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        if self.module_path:
            config["kv_connector_module_path"] = self.module_path
        return config

    def env(self, role: str, ports: Ports) -> dict[str, str]:
        """Environment variables of the engine process for ``role``."""
        if self.kind != "nixl":
            return {}
        port = ports.prefill if role == "kv_producer" else ports.decode
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}

    def settings(self) -> str:
        """The settings this connector runs with, for the report."""
        parts = [f"{k}={json.dumps(v, sort_keys=True)}" for k, v in sorted(self.extra.items())]
        for role, values in sorted(self.role_extra.items()):
            parts += [f"{role}: {k}={json.dumps(v)}" for k, v in sorted(values.items())]
        return ", ".join(parts) or "(defaults)"


def _nixl(label: str, name: str, direction: str, lease_s: int) -> Connector:
    # kv_lease_duration: prefill's lease on a finished request's blocks
    # (heartbeats from decode extend it by 2/3 of it, every 1/6 of it);
    # push_registration_timeout: decode's watchdog on a registration no
    # write fulfilled (the decoder_kv_blocks_ttl, 480 s, by default).
    extra: dict[str, Any] = {"kv_lease_duration": lease_s}
    if direction == "push":
        extra["push_registration_timeout"] = lease_s
    return Connector(label, name, None, direction, extra, kind="nixl")


def _kvconn(backend: str, lease_s: int) -> Connector:
    extra: dict[str, Any] = {
        "backend": backend,
        # A chunk's write deadline at prefill, decode's abort deadline
        # (past it with no proof a room is quarantined, still held), and
        # the per-room deadlines that end a transfer that never comes.
        "write_timeout_s": 2.5,
        "abort_timeout_s": 3.0,
        "resend_interval_s": 0.5,
        "transfer_timeout_s": float(lease_s),
        "unrequested_timeout_s": float(lease_s),
        "bootstrap_timeout_s": float(lease_s),
    }
    return Connector(f"kvconn ({backend})", "KvconnConnector", "kvconn_vllm", "push", extra, kind="kvconn")


def builtin(name: str, lease_s: int = DEFAULT_LEASE_S) -> Connector | None:
    """The connector :data:`BUILTIN` calls ``name``, or None."""
    if name == "NixlConnector":
        return _nixl("NixlConnector (pull)", "NixlConnector", "pull", lease_s)
    if name == "NixlPushConnector":
        return _nixl("NixlPushConnector", "NixlPushConnector", "push", lease_s)
    if name.startswith("kvconn:"):
        return _kvconn(name.split(":", 1)[1], lease_s)
    return None


#: Connectors known by name (``kvconn:BACKEND`` takes any kvconn transport).
BUILTIN = ("NixlConnector", "NixlPushConnector", "kvconn:loopback", "kvconn:nixl")


def parse(name: str, extra: Mapping[str, Any] | None = None, lease_s: int = DEFAULT_LEASE_S) -> Connector:
    """A connector from its command-line name: one of :data:`BUILTIN`, or
    ``CLASS@MODULE``. ``extra`` is added to its kv_connector_extra_config."""
    found = builtin(name, lease_s)
    if found is None:
        cls, sep, module = name.partition("@")
        if not sep or not cls.isidentifier() or not module:
            raise ConnectorError(
                f"connector {name!r}: give one of {', '.join(BUILTIN)}, kvconn:BACKEND, or CLASS@MODULE"
            )
        found = Connector(name, cls, module)
    if extra:
        found = attrs.evolve(found, extra={**found.extra, **extra})
    return found


def parse_extra(items: list[str]) -> dict[str, Any]:
    """``NAME=JSON`` pairs (a bare string is taken as it is)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConnectorError(f"--extra {item!r}: expected NAME=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
