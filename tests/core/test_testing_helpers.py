"""kvconn.testing's shared pieces: the one wait, the one process driver and
the one page pool that the clusters of the tests and of the conformance
suite are built on."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvconn.testing.child import Child, ChildError, StderrLog
from kvconn.testing.pages import CanaryPages
from kvconn.testing.patterns import CANARY, canary, shard_bytes
from kvconn.testing.waiting import wait_for

HERE = str(Path(__file__).resolve().parent)


class Failure(AssertionError):
    pass


# -- wait_for -----------------------------------------------------------------
def test_wait_for_returns_the_time_taken() -> None:
    t0 = time.monotonic()
    took = wait_for(lambda: time.monotonic() - t0 > 0.05, 5, "50 ms", poll=0.001)
    assert 0.05 <= took < 5


def test_wait_for_raises_the_given_failure_naming_what() -> None:
    t0 = time.monotonic()
    with pytest.raises(Failure, match=r"^the moon: not within 0.05 s$"):
        wait_for(lambda: False, 0.05, "the moon", failure=Failure)
    assert time.monotonic() - t0 < 2
    with pytest.raises(AssertionError, match="condition: not within"):
        wait_for(lambda: False, 0.01)


# -- the page pool --------------------------------------------------------------
class _Region:
    def __init__(self, nbytes: int) -> None:
        self.data = bytearray(b"\x00" * nbytes)

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self.data[offset : offset + nbytes])

    def write(self, offset: int, data: bytes) -> None:
        self.data[offset : offset + len(data)] = data


def test_pages_start_canaried_and_free() -> None:
    region = _Region(8 * 64)
    pool = CanaryPages(region, 8, 64, num_ranks=2)
    assert bytes(region.data) == canary(8 * 64) and CANARY == 0xA5
    assert pool.free_pages() == list(range(8)) and pool.returned_pages() == []


def test_take_lowest_first_and_refuse_more_than_free() -> None:
    pool = CanaryPages(_Region(8 * 64), 8, 64)
    assert pool.take(3) == ([0, 1, 2], [])
    assert pool.take(2, exclude=[3]) == ([4, 5], [])
    with pytest.raises(AssertionError, match="4 pages wanted, only 3 free"):
        pool.take(4)
    assert pool.free_pages() == [3, 6, 7]  # a refused take takes nothing


def test_give_back_canaries_and_fresh_pages_go_first() -> None:
    region = _Region(6 * 64)
    pool = CanaryPages(region, 6, 64)
    pages, _ = pool.take(2)
    region.write(0, b"\x01" * 128)  # the room's bytes
    pool.give_back(pages)
    assert region.read(0, 128) == canary(128) and pool.returned_pages() == [0, 1]
    assert pool.take(2) == ([0, 1], [0, 1])  # lowest first: the returned pages again
    pool.give_back([0, 1])
    assert pool.take(5, fresh_first=True) == ([2, 3, 4, 5, 0], [0])  # cooled pages last
    assert pool.returned_once == {0, 1}


def test_untake_frees_without_marking_returned() -> None:
    pool = CanaryPages(_Region(4 * 64), 4, 64)
    pages, _ = pool.take(3)
    pool.untake(pages[1:])
    assert pool.free_pages() == [1, 2, 3] and pool.returned_pages() == []


def test_checks_find_late_bytes_and_wrong_shards() -> None:
    region = _Region(4 * 64)
    pool = CanaryPages(region, 4, 64, num_ranks=2)
    assert pool.changed(range(4)) == [] and pool.dirty_bytes(2) == 0
    region.write(2 * 64 + 5, b"\x00\x00\x00")
    assert pool.changed(range(4)) == [2] and pool.dirty_bytes(2) == 3
    for i, page in enumerate((0, 1)):
        for rank in (0, 1):
            region.write(page * 64 + rank * 32, shard_bytes(9, rank, i, 32))
    assert pool.wrong_pattern(9, [0, 1]) == []
    assert pool.wrong_pattern(9, [1, 0]) == [1, 0]  # page order matters
    region.write(64 + 32, b"\x00")
    assert pool.wrong_pattern(9, [0, 1]) == [1] and pool.wrong_pattern(9, [0, 1], ranks=[0]) == []


# -- the process driver ---------------------------------------------------------
def _child(args: dict[str, object]) -> Child:
    return Child(
        "child_echo", args, env={"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    )


def test_child_events_in_order_and_by_field() -> None:
    child = _child(
        {"events": [{"event": "ready", "n": 1}, {"address": "tcp://x"}, {"event": "ready", "n": 2}]}
    )
    try:
        assert child.next_with("address", 10, "start")["address"] == "tcp://x"
        assert child.expect(10, "second", event="ready")["n"] == 2  # the first was skipped over
        child.send_line("hello")
        line = child.expect(10, "echo", event="line")
        assert line["text"] == "hello" and isinstance(line["t"], float)
        assert [e.get("n") for e in child.history()][:3] == [1, None, 2]  # the non-JSON line is not an event
    finally:
        child.close()
    assert child.proc.returncode == 0 and not child.survivors()


def test_child_long_arguments_go_through_a_file() -> None:
    pad = "x" * (Child.INLINE_ARGS + 1)
    child = _child({"events": [], "pad": pad})
    try:
        child.send_line("size?")
        assert child.expect(10, "echo", event="line")["size"] == len(pad)
    finally:
        child.close()


def test_child_waits_fail_with_its_failure_class() -> None:
    class Quiet(Child):
        failure = Failure

    child = Quiet(
        "child_echo", {"events": []}, env={"PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    )
    try:
        with pytest.raises(
            Failure, match=r"never: child \d+ did not report \{'event': 'nope'\} within 0.2 s"
        ):
            child.expect(0.2, "never", event="nope")
        child.proc.stdin.close()  # type: ignore[union-attr]
        child.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(Failure, match=r"exit code 0"):  # an exited child fails the wait at once
            child.next_with("address", 30, "gone")
        assert time.monotonic() - t0 < 5
    finally:
        child.close()


def test_a_childs_lines_on_its_way_out_are_kept() -> None:
    child = _child({"events": [], "last": {"profile": 7}})
    child.close(timeout=30)
    assert child.proc.returncode == 0
    assert child.last_with("last") == {"profile": 7} and child.last_with("nothing") is None


def test_a_child_that_died_is_reported_by_its_last_stderr_line() -> None:
    """What ``kvconn bench`` prints for a child that failed: one line, not its traceback."""
    env = {"PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = StderrLog()
    child = Child("child_echo", {"die": True}, env=env, log=log, name="the echo", failure=ChildError)
    try:
        with pytest.raises(ChildError, match=r"^the echo exited with 3: ValueError: the cause$"):
            child.next_with("address", 30, "start")
    finally:
        child.close()
    assert log.file is not None and log.file.closed  # closed with the child


def test_a_wait_on_a_child_a_signal_ended_names_the_signal() -> None:
    """A crashed child (SIGSEGV, say) is named by its signal, not a negative exit code."""

    class Quiet(Child):
        failure = Failure

    child = Quiet(
        "child_echo", {"events": []}, env={"PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    )
    try:
        child.signal(signal.SIGSEGV)
        child.proc.wait(10)
        with pytest.raises(Failure, match=r"\(killed by SIGSEGV\)"):
            child.next_with("address", 30, "crashed")
    finally:
        child.close()


def test_a_child_in_a_process_group_of_its_own_stays_in_our_session() -> None:
    """``own_session=False`` (the bench's ranks): the child shares this
    process's session, so the kernel's autogroup scheduling puts it in our
    scheduling group (a session of its own made every wake-up between the
    bench's processes wait for another group's turn: issue 42), while the
    terminal's Ctrl-C, sent to the foreground process group, still misses it."""
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    grouped = Child("child_echo", {"events": [{"event": "up"}]}, env=env, own_session=False)
    apart = Child("child_echo", {"events": [{"event": "up"}]}, env=env)
    try:
        for child in (grouped, apart):
            child.expect(10, "start", event="up")
        assert os.getsid(grouped.pid) == os.getsid(0)
        assert os.getpgid(grouped.pid) == grouped.pid != os.getpgid(0)
        assert os.getsid(apart.pid) == apart.pid != os.getsid(0)
        assert grouped.survivors() == [] and apart.survivors() == []
    finally:
        grouped.close()
        apart.close()
