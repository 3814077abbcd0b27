"""The proven-exit check trusts a pid only where it names the writer."""

from __future__ import annotations

import os
import subprocess
import sys

from kvconn.protocol.messages import HelloAck
from kvconn.runtime.decode import WriterIdentity
from kvconn.runtime.procs import pid_namespace, proc_stat


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_free_pid_proves_an_exit_only_in_our_own_pid_namespace() -> None:
    here = pid_namespace()
    assert here  # Linux with /proc: boot id and pid namespace are readable
    pid = _exited_pid()
    assert WriterIdentity("a", here, pid, 1, 0).proven_gone(here)
    assert not WriterIdentity("a", here + "x", pid, 1, 0).proven_gone(here)  # other namespace or boot
    assert not WriterIdentity("a", "", pid, 1, 0).proven_gone(here)  # the writer could not tell
    assert not WriterIdentity("a", here, pid, 1, 0).proven_gone("")  # nor could decode


def test_a_writer_its_pid_does_not_show_as_announced_is_never_checked() -> None:
    """/proc mounted hidepid=2 hides other users' pids: a live writer would
    look gone. Decode keeps the pid check only if it sees the writer there
    as the writer announced itself (pid and start time)."""
    here, me = pid_namespace(), os.getpid()
    start = proc_stat(me)[1]
    seen = WriterIdentity.announced(HelloAck(0, "a", here, me, start, "", 7))
    assert seen.pid_namespace == here and seen.session == 7
    hidden = WriterIdentity.announced(HelloAck(0, "a", here, _exited_pid(), start, "", 7))
    assert hidden.pid_namespace == "" and not hidden.proven_gone(here)
    other = WriterIdentity.announced(HelloAck(0, "a", here, me, start + 1, "", 7))  # pid reused
    assert other.pid_namespace == ""
