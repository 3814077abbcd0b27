"""Byte sizes as people write them on a command line and read them in a table."""

from __future__ import annotations

import argparse
import os
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


def approx_size(n: float) -> str:
    """``n`` bytes to three figures in the largest binary unit: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room() -> int | None:
    """Bytes this process's memory cgroup (v2 or v1) still admits, if it has a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            root, limit_file, usage_file = "/sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            root, limit_file, usage_file = (
                "/sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        for folder in (f"{root}{path}", root):
            limit, usage = _read_int(f"{folder}/{limit_file}"), _read_int(f"{folder}/{usage_file}")
            if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes "no limit" as ~2^63
                return max(0, limit - usage)
    return None


def memory_available(shared: bool = False) -> tuple[int, str]:
    """Bytes of memory a run may still take here, and what bounds them: the
    kernel's estimate (MemAvailable), a memory cgroup's limit, the address
    space limit (``ulimit -v``), and with ``shared`` the free space of
    /dev/shm (where shared memory lives). Linux; elsewhere (nothing to
    read) no bound: ``(2**63, "")``."""
    bounds: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    bounds.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError):
        pass
    room = _cgroup_room()
    if room is not None:
        bounds.append((room, "its memory cgroup"))
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            bounds.append((max(0, soft - used), "ulimit -v"))
    except (ImportError, OSError, ValueError):
        pass
    if shared:
        try:
            st = os.statvfs("/dev/shm")
            bounds.append((st.f_bavail * st.f_frsize, "free in /dev/shm"))
        except OSError:
            pass
    return min(bounds, default=(1 << 63, ""))
