"""The control-plane listener's own loop (its input handling is fuzzed in
tests/fuzz/test_wire_fuzz.py)."""

from __future__ import annotations

import time

from kvconn.runtime.control import Listener


def test_listener_sleeps_through_sub_millisecond_waits() -> None:
    """An idle handler that asks to run again in 0.3 ms gets a 1 ms sleep
    (zmq's poll takes whole ms), not a busy loop of zero-timeout polls."""
    calls = 0

    def idle() -> float:
        nonlocal calls
        calls += 1
        return 0.0003

    listener = Listener("idle", "127.0.0.1", 0, lambda _m: None, lambda _r: None, idle=idle)
    listener.start()
    try:
        time.sleep(0.2)
    finally:
        listener.close()
    # each pass sleeps >= 1 ms: at most ~200 in 0.2 s (a spinning loop made
    # tens of thousands)
    assert 0 < calls <= 400, calls
