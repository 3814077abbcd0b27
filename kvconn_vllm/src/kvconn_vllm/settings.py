"""What an operator types in ``kv_connector_extra_config``, checked once.

Every field of kvconn's :class:`~kvconn.config.Config` is a key of its own
name (``peer_timeout_s``, ``heartbeat_interval_s``, ``tracing``, ...), read
by :mod:`kvconn.config_values` from Config's own fields, so a field added
to Config is a key here too; then the connector's own keys (:data:`ADAPTER`).
A key neither knows is an error naming it and the closest known one: a
typo must not silently leave a deadline at its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvconn.config import Config
from kvconn.config_values import ConfigValueError, config_from, config_keys, unknown_key_error

#: Deadlines kvconn's Config leaves off by default that vLLM needs on.
_DEADLINE_DEFAULT_S = 120.0
#: The connector's own keys (not Config fields).
ADAPTER = ("backend", "unrequested_timeout_s", "conformance", "drain_grace_s", "idle_wait_s", "trace_file")
WHERE = "kv_connector_extra_config"


class SettingsError(ValueError):
    """``kv_connector_extra_config`` holds something kvconn cannot use."""


def _default_config() -> Config:
    return Config(transfer_timeout_s=_DEADLINE_DEFAULT_S)


@attrs.frozen
class Settings:
    """``backend``: a kvconn transport plugin (``kvconn backends`` lists them).
    ``config``: kvconn's Config, each field from its key (vLLM's defaults
    differ from Config's in one: ``transfer_timeout_s``, 120 s, kvconn's
    per-room deadline at decode: a room not received that long after decode
    asked for it fails and is aborted, its blocks come back with proof
    only, and the request is recomputed, vLLM's load-failure path).
    ``unrequested_timeout_s``: how long prefill keeps a finished request's
    blocks for a decode that has not asked for them yet. Nothing was written
    from them then, so giving them back is safe; a decode that asks later is
    told the room failed and recomputes. ``drain_grace_s``: at shutdown
    the worker drains (docs/engine-integration.md, "Draining"): a prefill
    rank refuses new rooms and gives those it holds this long to complete;
    a decode endpoint aborts what is left and waits this long for the proofs.
    ``idle_wait_s``: in a step that runs no request (vLLM steps while a
    finished request keeps blocks for a send, or a request waits for its
    KV), the worker waits up to this long for a transfer to settle instead
    of answering at once; 0 turns the wait off (vLLM then steps back to
    back). A request arriving meanwhile waits for the step to end.
    ``trace_file``: with ``tracing``, each worker process appends its spans
    to this file as JSON lines (:mod:`kvconn.runtime.trace_export`); unset,
    spans go to the process's own OpenTelemetry tracer provider."""

    backend: str = "loopback"
    config: Config = attrs.field(factory=_default_config)
    unrequested_timeout_s: float = _DEADLINE_DEFAULT_S
    #: Run kvconn's conformance suite on the transport at start-up (see
    #: :mod:`kvconn_vllm.conformance`).
    conformance: bool = False
    drain_grace_s: float = 10.0
    idle_wait_s: float = 0.005
    trace_file: str | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        fields = set(config_keys())
        for key in sorted(extra):
            if key not in fields and key not in ADAPTER:
                raise SettingsError(str(unknown_key_error(key, [*fields, *ADAPTER], f"{WHERE} key")))
        try:
            config = config_from({k: v for k, v in extra.items() if k in fields}, base=_default_config())
        except ConfigValueError as exc:
            raise SettingsError(f"{WHERE}: {exc}") from None
        if config.transfer_timeout_s is None:
            raise SettingsError(
                "transfer_timeout_s must be > 0: vLLM waits for a room's KV for as long as kvconn does"
            )
        backend = extra.get("backend", "loopback")
        if not isinstance(backend, str) or not backend:
            raise SettingsError(f"backend must be a plugin name, got {backend!r}")
        unrequested = _number(
            "unrequested_timeout_s", extra.get("unrequested_timeout_s", _DEADLINE_DEFAULT_S)
        )
        if unrequested <= 0:
            raise SettingsError(f"unrequested_timeout_s must be > 0, got {unrequested}")
        conformance = extra.get("conformance", False)
        if not isinstance(conformance, bool):
            raise SettingsError(f"conformance must be true or false, got {conformance!r}")
        grace = _number("drain_grace_s", extra.get("drain_grace_s", 10.0))
        if grace < 0:
            raise SettingsError(f"drain_grace_s must be >= 0, got {grace}")
        idle = _number("idle_wait_s", extra.get("idle_wait_s", 0.005))
        if not 0 <= idle <= 1:
            raise SettingsError(f"idle_wait_s must be 0 (off) to 1 s, got {idle}")
        trace_file = extra.get("trace_file")
        if trace_file is not None and (not isinstance(trace_file, str) or not trace_file):
            raise SettingsError(f"trace_file must be a file path, got {trace_file!r}")
        return cls(backend, config, unrequested, conformance, grace, idle, trace_file)


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise SettingsError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise SettingsError(f"{key} must be a number, got {value!r}") from None
