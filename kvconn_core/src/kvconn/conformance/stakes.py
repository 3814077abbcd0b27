"""What a check put at stake, and the rule that a check with nothing at
stake fails.

A check proves its property only if the run gave the transport a chance to
break it: a fence asked with writes in flight, a cut with bytes still to
cross, a barrier asked while a writer could still reach the region, a
release while a chunk was posted. Each check says what it put at stake
with :func:`at_stake`, measured in the run (never assumed from its plan),
and fails, naming what was missing, when that is below what the property
needs. The pytest plugin prints every check's stakes on its summary line,
and fails a check that passed without stating one (a check that can pass
with nothing at stake is a suite bug).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_taken: list[str] | None = None


def begin() -> None:
    """A check starts (the plugin calls it): no stake stated yet."""
    global _taken
    with _lock:
        _taken = []


def taken() -> list[str]:
    """What the running (or last) check stated it put at stake."""
    with _lock:
        return list(_taken or [])


def at_stake(amount: float, need: float, said: str, needed: str) -> None:
    """Record ``said`` (what this run put at stake, with its figures) for
    the running check, and fail the check if ``amount`` is below ``need``
    (``needed`` says what the property needs, in words)."""
    with _lock:
        if _taken is not None:
            _taken.append(said)
    if amount < need:
        from kvconn.conformance.harness import ConformanceFailure

        raise ConformanceFailure(
            f"nothing at stake: {said}, and the check needs {needed}: this run proves nothing"
        )
