"""The proven-exit check trusts a pid only where it names the writer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def _time_namespaces() -> str:
    """Why a process cannot be given clocks of its own here ("" if it can)."""
    if os.geteuid() != 0:
        return "needs root for unshare --time"
    done = subprocess.run(["unshare", "--time", "--boottime=1000000", "true"], capture_output=True, text=True)
    return "" if done.returncode == 0 else f"unshare --time refused: {done.stderr.strip()}"


@pytest.mark.skipif(bool(_time_namespaces()), reason=_time_namespaces() or "n/a")
def test_a_writer_whose_boot_clock_is_far_off_announces_the_start_time_decode_sees() -> None:
    """The kernel shifts a /proc start time by the reader's boot-time offset:
    a rank in a time namespace 10^6 s ahead must still announce the start
    time decode reads for its pid, or decode drops the pid check for it."""
    code = "import os; from kvconn.runtime.procs import proc_stat; print(proc_stat(os.getpid())[1], flush=True); input()"
    child = subprocess.Popen(
        ["unshare", "--time", "--boottime=1000000", "--monotonic=1000000", sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        announced = int(child.stdout.readline())
        assert announced == proc_stat(child.pid)[1]
        seen = WriterIdentity.announced(HelloAck(0, "a", pid_namespace(), child.pid, announced, "", 7))
        assert seen.pid_namespace == pid_namespace()  # the proven-exit check still applies
    finally:
        child.kill()
        child.wait()
