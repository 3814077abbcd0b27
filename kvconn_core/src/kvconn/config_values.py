"""Every :class:`~kvconn.config.Config` field, set from an engine's own
configuration: vLLM's ``kv_connector_extra_config`` (JSON values) and
SGLang's ``KVCONN_SGLANG_*`` environment variables (strings).

The keys are Config's own field names, read from the class itself, and each
value is converted by its field's type, so a field added to Config is
settable from every engine at once (a field of a type this module cannot
convert fails :func:`check_convertible`, which the tests call, rather than
being silently left out). Conversion:

* ``float`` / ``int``: a number, or a string that parses as one (no
  booleans; floats must be finite);
* ``bool``: ``true``/``false``, or ``1/true/yes/on`` and ``0/false/no/off``;
* ``X | None``: ``null``, or an empty string or ``none``, gives None;
* ``bytes`` (``auth_key``): a string, as UTF-8;
* ``Mapping[str, str]`` (``backend_options``): a mapping, or ``k=v,k=v``
  text read by :func:`kvconn.options.split_key_values`.

Every error names the key where the operator wrote it (``where`` plus the
key: ``KVCONN_SGLANG_PEER_TIMEOUT_S``), and an unknown key is refused with
the closest known one.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

import attrs

from kvconn.config import Config
from kvconn.errors import KvconnError
from kvconn.options import OptionError, split_key_values

__all__ = ["ConfigValueError", "check_convertible", "config_from", "config_keys", "unknown_key_error"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})


class ConfigValueError(KvconnError, ValueError):
    """A configuration key is unknown, or its value does not fit its field."""


def config_keys() -> tuple[str, ...]:
    """Config's field names, in the order Config declares them."""
    return tuple(field.name for field in attrs.fields(Config))


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def _number(kind: type, name: str, raw: object) -> float | int:
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ConfigValueError(f"{name} must be a number, got {raw!r}")
    try:
        value: float | int = kind(raw.strip()) if isinstance(raw, str) else kind(raw)
    except ValueError:
        raise ConfigValueError(f"{name} must be a number, got {raw!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigValueError(f"{name} must be a finite number, got {raw!r}")
    if kind is int and isinstance(raw, float) and raw != value:
        raise ConfigValueError(f"{name} must be an integer, got {raw!r}")
    return value


def _flag(name: str, raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower() if isinstance(raw, str | int) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigValueError(f"{name} must be true or false (1/true/yes/on, 0/false/no/off), got {raw!r}")


def _text(name: str, raw: object) -> str:
    if not isinstance(raw, str):
        raise ConfigValueError(f"{name} must be a string, got {raw!r}")
    return raw


def _key(name: str, raw: object) -> bytes:
    if isinstance(raw, bytes):
        return raw
    return _text(name, raw).encode()


def _mapping(name: str, raw: object) -> dict[str, str]:
    if isinstance(raw, str):
        try:
            return split_key_values(raw, name)
        except OptionError as exc:
            raise ConfigValueError(str(exc)) from None
    if not isinstance(raw, Mapping):
        raise ConfigValueError(f"{name} must be a mapping of strings, got {raw!r}")
    return {str(k): str(v) for k, v in raw.items()}


def _converter(hint: Any) -> Callable[[str, object], object] | None:
    """How to read a value of type ``hint``; None: no way known."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        read = _converter(inner)
        if read is None:
            return None

        def optional(name: str, raw: object) -> object:
            if raw is None or (isinstance(raw, str) and raw.strip().lower() in _NONE):
                return None
            return read(name, raw)

        return optional
    if hint is bool:
        return _flag
    if hint in (int, float):
        return lambda name, raw: _number(hint, name, raw)
    if hint is str:
        return _text
    if hint is bytes:
        return _key
    if typing.get_origin(hint) in (Mapping, dict, typing.Mapping) and args == (str, str):
        return _mapping
    return None


def check_convertible() -> None:
    """Raise TypeError naming any Config field whose type this module cannot
    read: a field added to Config must be settable from every engine."""
    hints = _hints()
    missing = [name for name in config_keys() if _converter(hints[name]) is None]
    if missing:
        raise TypeError(
            f"kvconn.config_values cannot read Config fields {missing} (types {[hints[m] for m in missing]})"
        )


def unknown_key_error(key: str, known: Collection[str], what: str) -> ConfigValueError:
    """The error for an unknown ``key``, naming the closest of ``known`` and
    listing them all (each as the operator writes it); ``what`` names the
    kind (``kv_connector_extra_config key``)."""
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigValueError(f"unknown {what} {key}{hint}; known: {', '.join(sorted(known))}")


def config_from(
    values: Mapping[str, object],
    written: Callable[[str], str] = str,
    base: Config | None = None,
) -> Config:
    """``base`` (default ``Config()``) with the fields ``values`` names set
    (keys: Config's field names; an unknown one is refused). ``written``
    gives each key as the operator wrote it, for errors (SGLang's:
    ``KVCONN_SGLANG_`` and the name upper-cased). Config's own checks (a
    write deadline shorter than the abort deadline, ...) run on the result."""
    hints = _hints()
    fields: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in hints:
            raise unknown_key_error(written(key), [written(k) for k in hints], "kvconn setting")
        read = _converter(hints[key])
        assert read is not None, "check_convertible() fails for this field"
        fields[key] = read(written(key), raw)
    try:
        return attrs.evolve(base or Config(), **fields)
    except (TypeError, ValueError) as exc:
        raise ConfigValueError(str(exc)) from None
