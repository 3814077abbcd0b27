"""Byte sizes as people write them on a command line and read them in a table."""

from __future__ import annotations

import argparse
import re

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB}
_SIZE = re.compile(r"\s*(\d+)\s*([a-z]*)\s*")


def parse_size(text: str) -> int:
    """``65536``, ``64KiB``, ``256 MiB`` or ``1GiB`` as a number of bytes.

    Decimal units (``MB``) are refused rather than guessed: the tables print
    binary ones, and 1 MB and 1 MiB differ by 5%.
    """
    m = _SIZE.fullmatch(text.lower())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size: a whole number of bytes, or of KiB, MiB or GiB (e.g. 256MiB)"
        )
    return int(m.group(1)) * _UNITS[m.group(2)]


def size_arg(text: str) -> int:
    """:func:`parse_size` as an argparse ``type``: its message, not argparse's own."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(n: int) -> str:
    """The largest binary unit that divides ``n``: ``1 MiB``, ``4 KiB``, ``100 B``."""
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"
