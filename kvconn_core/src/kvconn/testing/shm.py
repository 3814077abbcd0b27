"""Shared-memory files a killed process group leaves in ``/dev/shm``.

A process killed with SIGKILL cannot unlink its POSIX semaphores and
shared-memory segments (Python multiprocessing's ``sem.mp-*``, SGLang's
``sglang_loads_*``): they stay in ``/dev/shm``, in RAM, until someone
removes them. A test or script that kills an engine's process group lists
what the group holds just before (:func:`held_by_group`) and removes, once
the group is gone, those no process holds any more (:func:`remove_unheld`):
nothing it did not see its own processes use, nothing still in use. A
run of many engines, some of which exit or are killed outside that path
(an engine's own subprocesses in groups of their own), also removes, at
its end, the engines' files made since it began that no process holds
(:func:`engine_files`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

SHM = "/dev/shm/"
#: What engines leave: Python multiprocessing's semaphores, SGLang's segments.
ENGINE_PREFIXES = ("sem.mp-", "sglang_")


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _group_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2 :].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def held_by(pids: Iterable[int]) -> set[Path]:
    """The ``/dev/shm`` files these processes map or have open."""
    held: set[Path] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith(SHM) and not path.endswith(" (deleted)"):
                    held.add(Path(path))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(SHM) and not target.endswith(" (deleted)"):
                        held.add(Path(target))
    return held


def held_by_group(pgid: int) -> set[Path]:
    """The ``/dev/shm`` files the processes of group ``pgid`` hold now."""
    return held_by(pid for pid in _pids() if _group_of(pid) == pgid)


def remove_unheld(paths: Iterable[Path]) -> list[Path]:
    """Remove those of ``paths`` that no process holds any more; the ones removed."""
    wanted = set(paths)
    if not wanted:
        return []
    still = held_by(_pids())
    removed = []
    for path in sorted(wanted - still):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def engine_files() -> set[Path]:
    """The engines' files in ``/dev/shm`` now (:data:`ENGINE_PREFIXES`):
    what a run takes before it starts, and again at its end, to
    :func:`remove_unheld` those made meanwhile."""
    try:
        names = os.listdir(SHM)
    except OSError:
        return set()
    return {Path(SHM, name) for name in names if name.startswith(ENGINE_PREFIXES)}
