"""What the operator sets for kvconn under SGLang: environment variables read
in every scheduler process (SGLang builds the transfer classes itself, so
there is no constructor argument to carry them)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from kvconn.config import Config
from kvconn.options import OptionError, parse_key_values

PREFIX = "KVCONN_SGLANG_"


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


@attrs.frozen(slots=True)
class Settings:
    """``transport``: the kvconn backend (``kvconn backends`` lists them).
    ``port_base``: prefill rank r listens at ``port_base + r`` (0: any free
    port, logged). ``KVCONN_SGLANG_BACKEND_OPTIONS`` (``k=v,k=v``) go to
    the transport. ``memory``: "dram" or "vram", the kind of SGLang's KV pool.
    ``drain_grace_s`` (``KVCONN_SGLANG_DRAIN_GRACE_S``): how long a drain at
    teardown or SIGTERM gives held rooms to complete (a decode endpoint:
    how long it waits for the proofs of what it aborts). ``drain_on_sigterm``
    (``KVCONN_SGLANG_DRAIN_ON_SIGTERM=1``): a scheduler process that gets
    SIGTERM (a group-wide stop; SGLang's own stop sends it none) drains
    before it exits.

    Two of SGLang's own deadlines become kvconn's, as SGLang's backends apply
    them: ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (300 s) is the
    prefill's ``room_bootstrap_timeout_s`` (a request whose decode never asks
    fails, and a late ask is refused, nothing written), and
    ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s) decode's
    ``transfer_timeout_s`` (a room not filled that long after it asked fails,
    its pages back only with proof)."""

    transport: str
    host: str
    port_base: int
    memory: str
    config: Config
    drain_grace_s: float = 10.0
    drain_on_sigterm: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        host = environ.get(PREFIX + "HOST", "127.0.0.1")
        config = Config(
            write_timeout_s=_number(environ, "WRITE_TIMEOUT_S", 5.0),
            abort_timeout_s=_number(environ, "ABORT_TIMEOUT_S", 30.0),
            resend_interval_s=_number(environ, "RESEND_INTERVAL_S", 1.0),
            # SGLang's own deadlines, as its backends apply them: a prefill
            # request whose decode never asks, a decode request never filled.
            room_bootstrap_timeout_s=_sglang_number(environ, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300),
            transfer_timeout_s=_sglang_number(environ, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300),
            host=host,
            backend_options=_options(environ.get(PREFIX + "BACKEND_OPTIONS", "")),
        )
        memory = environ.get(PREFIX + "MEMORY", "")
        if memory not in ("", "dram", "vram"):
            raise SettingsError(f"{PREFIX}MEMORY must be dram or vram, got {memory!r}")
        return cls(
            transport=environ.get(PREFIX + "TRANSPORT", "loopback"),
            host=host,
            port_base=int(_number(environ, "PORT_BASE", 0)),
            memory=memory or _default_memory(),
            config=config,
            drain_grace_s=_grace(environ),
            drain_on_sigterm=_flag(environ, "DRAIN_ON_SIGTERM"),
        )


def _sglang_number(environ: Mapping[str, str], name: str, default: float) -> float:
    """One of SGLang's own settings (its ``envs``), read as SGLang reads it."""
    raw = environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {raw!r}") from None
    if value <= 0:
        raise SettingsError(f"{name} must be > 0, got {value}")
    return value


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


def _options(text: str) -> dict[str, str]:
    """``key=value,key=value``: options passed to the kvconn transport."""
    items = filter(None, (i.strip() for i in text.split(",")))
    try:
        return parse_key_values(items, f"{PREFIX}BACKEND_OPTIONS")
    except OptionError as exc:
        raise SettingsError(str(exc)) from None


def _default_memory() -> str:
    try:
        import torch
    except ImportError:
        return "dram"
    return "vram" if torch.cuda.is_available() else "dram"


__all__ = ["PREFIX", "Settings", "SettingsError"]
