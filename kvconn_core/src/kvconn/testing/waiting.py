"""Bounded waits for tests: every wait has a deadline and says what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_for"]


def wait_for(
    cond: Callable[[], bool],
    timeout: float,
    what: str = "condition",
    poll: float = 0.005,
    failure: type[Exception] = AssertionError,
) -> float:
    """Poll ``cond`` every ``poll`` s until it is true and return the time it
    took; past ``timeout`` s raise ``failure`` (an AssertionError, so pytest
    reports it as a failed check; the conformance suite passes its own
    ``ConformanceFailure``) naming ``what``."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise failure(f"{what}: not within {timeout:g} s")
        time.sleep(poll)
    return time.monotonic() - t0
