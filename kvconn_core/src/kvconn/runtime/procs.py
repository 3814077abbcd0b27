"""Naming a process for good, and proving it gone (Linux ``/proc``)."""

from __future__ import annotations


def proc_stat(pid: int) -> tuple[str, int]:
    """``pid``'s state letter and kernel start time (clock ticks since boot).

    With the pid, the start time names one process for good, so a reused pid
    is not mistaken for it. Raises ``FileNotFoundError`` if no such pid runs.
    """
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # comm (field 2) may hold spaces and parentheses: fields resume after the last ")"
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])
