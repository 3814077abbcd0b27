"""What a look at a writer's pid proves is the core's decision
(``protocol.liveness.exit_proven``): the runtime only reports what its
``/proc`` shows. Across hosts a writer's exit proves nothing."""

from __future__ import annotations

import pytest

from kvconn.protocol.endpoint_events import WriterIdentity
from kvconn.protocol.liveness import PidSeen, exit_proven, pid_names_writer

HERE = "boot-a/pid:[4026531836]"
WRITER = WriterIdentity("tcp://10.0.0.2:5000", HERE, pid=1234, start_time=777, session=1)


def other(pid_namespace: str) -> WriterIdentity:
    return WriterIdentity(WRITER.address, pid_namespace, WRITER.pid, WRITER.start_time, WRITER.session)


@pytest.mark.parametrize(
    ("seen", "proven"),
    [
        (PidSeen.free(), True),  # no process has the pid
        (PidSeen.process("S", 778), True),  # the pid was reused by another process
        (PidSeen.process("Z", 777), True),  # the writer is a zombie: it runs no more
        (PidSeen.process("X", 777), True),
        (PidSeen.process("S", 777), False),  # it runs
        (PidSeen.process("T", 777), False),  # it is stopped, not gone
        (PidSeen.unreadable(), False),  # /proc could not tell
    ],
)
def test_in_decodes_own_pid_namespace_the_pid_decides(seen: PidSeen, proven: bool) -> None:
    assert pid_names_writer(WRITER, HERE)
    assert exit_proven(WRITER, HERE, seen) is proven


@pytest.mark.parametrize(
    ("writer", "local"),
    [
        (other("boot-b/pid:[4026531836]"), HERE),  # another machine (another boot)
        (other("boot-a/pid:[4026532000]"), HERE),  # another pid namespace (a host of kvconn.testing.hosts)
        (other(""), HERE),  # the writer could not say where its pids are
        (WRITER, ""),  # nor could decode
    ],
)
def test_a_writer_elsewhere_is_never_proven_gone_whatever_the_pid_shows(
    writer: WriterIdentity, local: str
) -> None:
    assert not pid_names_writer(writer, local)
    for seen in (PidSeen.free(), PidSeen.process("Z", 777), PidSeen.process("S", 1)):
        assert not exit_proven(writer, local, seen)


def test_the_runtime_reads_proc_only_where_the_pid_names_the_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``runtime.procs.proven_gone`` asks the core; a writer on another host
    costs no ``/proc`` read at all (its pid would name someone else)."""
    from kvconn.runtime import procs

    looked: list[int] = []

    def pid_seen(pid: int) -> PidSeen:
        looked.append(pid)
        return PidSeen.free()

    monkeypatch.setattr(procs, "pid_seen", pid_seen)
    assert not procs.proven_gone(other("boot-b/pid:[1]"), HERE)
    assert looked == []
    assert procs.proven_gone(WRITER, HERE)
    assert looked == [WRITER.pid]
