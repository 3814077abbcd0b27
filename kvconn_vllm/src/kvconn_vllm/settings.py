"""What an operator types in ``kv_connector_extra_config``, checked once.

A key this module does not know is an error naming it: a typo must not
silently leave a deadline at its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvconn.config import Config

#: Keys that become :class:`kvconn.config.Config` fields as they are.
_CONFIG_NUMBERS = ("write_timeout_s", "abort_timeout_s", "resend_interval_s", "bootstrap_timeout_s")
#: The owner fence (docs/multi-host.md): off unless set; Config checks them.
_OWNER_FENCE_NUMBERS = ("owner_fence_after_s", "owner_fence_min_interval_s")
#: Deadlines kvconn's Config leaves off by default that vLLM needs on.
_DEADLINE_DEFAULT_S = 120.0
_KEYS = frozenset(
    {
        "backend",
        "backend_options",
        "host",
        "port",
        "auth_key",
        "unrequested_timeout_s",
        "transfer_timeout_s",
        "conformance",
        "drain_grace_s",
        *_CONFIG_NUMBERS,
        *_OWNER_FENCE_NUMBERS,
    }
)


class SettingsError(ValueError):
    """``kv_connector_extra_config`` holds something kvconn cannot use."""


@attrs.frozen
class Settings:
    """``backend``: a kvconn transport plugin (``kvconn backends`` lists them).
    ``unrequested_timeout_s``: how long prefill keeps a finished request's
    blocks for a decode that has not asked for them yet. Nothing was written
    from them then, so giving them back is safe; a decode that asks later is
    told the room failed and recomputes. ``transfer_timeout_s`` becomes
    ``config.transfer_timeout_s`` (kvconn's per-room deadline at decode):
    a room not received that long after decode asked for it fails and is
    aborted, its blocks come back with proof only, and the request is
    recomputed (vLLM's load-failure path). ``drain_grace_s``: at shutdown
    the worker drains (docs/engine-integration.md, "Draining"): a prefill
    rank refuses new rooms and gives those it holds this long to complete;
    a decode endpoint aborts what is left and waits this long for the proofs."""

    backend: str = "loopback"
    config: Config = attrs.field(factory=lambda: Config(transfer_timeout_s=_DEADLINE_DEFAULT_S))
    unrequested_timeout_s: float = _DEADLINE_DEFAULT_S
    #: Run kvconn's conformance suite on the transport at start-up (see
    #: :mod:`kvconn_vllm.conformance`).
    conformance: bool = False
    drain_grace_s: float = 10.0

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise SettingsError(
                f"unknown kv_connector_extra_config keys {unknown}; kvconn reads {sorted(_KEYS)}"
            )
        backend = extra.get("backend", "loopback")
        if not isinstance(backend, str) or not backend:
            raise SettingsError(f"backend must be a plugin name, got {backend!r}")
        options = extra.get("backend_options", {})
        if not isinstance(options, Mapping):
            raise SettingsError(f"backend_options must be a mapping of strings, got {options!r}")
        fields: dict[str, Any] = {"backend_options": {str(k): str(v) for k, v in options.items()}}
        for key in (*_CONFIG_NUMBERS, *_OWNER_FENCE_NUMBERS):
            if key in extra:
                fields[key] = _number(key, extra[key])
        if "host" in extra:
            fields["host"] = str(extra["host"])
        if "port" in extra:
            fields["port"] = int(_number("port", extra["port"]))
        if "auth_key" in extra:
            fields["auth_key"] = str(extra["auth_key"]).encode()
        timeouts = {}
        for key in ("unrequested_timeout_s", "transfer_timeout_s"):
            timeouts[key] = _number(key, extra.get(key, _DEADLINE_DEFAULT_S))
            if timeouts[key] <= 0:
                raise SettingsError(f"{key} must be > 0, got {timeouts[key]}")
        fields["transfer_timeout_s"] = timeouts["transfer_timeout_s"]
        try:
            config = Config(**fields)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"kv_connector_extra_config: {exc}") from None
        conformance = extra.get("conformance", False)
        if not isinstance(conformance, bool):
            raise SettingsError(f"conformance must be true or false, got {conformance!r}")
        grace = _number("drain_grace_s", extra.get("drain_grace_s", 10.0))
        if grace < 0:
            raise SettingsError(f"drain_grace_s must be >= 0, got {grace}")
        return cls(backend, config, timeouts["unrequested_timeout_s"], conformance, grace)


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise SettingsError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise SettingsError(f"{key} must be a number, got {value!r}") from None
