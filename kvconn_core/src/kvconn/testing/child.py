"""Child processes that speak JSON lines, both ends.

The parent's end is :class:`Child`: it starts ``python -m MODULE ARGS_JSON``
in a session of its own, collects every JSON line the child prints as an
event, and signals, freezes, closes and reaps it (and whatever it started).
With a :class:`StderrLog`, the child's stderr goes to a file and a child
that dies is reported as one line, the last it wrote there (a traceback's
exception), not a screen of tracebacks. The child's end is
:func:`load_args` (the argument, inline or ``@FILE``), :func:`emit` (one
timestamped event line), :func:`quiet_interrupts` and :func:`stop_self`.
Prefill rank processes, bare writers, decode processes of the conformance
suite, the fault-injection rank of :mod:`kvconn.testing.cluster` and every
child process of ``kvconn bench`` use them.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvconn.runtime.procs import all_threads_stopped
from kvconn.testing.waiting import slowness, wait_for

if TYPE_CHECKING:
    from kvconn.testing.hosts import Host

__all__ = ["Child", "ChildError", "StderrLog", "busy", "emit", "load_args", "quiet_interrupts", "stop_self"]

_out_lock = threading.Lock()
#: Popen's arguments for a process group of its own (``process_group`` is 3.11's).
_OWN_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)


def emit(event: dict[str, Any]) -> None:
    """Print ``event`` as one JSON line, stamped with ``t``: ``time.monotonic()``
    (CLOCK_MONOTONIC is shared by the processes of a host, so the parent can
    order a child's events against its own)."""
    event["t"] = time.monotonic()
    line = json.dumps(event)
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def load_args(arg: str) -> dict[str, Any]:
    """The JSON argument, given inline or, when too long for a command line
    (rounds of thousands of segments), as ``@PATH`` of a file holding it."""
    if arg.startswith("@"):
        with open(arg[1:]) as f:
            arg = f.read()
    args: dict[str, Any] = json.loads(arg)
    return args


def quiet_interrupts() -> None:
    """In a child: ignore Ctrl-C, which the terminal sends to every process of
    a run at once. The parent tears the run down and closes our stdin, and we
    exit then, without a traceback of our own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def busy(seconds: float) -> threading.Thread:
    """In a child: a thread that computes in Python for ``seconds`` (an
    engine's busy step loop), taking the GIL from the process's other
    threads, kvconn's listener among them, at every switch interval."""

    def spin() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True, name="kvconn-busy-engine")
    thread.start()
    return thread


def stop_self() -> None:
    """SIGSTOP this whole process, the calling thread included, before this returns.

    ``kill(getpid())`` would not do: the kernel may hand a process-directed
    SIGSTOP to another thread (the main one, blocked on stdin), and the caller
    runs on, writing, until that thread is scheduled. A thread-directed
    SIGSTOP stops the caller on its way out of the system call, and the group
    stop then takes every other thread.
    """
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


class ChildError(RuntimeError):
    """A child process exited before it reported what was waited for (what a
    tool that runs children, ``kvconn bench``, raises; a test's wait fails
    with an AssertionError)."""


class StderrLog:
    """Where one child's stderr goes: a temporary file, read back for the
    cause of a failure; this process's own stderr when :attr:`verbose`."""

    #: Children write their stderr to ours (``kvconn bench --verbose``).
    verbose: ClassVar[bool] = False

    def __init__(self) -> None:
        self.file = (  # closed in close(), when the child is gone
            None if self.verbose else tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        )

    def cause(self) -> str:
        """The last line the child wrote (a traceback ends with its exception)."""
        if self.file is None:
            return "see its output above"
        self.file.flush()
        self.file.seek(0)
        lines = [line.strip() for line in self.file.read().splitlines() if line.strip()]
        return lines[-1] if lines else "it wrote nothing to stderr"

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def exited(what: str, code: int, log: StderrLog) -> str:
    """One line for a child that exited with ``code``, and why."""
    how = "after Ctrl-C" if code in (-signal.SIGINT, 130) else f"with {code}"
    return f"{what} exited {how}: {log.cause()}"


class Child:
    """A child process that reports JSON lines on stdout, in a session of its
    own: whatever it starts stays in that session unless it leaves on purpose,
    so a test can tell what outlived it (:meth:`survivors`). Or, with
    ``own_session=False``, in a process group of its own within this
    process's session (the terminal's Ctrl-C, sent to the foreground group,
    still stays the parent's to handle): for children whose wake-up latency
    is measured. With the kernel's autogroup scheduling
    (``/proc/sys/kernel/sched_autogroup_enabled``, on by default on many
    distributions) a session is a scheduling group of its own, and every
    wake-up between processes in sessions of their own waits for their
    group's turn: on a loaded machine ``kvconn bench``'s abort-to-release
    p50 was 6.9 ms with its ranks in sessions of their own, 2.1 ms in the
    bench's (issue 42, load 43-46, 3 pairs)."""

    #: What a wait on the child raises when it runs out (the conformance
    #: suite's children raise its ConformanceFailure, the bench's ChildError).
    failure: type[Exception] = AssertionError

    #: Longer arguments go through a file (a command line holds ~128 KiB).
    INLINE_ARGS = 64 << 10

    def __init__(
        self,
        module: str,
        args: Mapping[str, Any],
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        host: Host | None = None,
        stderr: Any = None,
        *,
        log: StderrLog | None = None,
        name: str = "",
        failure: type[Exception] | None = None,
        own_session: bool = True,
    ) -> None:
        """Run ``python -m module ARGS_JSON`` under the command ``prefix``
        (``ip netns exec NS``, ``unshare ...``), with ``env`` added to this
        process's environment. ``host``: on that host
        (:mod:`kvconn.testing.hosts`), ``prefix`` inside it; the child's pid
        is then the command's own, not its wrappers'. ``stderr``: where its
        stderr goes (``subprocess.Popen``'s; ours by default), or ``log``
        (closed with the child), whose last line a wait on a child that
        exited reports, as ``name exited with CODE: LINE``. ``failure``:
        what such a wait raises (the class's :attr:`failure` by default)."""
        self.log = log
        self.name = name or f"python -m {module}"
        if failure is not None:
            self.failure = failure
        payload = json.dumps(dict(args))
        # A long argument goes in a memory file the child inherits: no path
        # in a /tmp that a host of its own does not share.
        args_fd: int | None = None
        if len(payload) > self.INLINE_ARGS:
            args_fd = os.memfd_create("kvconn-child-args", 0)
            os.write(args_fd, payload.encode())
            payload = f"@/proc/self/fd/{args_fd}"
        self.host = host
        try:
            self.proc = subprocess.Popen(
                [
                    *(host.prefix() if host is not None else ()),
                    *prefix,
                    sys.executable,
                    "-m",
                    module,
                    payload,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                **({"start_new_session": True} if own_session else _OWN_GROUP),
                env=None if env is None else {**os.environ, **env},
                stderr=log.file if log is not None else stderr,
                pass_fds=() if args_fd is None else (args_fd,),
            )
        finally:
            if args_fd is not None:
                os.close(args_fd)
        #: Signals, freezes and kills go here: on another host, the command
        #: itself (its wrappers, pid 1 of its PID namespace among them,
        #: would not pass a SIGSTOP on).
        self.pid = self.proc.pid if host is None else host.main_pid(self.proc)
        #: Everything it starts stays in this session (or process group).
        self.session = self.proc.pid
        self._by_group = not own_session
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._history: list[dict[str, Any]] = []
        self._log_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"kvconn-child-read-{self.pid}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a transport library's own line (nixl prints to stdout)
            if not isinstance(event, dict):
                continue
            with self._log_lock:
                self._history.append(event)
            self.events.put(event)

    def history(self) -> list[dict[str, Any]]:
        with self._log_lock:
            return list(self._history)

    def last_with(self, key: str) -> Any:
        """The ``key`` field of the last event that had one (None: none had)."""
        return next((e[key] for e in reversed(self.history()) if key in e), None)

    def expect(self, timeout: float, what: str, **match: Any) -> dict[str, Any]:
        """The next event whose fields equal ``match`` (others are skipped)."""
        return self.next_event(timeout, what, lambda e: all(e.get(k) == v for k, v in match.items()), match)

    def next_with(self, key: str, timeout: float, what: str) -> dict[str, Any]:
        """The next event that has the field ``key`` (others are skipped)."""
        return self.next_event(timeout, what, lambda e: key in e, f"a {key!r} field")

    def next_event(
        self, timeout: float, what: str, wanted: Callable[[dict[str, Any]], bool], describe: object
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            gone = self.proc.poll() is not None
            if gone and self.events.empty():
                self._reader.join(1.0)  # the lines it wrote before it exited come first
            if left <= 0 or (gone and self.events.empty()):
                code = self.proc.poll()
                if code is not None and self.log is not None:
                    raise self.failure(exited(self.name, code, self.log))
                # A child a signal ended says which (a crash: SIGSEGV, SIGBUS).
                how = (
                    f"killed by {signal.Signals(-code).name}"
                    if code is not None and code < 0
                    else f"exit code {code}"
                )
                raise self.failure(
                    f"{what}: child {self.pid} did not report {describe} within {timeout:.1f} s ({how})"
                )
            try:
                event = self.events.get(timeout=min(left, 0.05))
            except queue.Empty:
                continue
            if wanted(event):
                return event

    def send_line(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stopped(self) -> bool:
        return all_threads_stopped(self.pid)

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        # A killed process is gone once the kernel next schedules it: on a
        # loaded (or paused) VM that took over 10 s once in CI.
        self.proc.wait(60)

    def survivors(self) -> list[str]:
        """Processes of this child's session (or process group) still alive
        ("pid cmdline"): a helper that can write after the child is gone."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in (self.pid, self.session):
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rindex(")") + 2 :].split()
                state, session = fields[0], int(fields[2] if self._by_group else fields[3])
                if session != self.session or state in ("Z", "X"):
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except (OSError, ValueError, IndexError):
                continue
            found.append(f"{entry} {cmdline[:120]}")
        return found

    def reap_survivors(self) -> None:
        """Kill what :meth:`survivors` found (once the check has said so)."""
        for line in self.survivors():
            with contextlib.suppress(OSError):
                os.kill(int(line.split()[0]), signal.SIGKILL)

    def close(self, timeout: float = 10.0) -> None:
        """Close its stdin and give it ``timeout`` s to exit (then kill it);
        its last lines are events too (:meth:`last_with`)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout * slowness())
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.reap_survivors()  # one of them may hold its stdout open
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.log is not None:
            self.log.close()

    def stop_at(self, t: float, what: str) -> None:
        """SIGSTOP at monotonic time ``t`` (at once if it passed), and return
        once every thread is stopped: a freeze from outside, mid-call."""
        time.sleep(max(0.0, t - time.monotonic()))
        self.signal(signal.SIGSTOP)
        wait_for(self.stopped, 5, what, poll=0.002, failure=self.failure)

    def frozen(self, timeout: float, what: str, **match: Any) -> dict[str, Any]:
        """The child's next ``freeze`` report, once every thread is stopped."""
        event = self.expect(timeout, what, event="freeze", **match)
        wait_for(self.stopped, 5, f"{what}: the child froze", poll=0.002, failure=self.failure)
        return event
