"""SIGTERM and Ctrl-C in the default ``kvconn bench``'s fault phase (issue
32, rough edges 2 and 3): one line, a prompt exit, no rank process and no
network namespace (with its veths) left behind, though the fault phase
makes them in worker threads, where no signal handler can be installed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconn.testing import hosts, waiting

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="finds the bench's processes in /proc")

#: The default bench, as small as it goes, into its fault phase at once.
FAULT_PHASE = [
    "--no-progress", "--modes", "kvconn", "--requests", "4", "--stream-requests", "0", "--pages", "8",
    "--page-bytes", "16384", "--chunk-pages", "2", "--concurrency", "4", "--overhead-chunks", "200",
    "--settle-s", "0.1", "--drain-s", "1", "--faults", "short", "--ranks", "1", "--abort-window-ms", "1",
]  # fmt: skip

RANK_MODULE = "kvconn.testing.faults"


def ranks_of(parent: int) -> dict[int, str]:
    """The fault phase's rank processes the bench started: pid -> state (R, S, T...)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text.rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and RANK_MODULE.encode() in cmdline:
            found[int(stat.parent.name)] = fields[0]
    return found


def namespaces_of(pid: int) -> dict[str, int]:
    """The network namespaces kvconn.testing.hosts made for process ``pid``: name -> inode."""
    listed = waiting.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    out = {}
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{hosts.PREFIX}{pid}-"):
            with contextlib.suppress(OSError):
                out[name] = os.stat(f"/run/netns/{name}").st_ino
    return out


def in_namespaces(inodes: set[int]) -> list[int]:
    """Processes still in one of these network namespaces: while one is, the
    namespace and its veths live on, named or not."""
    found = []
    for ns in Path("/proc").glob("[0-9]*/ns/net"):
        with contextlib.suppress(OSError):
            if ns.stat().st_ino in inodes:
                found.append(int(ns.parts[2]))
    return found


@contextlib.contextmanager
def bench_in_its_fault_phase(need_hosts: bool) -> Iterator[tuple[subprocess.Popen[str], dict[int, str]]]:
    """A running bench whose fault phase has a rank frozen mid-write (the
    hardest teardown: the rank must be continued) and, with ``need_hosts``,
    its namespaces made. Yields it and its ranks; kills what is left after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvconn.cli", "bench", *FAULT_PHASE],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives it
    )
    ranks: dict[int, str] = {}
    try:
        budget = waiting.Budget(120)  # idle-machine seconds: longer on a loaded one
        while True:
            ranks = ranks_of(proc.pid)
            made = not need_hosts or len(namespaces_of(proc.pid)) >= 3  # decode, prefill0, the switch
            if "T" in ranks.values() and made:
                break
            assert proc.poll() is None, proc.communicate()[0]
            assert budget.left() > 0, f"the bench's fault phase froze no rank in {budget.elapsed():.0f} s"
            time.sleep(0.05)
        yield proc, ranks
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in ranks:  # only if the bench left them
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        hosts.sweep_stale()  # its namespaces, now that its pid is gone


def one_line_exit(proc: subprocess.Popen[str], code: int, within_s: float) -> str:
    """``within_s``: seconds of an idle machine (a waiting.Budget)."""
    budget = waiting.Budget(within_s)
    try:
        out, _ = waiting.communicate(proc, 60)
    except subprocess.TimeoutExpired:
        # its output stays open while a process it started lives (a rank holds it as stderr)
        state = "running" if proc.poll() is None else f"gone ({proc.returncode}), a child holds its output"
        raise AssertionError(f"no exit within 60 s: the bench is {state}") from None
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == code, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert len(lines) == 1, out
    assert budget.left() > 0, f"exit took {budget.elapsed():.1f} s"
    return lines[0]


def left_behind(ranks: dict[int, str], made: dict[str, int]) -> dict[int, str]:
    """What still runs of the bench's ranks and in its namespaces: pid ->
    state and command. An exited rank is gone though its pid may stay a
    zombie until the reaper it was handed to (pid 1, once the bench has
    exited) collects it, seconds later on some inits."""
    out = {}
    for pid in set(ranks) | set(in_namespaces(set(made.values()))):
        with contextlib.suppress(OSError, IndexError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state not in ("Z", "X"):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                out[pid] = f"{state} {cmd[:120]}"
    return out


def wait_all_gone(ranks: dict[int, str], made: dict[str, int], within_s: float) -> None:
    budget = waiting.Budget(within_s)
    while left := left_behind(ranks, made):
        assert budget.left() > 0, f"still running {budget.elapsed():.0f} s after the bench exited: {left}"
        time.sleep(0.05)


def test_sigterm_in_the_fault_phase_leaves_no_namespace_or_rank() -> None:
    hosts.skip_unless_available(pytest.skip)
    with bench_in_its_fault_phase(need_hosts=True) as (proc, ranks):
        made = namespaces_of(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        line = one_line_exit(proc, 128 + signal.SIGTERM, within_s=30)
        assert line == "kvconn bench: stopped by SIGTERM; no results"
        assert namespaces_of(proc.pid) == {}, "namespaces left behind"
        wait_all_gone(ranks, made, within_s=30)


def test_ctrl_c_in_the_fault_phase_is_one_line_and_a_second_prints_nothing() -> None:
    """The terminal sends SIGINT to the bench's process group; the user
    presses it again while the bench tears down."""
    with bench_in_its_fault_phase(need_hosts=not hosts.unavailable()) as (proc, ranks):
        made = namespaces_of(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        line = one_line_exit(proc, 128 + signal.SIGINT, within_s=30)
        assert line == "kvconn bench: interrupted (Ctrl-C); no results"
        wait_all_gone(ranks, made, within_s=30)
        assert namespaces_of(proc.pid) == {}
