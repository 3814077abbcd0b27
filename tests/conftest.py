"""Every test's pytest-timeout limit stretches while the machine is slow.

A limit (``timeout = 300`` in pyproject.toml, or a test's
``pytest.mark.timeout``) is read as seconds of an idle machine and spent as
a :class:`kvconn.testing.waiting.Budget`: on a 2-core machine at load 30 a
CPU-bound test gets its 300 s of idle-machine time, not 300 wall seconds of
a fifteenth of a core. ``KVCONN_TEST_SLOWNESS=1`` turns the stretch off.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import pytest

from kvconn.testing.waiting import Budget, slowness

try:
    import pytest_timeout
except ImportError:  # no limits to stretch
    pytest_timeout = None

#: The least wait before a test's limit is looked at again (s).
MIN_REARM_S = 1.0


def pytest_report_header(config: pytest.Config) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"kvconn: time limits stretched x{slowness():.1f} now (load {load}; tests/conftest.py)"


if pytest_timeout is not None:

    @pytest.hookimpl(tryfirst=True)
    def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
        """pytest-timeout's signal method, with the limit a Budget: the
        alarm is set for when the budget runs out at today's slowness, and
        set again for what is left if the machine was slower meanwhile. (One
        alarm, not a periodic one: SIGALRM interrupts system calls, of a
        native transport library's threads too.)"""
        if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
            return None  # pytest-timeout's own timer, unstretched
        budget = Budget(float(settings.timeout))

        def arm() -> None:
            signal.setitimer(signal.ITIMER_REAL, max(MIN_REARM_S, budget.wall_left()))

        def on_alarm(signum: int, frame: FrameType | None) -> None:
            __tracebackhide__ = True
            if budget.left() > 0:
                arm()
                return
            pytest_timeout.timeout_sigalrm(item, settings._replace(timeout=round(budget.elapsed(), 1)))

        def cancel() -> None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)

        item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout's own attribute
        signal.signal(signal.SIGALRM, on_alarm)
        arm()
        return True
