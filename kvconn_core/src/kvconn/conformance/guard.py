"""The guard over the whole run: what a check released stays watched until
the suite ends.

A check that watches released pages for a fixed window can be outwaited by
a write deferred past it (a helper process, a resumed fence). So every check
that gets pages back (a room released, a region fenced) hands them to the
:data:`GUARD` instead of freeing them: the region stays open, the writer of
a fence stays alive, and the suite's last check
(``test_nothing_landed_late_in_the_whole_run``) compares every guarded
region with what it must hold, naming the check that released it.

And where a late writer can be seen directly, it is: this process is made a
child subreaper, so a process a rank started that outlives it (a daemon in
a session of its own included) is re-parented here, not to init, and
:func:`orphans_since` finds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable, Collection

import attrs


@attrs.frozen(eq=False)
class Guarded:
    """One region a check gave back, and how to tell whether it still holds
    what it must."""

    check: str
    what: str
    #: "" while it holds what it must, else what changed.
    diff: Callable[[], str]
    #: Frees it (and whatever was kept alive for it) at the end of the run.
    close: Callable[[], None]
    #: When it was last given back (its guard's age counts from then).
    since: Callable[[], float]


class RunGuard:
    """The regions guarded until the end of the run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[Guarded] = []
        #: The check running now (set by the pytest plugin).
        self.check = "?"

    def keep(
        self,
        what: str,
        diff: Callable[[], str],
        close: Callable[[], None],
        since: Callable[[], float] | None = None,
    ) -> Guarded:
        if since is None:
            now = time.monotonic()
            since = lambda: now  # noqa: E731
        item = Guarded(self.check, what, diff, close, since)
        with self._lock:
            self._kept.append(item)
        return item

    def discard(self, item: Guarded) -> None:
        """``item`` needs no guard after all (nothing was released in it)."""
        with self._lock:
            if item in self._kept:
                self._kept.remove(item)

    def kept(self) -> list[Guarded]:
        with self._lock:
            return list(self._kept)

    def changed(self) -> list[str]:
        """What changed in the guarded regions, one line per region."""
        found = []
        for item in self.kept():
            diff = item.diff()
            if diff:
                age = time.monotonic() - item.since()
                found.append(
                    f"{item.what}, released by {item.check} {age:.1f} s before the end of the run: {diff}"
                )
        return found

    def watch(self, min_age_s: float, poll_s: float = 1.0) -> list[str]:
        """Wait until every guarded region was guarded ``min_age_s``, at
        least (``Settings.guard_s``; a full run's later checks usually cover
        it already), checked along the way: the first change ends the wait.
        What changed, one line per region."""
        kept = self.kept()
        deadline = max((item.since() for item in kept), default=0.0) + min_age_s
        while True:
            found = self.changed()
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        """Free everything kept, all at once (each may wait on a process)."""
        with self._lock:
            kept, self._kept = self._kept, []

        def close(item: Guarded) -> None:
            with contextlib.suppress(Exception):
                item.close()

        threads = [threading.Thread(target=close, args=(item,), daemon=True) for item in kept]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        reap_orphans(set())


GUARD = RunGuard()

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the one orphans of its descendants are re-parented
    to (Linux): what a rank started and left behind stays visible here."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _children() -> dict[int, tuple[str, str]]:
    """This process's children: pid -> (state, cmdline)."""
    me = os.getpid()
    found: dict[int, tuple[str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) != me:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry)] = (fields[0], cmdline)
    return found


def children() -> set[int]:
    return set(_children())


def descendants(root: int, session: int) -> list[int]:
    """Live processes ``root`` started (its descendants, a daemon that left
    its session included) and those of ``session``, ``root`` itself not."""
    parent: dict[int, int] = {}
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
        except (OSError, ValueError, IndexError):
            continue
        if fields[0] in ("Z", "X"):
            continue
        parent[int(entry)] = int(fields[1])
        if int(fields[3]) == session:
            found.add(int(entry))
    frontier = [root]
    while frontier:
        below = [pid for pid, ppid in parent.items() if ppid in frontier and pid not in found]
        found.update(below)
        frontier = below
    # root's own wrappers (on another host: ip netns exec, unshare, sh) share
    # its session; frozen, the rank's kill could not reap through them
    up = root
    while up in parent and up not in (0, 1):
        found.discard(up)
        up = parent[up]
    return sorted(found)


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def orphans_since(before: set[int], known: set[int]) -> list[str]:
    """Live children of this process that were not its children in
    ``before`` and are not ``known`` (processes it started): orphans it
    adopted ("pid cmdline"). Those that already exited are reaped."""
    reap_orphans(before | known)
    return [
        f"{pid} {cmdline[:120]}"
        for pid, (state, cmdline) in sorted(_children().items())
        if pid not in before and pid not in known and state not in ("Z", "X")
    ]


def reap_orphans(keep: set[int]) -> None:
    """Reap exited adopted orphans (never a pid in ``keep``: a child some
    ``subprocess.Popen`` of this process waits for)."""
    for pid, (state, _) in _children().items():
        if state == "Z" and pid not in keep:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


#: Shared mappings that can hold a page region: POSIX shared memory, memfds,
#: System V segments, shared anonymous memory.
_SHARED_MEMORY = ("/dev/shm/", "/memfd:", "/SYSV", "/dev/zero")
#: The suite's own scratch buffer between it and the region host (region_host.py).
_SCRATCH = "/memfd:kvconn-conformance-scratch"


def _mappings(pid: int) -> list[tuple[tuple[str, int], str]]:
    """``pid``'s shared mappings of shared memory: ((device, inode), path)."""
    found = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[1][3] != "s" or parts[4] == "0":
            continue
        path = parts[5].strip()
        if path.startswith(_SHARED_MEMORY) and not path.startswith(_SCRATCH):
            found.append(((parts[3], int(parts[4])), path))
    return found


def shared_memory_of(pid: int) -> set[tuple[str, int]]:
    """The shared memory ``pid`` maps (a page owner: its regions), as
    (device, inode): the same object whatever name or address it has elsewhere."""
    return {key for key, _ in _mappings(pid)}


def threads_of(pid: int) -> list[str]:
    """The names of ``pid``'s threads (/proc/PID/task)."""
    names = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
    except OSError:
        pass
    return names


def _open_files(pid: int, memory: set[tuple[str, int]], owners: Collection[int]) -> list[str]:
    """What ``pid`` holds open that writes into an owner's memory without a
    mapping: one of the shared memory objects of ``memory`` (a later mmap
    or pwrite away), or ``/proc/OWNER/mem`` of an owner (pwrite into any
    address of it)."""
    found = []
    mem = {f"/proc/{owner}/mem" for owner in owners}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        with contextlib.suppress(OSError):
            target = os.readlink(path)
            st = os.stat(path)
            key = (f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino)
            if target in mem or key in memory:
                found.append(f"fd {fd} -> {target}")
    return found


def holders(processes: list[str], memory: set[tuple[str, int]], owners: Collection[int] = ()) -> list[str]:
    """Of ``processes`` ("pid cmdline"), those that map any of ``memory``
    or hold it (or an owner's ``/proc/PID/mem``) open, each with what it
    maps or holds and the threads that could write through it."""
    found = []
    for line in processes:
        pid = int(line.split()[0])
        paths = sorted({path for key, path in _mappings(pid) if key in memory})
        paths += _open_files(pid, memory, owners)
        if paths:
            threads = threads_of(pid)
            found.append(
                f"{line} maps or holds {', '.join(paths[:2])} ({len(threads)} threads: {', '.join(threads[:6])})"
            )
    return found


def kill_later(pids: list[int]) -> Callable[[], None]:
    """A closer that kills ``pids`` (left alive so the guard can see what they write)."""

    def close() -> None:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        reap_orphans(set())

    return close
