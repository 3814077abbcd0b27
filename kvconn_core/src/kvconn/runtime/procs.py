"""Naming a process for good, and proving it gone (Linux ``/proc``)."""

from __future__ import annotations

import os
import time

import attrs

from kvconn.protocol.endpoint_events import WriterIdentity as WriterIdentityBase
from kvconn.protocol.liveness import PidSeen, exit_proven, pid_names_writer
from kvconn.protocol.messages import HelloAck


def proc_stat(pid: int, task_of: int | None = None) -> tuple[str, int]:
    """``pid``'s state letter and kernel start time (clock ticks since boot);
    with ``task_of``, those of thread ``pid`` of process ``task_of``.

    With the pid, the start time names one process for good, so a reused pid
    is not mistaken for it. Raises ``FileNotFoundError`` if no such pid runs.

    The kernel shows the start time shifted by the reader's time namespace
    boot-time offset: it is taken back off, so that two processes whose
    clocks disagree (``unshare --time``) still name a process alike.
    """
    path = f"/proc/{pid}/stat" if task_of is None else f"/proc/{task_of}/task/{pid}/stat"
    with open(path, "rb") as f:
        stat = f.read()
    # comm (field 2) may hold spaces and parentheses: fields resume after the last ")"
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19]) - _boottime_offset_ticks()


def _boottime_offset_ticks() -> int:
    """This process's time namespace boot-time offset, in clock ticks (0
    where the kernel has no time namespaces)."""
    try:
        with open("/proc/self/timens_offsets") as f:
            for line in f:
                name, secs, nsecs = line.split()
                if name == "boottime":
                    return (int(secs) * 10**9 + int(nsecs)) * os.sysconf("SC_CLK_TCK") // 10**9
    except (OSError, ValueError):
        pass
    return 0


def pid_namespace() -> str:
    """Where this process's pids mean what they say: this boot of this
    machine's kernel and this pid namespace ("<boot id>/pid:[<inode>]"), or
    "" when that cannot be told. A pid checked in ``/proc`` names the same
    process only for processes whose names are equal and not empty.

    A hostname does not do: containers that share the host's network (and
    so its name) have pid namespaces of their own, where a live writer is
    pid 1 and decode's ``/proc`` shows someone else, or no one, there."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.readlink("/proc/self/ns/pid")
        # A /proc mounted for a parent namespace shows other pids than ours.
        if os.readlink("/proc/self") != str(os.getpid()):
            return ""
    except OSError:
        return ""
    return f"{boot}/{ns}" if boot else ""


def all_threads_stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped. A SIGSTOP stops the threads
    of a process one by one: the leader's state alone can say "stopped" while
    another thread still runs."""
    try:
        states = [proc_stat(int(tid), task_of=pid)[0] for tid in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return False
    return bool(states) and all(state in ("T", "t") for state in states)


def wait_until_stopped(pid: int, timeout: float = 5.0) -> None:
    """After a SIGSTOP: return once every thread of ``pid`` is stopped."""
    deadline = time.monotonic() + timeout
    while not all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped within {timeout} s")
        time.sleep(0.001)


@attrs.frozen(slots=True)
class WriterIdentity(WriterIdentityBase):
    """A prefill rank's process, as it announced itself, with the ``/proc``
    checks that make its identity a proof."""

    @classmethod
    def announced(cls, msg: HelloAck) -> WriterIdentity:
        """The identity a HelloAck announces, with its pid check kept only if
        this process sees that pid in ``/proc`` as announced (pid and start
        time): ``/proc`` mounted hidepid=2, or another namespace after all,
        would make a live writer's pid look free."""
        try:
            seen = proc_stat(msg.pid)[1] == msg.start_time
        except (OSError, ValueError, IndexError):
            seen = False
        namespace = msg.pid_namespace if seen else ""
        return cls(msg.address, namespace, msg.pid, msg.start_time, msg.session)

    def proven_gone(self, local_pid_namespace: str) -> bool:
        return proven_gone(self, local_pid_namespace)


def pid_seen(pid: int) -> PidSeen:
    """What this process's ``/proc`` shows at ``pid`` (the probe the core's
    :func:`~kvconn.protocol.liveness.exit_proven` decides on)."""
    try:
        state, start_time = proc_stat(pid)
    except FileNotFoundError:
        return PidSeen.free()
    except (OSError, ValueError, IndexError):
        return PidSeen.unreadable()
    return PidSeen.process(state, start_time)


def proven_gone(writer: WriterIdentityBase, local_pid_namespace: str) -> bool:
    """True only when this very process certainly no longer runs (the rule is
    the core's :func:`~kvconn.protocol.liveness.exit_proven`); ``/proc`` is
    read only where its pids name the writer, never for one on another host."""
    if not pid_names_writer(writer, local_pid_namespace):
        return False  # elsewhere only decode's owner fence stands for an exit
    return exit_proven(writer, local_pid_namespace, pid_seen(writer.pid))
