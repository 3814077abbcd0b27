"""Backend options, read the way a user expects them to be read.

``Config.backend_options`` holds strings: they come from command lines
(``--backend-option KEY=VALUE``) and config files. A plugin reads them through
:class:`BackendOptions`, which checks each value's type and bounds once, names
the backend and the option in every error, and refuses keys the plugin does
not know: a mistyped option fails when the region or writer opens, instead of
being ignored while the default silently applies.

::

    KNOWN = frozenset({"piece_bytes", "hot_poll_s"})

    def __init__(self, nbytes: int, options: Mapping[str, str]) -> None:
        opts = BackendOptions("mybackend", options, KNOWN)
        self.piece_bytes = opts.integer("piece_bytes", 1 << 18, low=1)
        self.hot_poll_s = opts.seconds_or_none("hot_poll_s", 0.002)

Every place a user writes options as ``KEY=VALUE`` items (``kvconn bench
--backend-option``, ``kvconn conformance -o``, pytest's ``--kvconn-option``,
``KVCONN_SGLANG_BACKEND_OPTIONS``) reads them with :func:`parse_key_values`,
so one rule holds everywhere:

* an item is split at its first ``=``: the value may hold ``=`` itself
  (``url=http://h/?a=b``) and may be empty (``key=``);
* blanks around the key and the value are dropped, the key must not be empty;
* a key given twice is refused, naming both values: on one command line two
  values of one key are a mistake to point out, not one to settle silently
  by their order.

Where several items share one string (``KVCONN_SGLANG_BACKEND_OPTIONS``,
``k=v,k=v``), :func:`split_key_values` splits it at the commas that begin
a new ``KEY=`` item, so a value may hold commas itself:
``freeze_chunks=0:7:0,0:8:1,piece_bytes=4096`` is two items, the first
with two ``rank:room:index`` entries.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TypeVar

from kvconn.errors import KvconnError

__all__ = ["BackendOptions", "OptionError", "parse_key_values", "split_key_values"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_NONE = frozenset({"", "none"})
_N = TypeVar("_N", int, float)


class OptionError(KvconnError, ValueError):
    """A backend option is unknown, or its value does not parse or is out of
    bounds, or a ``KEY=VALUE`` item is malformed. (Also a ValueError: what
    this raised before.)"""


def parse_key_values(items: Iterable[str], what: str) -> dict[str, str]:
    """``KEY=VALUE`` items as a mapping, read by the rule in this module's
    docstring; ``what`` names where they came from (``--backend-option``) in
    every error."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise OptionError(f"{what} wants KEY=VALUE, got {item!r}")
        if key in out:
            raise OptionError(f"{what}: {key!r} given twice ({key}={out[key]!r} and {key}={value!r})")
        out[key] = value
    return out


#: A comma that starts a new item (followed by ``KEY=``, blanks allowed
#: around; or by a bare ``=``, an item with no key, refused) or ends the
#: text (a trailing comma).
_ITEM_START = re.compile(r",(?=\s*(?:(?:[A-Za-z_][A-Za-z0-9_.-]*)?\s*=|$))")


def split_key_values(text: str, what: str) -> dict[str, str]:
    """``k=v,k=v`` text as a mapping: items split at the commas followed by
    ``KEY=`` (a comma followed by anything else stays in the value), each
    read by :func:`parse_key_values`; blank items are skipped."""
    items = [item for item in _ITEM_START.split(text) if item.strip()]
    return parse_key_values(items, what)


class BackendOptions:
    """``options`` of the backend ``backend``, which reads the keys ``known``
    (all of them, for regions and writers alike: one mapping reaches both)."""

    def __init__(self, backend: str, options: Mapping[str, str], known: Collection[str]) -> None:
        self.backend = backend
        self._options = options
        for key, value in options.items():
            if not isinstance(value, str):
                raise OptionError(
                    f"{backend} option {key}={value!r}: values are strings (as on a command line)"
                )
        unknown = sorted(set(options) - set(known))
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise OptionError(
                f"unknown {backend} option {key!r}{hint}; {backend} options: {', '.join(sorted(known)) or 'none'}"
            )

    def text(self, key: str, default: str = "") -> str:
        """The value, stripped of surrounding blanks."""
        return self._options.get(key, default).strip()

    def choice(self, key: str, default: str, choices: Collection[str]) -> str:
        """One of ``choices`` (compared in lower case)."""
        value = self.text(key, default).lower()
        if value not in choices:
            raise self._error(key, f"one of {', '.join(sorted(choices))}")
        return value

    def integer(self, key: str, default: int, low: int | None = None, high: int | None = None) -> int:
        """A decimal integer within ``[low, high]``."""
        return self._read(key, default, int, "an integer", low, high)

    def number(self, key: str, default: float, low: float | None = None, high: float | None = None) -> float:
        """A finite number within ``[low, high]`` (seconds, fractions)."""
        return self._read(key, default, _finite, "a finite number", low, high)

    def seconds_or_none(self, key: str, default: float | None) -> float | None:
        """Seconds (``>= 0``), or ``None`` for ``none`` or an empty value:
        for limits whose absence means "no limit"."""
        raw = self._options.get(key)
        if raw is None:
            return default
        if raw.strip().lower() in _NONE:
            return None
        return self.number(key, 0.0, low=0.0)

    def flag(self, key: str, default: bool = False) -> bool:
        """``1/true/yes/on`` or ``0/false/no/off`` (an empty value: off)."""
        raw = self._options.get(key)
        if raw is None:
            return default
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise self._error(key, "a flag: 1/true/yes/on or 0/false/no/off")

    def _read(
        self,
        key: str,
        default: _N,
        convert: Callable[[str], _N],
        wanted: str,
        low: _N | None,
        high: _N | None,
    ) -> _N:
        raw = self._options.get(key)
        if raw is None:
            return default
        try:
            value = convert(raw.strip())
        except ValueError:
            raise self._error(key, wanted) from None
        if low is not None and value < low:
            raise self._error(key, f"at least {low}")
        if high is not None and value > high:
            raise self._error(key, f"at most {high}")
        return value

    def _error(self, key: str, wanted: str) -> OptionError:
        return OptionError(f"{self.backend} option {key}={self._options.get(key)!r}: expected {wanted}")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value
