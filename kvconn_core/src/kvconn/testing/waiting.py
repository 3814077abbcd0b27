"""Bounded waits for tests: every wait has a deadline and says what it waited
for; and limits that stretch while the machine is slow (:class:`Budget`), so
that a limit an idle machine meets is met on a loaded one too.

A limit is stated in seconds *of an idle machine*. While the machine runs
more runnable tasks than it has cores, CPU-bound work is that many times
slower: :func:`slowness` reads it from the load average, and a
:class:`Budget` charges each stretch of wall time divided by it. A hung
test still ends (the stretch is capped at :data:`MAX_SLOWNESS`).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MAX_SLOWNESS", "SLOWNESS_ENV", "Budget", "communicate", "run", "slowness", "wait", "wait_for"]

#: A limit stretches at most this many times (a hung test still fails).
MAX_SLOWNESS = 20.0
#: ``KVCONN_TEST_SLOWNESS=F`` fixes :func:`slowness` at F (1: no stretch).
SLOWNESS_ENV = "KVCONN_TEST_SLOWNESS"
#: How often a wait on a process looks at the machine again (s).
_CHECK_S = 2.0


def wait_for(
    cond: Callable[[], bool],
    timeout: float,
    what: str = "condition",
    poll: float = 0.005,
    failure: type[Exception] = AssertionError,
) -> float:
    """Poll ``cond`` every ``poll`` s until it is true and return the (wall)
    time it took; once ``timeout`` s of an idle machine are spent (a
    :class:`Budget`) raise ``failure`` (an AssertionError, so pytest
    reports it as a failed check; the conformance suite passes its own
    ``ConformanceFailure``) naming ``what``."""
    budget = Budget(timeout)
    while not cond():
        if budget.left() <= 0:
            raise failure(f"{what}: not within {timeout:g} s")
        time.sleep(poll)
    return budget.elapsed()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def slowness() -> float:
    """How many times slower than on an idle machine CPU-bound work runs here
    now: runnable tasks per core (the larger of the 1- and 5-minute load
    averages, over the cores this process may use), from 1 to
    :data:`MAX_SLOWNESS`. ``KVCONN_TEST_SLOWNESS`` overrides it."""
    forced = os.environ.get(SLOWNESS_ENV, "").strip()
    if forced:
        return max(1.0, float(forced))
    try:
        one, five, _ = os.getloadavg()
    except OSError:  # not on this platform
        return 1.0
    return min(MAX_SLOWNESS, max(1.0, max(one, five) / _cores()))


class Budget:
    """``seconds`` of an idle machine's time: each stretch of wall time (from
    one look at the budget to the next) costs itself divided by the
    machine's :func:`slowness`, the larger of its values at the stretch's
    two ends (the load averages are smooth; between two looks the machine
    is taken to have been the slower of the two)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = self._at = time.monotonic()
        self._slowness = slowness()
        self._spent = 0.0

    def spent(self) -> float:
        """Idle-machine seconds spent so far."""
        now, now_slowness = time.monotonic(), slowness()
        self._spent += (now - self._at) / max(self._slowness, now_slowness)
        self._at, self._slowness = now, now_slowness
        return self._spent

    def left(self) -> float:
        return self.seconds - self.spent()

    def wall_left(self) -> float:
        """Wall seconds left at today's slowness (what a timer is set to)."""
        return max(0.0, self.left() * slowness())

    def elapsed(self) -> float:
        """Wall seconds since the budget began."""
        return time.monotonic() - self.started


def wait(ready: Callable[[float], bool], timeout: float) -> bool:
    """Call ``ready(seconds)``, a wait of its own of at most that long
    (``Connection.poll``, ``Event.wait``), until it says True (True), or
    until ``timeout`` seconds of an idle machine are spent (False)."""
    budget = Budget(timeout)
    while True:
        if ready(max(0.01, min(_CHECK_S, budget.wall_left()))):
            return True
        if budget.left() <= 0:
            return False


def communicate(proc: subprocess.Popen[Any], timeout: float, input: Any = None) -> tuple[Any, Any]:
    """``proc.communicate(timeout=timeout)`` where ``timeout`` is a
    :class:`Budget`: raises ``subprocess.TimeoutExpired`` (the process left
    running, as ``communicate`` does) once it is spent."""
    budget = Budget(timeout)
    while True:
        try:
            return proc.communicate(input, timeout=max(0.01, min(_CHECK_S, budget.wall_left())))
        except subprocess.TimeoutExpired:
            input = None  # sent already: communicate() keeps what it has not written
            if budget.left() <= 0:
                raise subprocess.TimeoutExpired(proc.args, budget.elapsed()) from None


def run(args: Sequence[str] | str, *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(args, timeout=timeout, ...)`` where ``timeout`` is a
    :class:`Budget` (idle-machine seconds); past it the process is killed
    and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    input = kwargs.pop("input", None)
    check = kwargs.pop("check", False)
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(args, **kwargs) as proc:
        try:
            out, err = communicate(proc, timeout, input)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            exc.output, exc.stderr = proc.communicate()
            raise
        except BaseException:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
