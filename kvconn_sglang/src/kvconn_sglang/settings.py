"""What the operator sets for kvconn under SGLang: environment variables read
in every scheduler process (SGLang builds the transfer classes itself, so
there is no constructor argument to carry them).

Every field of kvconn's :class:`~kvconn.config.Config` is a variable:
``KVCONN_SGLANG_`` and the field's name in upper case
(``KVCONN_SGLANG_PEER_TIMEOUT_S``, ``KVCONN_SGLANG_TRACING``), read by
:mod:`kvconn.config_values` from Config's own fields, except ``port``
(``KVCONN_SGLANG_PORT_BASE`` here: one port per TP rank). Then the
adapter's own (:data:`ADAPTER`). Any other ``KVCONN_SGLANG_*`` variable is
refused, naming the closest known one: a typo must not leave a deadline at
its default. ``KVCONN_SGLANG_TEST_*`` is kvconn's test harness's, not read here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from kvconn.config import Config
from kvconn.config_values import ConfigValueError, config_from, config_keys, unknown_key_error

PREFIX = "KVCONN_SGLANG_"
#: Variables of kvconn's tests (``KVCONN_SGLANG_TEST_DEVICE``), not settings.
TEST_PREFIX = PREFIX + "TEST_"
#: The adapter's own variables (``HOST`` is both: Config's and the address registered).
ADAPTER = ("TRANSPORT", "PORT_BASE", "MEMORY", "DRAIN_GRACE_S", "DRAIN_ON_SIGTERM", "TRACE_FILE")
#: Config fields the adapter sets itself.
NOT_FROM_ENV = frozenset({"port"})


class SettingsError(ValueError):
    """A KVCONN_SGLANG_* variable that cannot be used."""


def _number(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SettingsError(f"{PREFIX}{name} must be a number, got {raw!r}") from None


def _config_names() -> dict[str, str]:
    """Variable suffix -> Config field, for every field read from the environment."""
    return {key.upper(): key for key in config_keys() if key not in NOT_FROM_ENV}


@attrs.frozen(slots=True)
class Settings:
    """``transport``: the kvconn backend (``kvconn backends`` lists them).
    ``port_base``: prefill rank r listens at ``port_base + r`` (0: any free
    port, logged). ``config``: kvconn's Config, every field from its
    ``KVCONN_SGLANG_<FIELD>`` variable (``KVCONN_SGLANG_BACKEND_OPTIONS``,
    ``k=v,k=v``, go to the transport). ``memory``: "dram" or "vram", the
    kind of SGLang's KV pool. ``drain_grace_s``
    (``KVCONN_SGLANG_DRAIN_GRACE_S``): how long a drain at teardown or
    SIGTERM gives held rooms to complete (a decode endpoint: how long it
    waits for the proofs of what it aborts). ``drain_on_sigterm``
    (``KVCONN_SGLANG_DRAIN_ON_SIGTERM=1``): a scheduler process that gets
    SIGTERM (a group-wide stop; SGLang's own stop sends it none) drains
    before it exits. ``trace_file`` (``KVCONN_SGLANG_TRACE_FILE``): with
    ``KVCONN_SGLANG_TRACING=1``, every scheduler process appends its spans
    to this file as JSON lines (:mod:`kvconn.runtime.trace_export`); unset,
    spans go to the process's own OpenTelemetry tracer provider."""

    transport: str
    host: str
    port_base: int
    memory: str
    config: Config
    drain_grace_s: float = 10.0
    drain_on_sigterm: bool = False
    trace_file: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        fields = _config_names()
        values: dict[str, str] = {}
        for name, raw in environ.items():
            if not name.startswith(PREFIX) or name.startswith(TEST_PREFIX):
                continue
            suffix = name.removeprefix(PREFIX)
            if suffix in fields:
                if raw != "":  # an empty variable is an unset one
                    values[fields[suffix]] = raw
            elif suffix not in ADAPTER:
                known = [PREFIX + k for k in (*fields, *ADAPTER)]
                raise SettingsError(str(unknown_key_error(name, known, "kvconn_sglang variable")))
        try:
            config = config_from(values, lambda key: PREFIX + key.upper())
        except ConfigValueError as exc:
            raise SettingsError(str(exc)) from None
        memory = environ.get(PREFIX + "MEMORY", "")
        if memory not in ("", "dram", "vram"):
            raise SettingsError(f"{PREFIX}MEMORY must be dram or vram, got {memory!r}")
        return cls(
            transport=environ.get(PREFIX + "TRANSPORT", "loopback"),
            host=config.host,
            port_base=int(_number(environ, "PORT_BASE", 0)),
            memory=memory or _default_memory(),
            config=config,
            drain_grace_s=_grace(environ),
            drain_on_sigterm=_flag(environ, "DRAIN_ON_SIGTERM"),
            trace_file=environ.get(PREFIX + "TRACE_FILE") or None,
        )


def _grace(environ: Mapping[str, str]) -> float:
    grace = _number(environ, "DRAIN_GRACE_S", 10.0)
    if grace < 0:
        raise SettingsError(f"{PREFIX}DRAIN_GRACE_S must be >= 0, got {grace}")
    return grace


def _flag(environ: Mapping[str, str], name: str) -> bool:
    raw = environ.get(PREFIX + name, "")
    if raw not in ("", "0", "1"):
        raise SettingsError(f"{PREFIX}{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


def _default_memory() -> str:
    try:
        import torch
    except ImportError:
        return "dram"
    return "vram" if torch.cuda.is_available() else "dram"


__all__ = ["ADAPTER", "PREFIX", "Settings", "SettingsError"]
