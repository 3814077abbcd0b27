"""The prefill worker's fence gate (issue 25): a fence never runs while a
post or barrier does, and no post starts while a fence runs. A fence torn
down under a running post would let that post's bytes land after the fence
"proved" none can: an ack, then a late write into freed pages.

Each test waits on events with a bound; the short "still blocked" checks
give a broken gate time to let the other thread through.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvconn.runtime.prefill import FenceGate
from kvconn.testing.waiting import wait_for

WAIT_S = 30.0  # a bound for a loaded CI machine, not a timing: each wait ends on its event
BLOCKED_S = 0.2  # how long a blocked thread is given to (wrongly) get through


def _in_thread(body: Callable[[], None]) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        body()
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def _fence(gate: FenceGate, inside: threading.Event, release: threading.Event) -> Callable[[], None]:
    def run() -> None:
        with gate.exclusive():
            inside.set()
            assert release.wait(WAIT_S)

    return run


def test_a_fence_waits_for_every_running_post_to_leave() -> None:
    gate = FenceGate()
    gate.enter()
    gate.enter()  # two workers inside
    inside, release = threading.Event(), threading.Event()
    thread, _ = _in_thread(_fence(gate, inside, release))
    assert not inside.wait(BLOCKED_S)
    gate.leave()
    assert not inside.wait(BLOCKED_S)  # one worker still posting
    gate.leave()
    assert inside.wait(WAIT_S)
    release.set()
    thread.join(WAIT_S)


def test_no_post_starts_while_a_fence_runs_or_waits() -> None:
    gate = FenceGate()
    gate.enter()  # a worker inside: the fence waits for it
    inside, release = threading.Event(), threading.Event()
    fencer, fenced = _in_thread(_fence(gate, inside, release))
    wait_for(lambda: gate._fencing, WAIT_S, "the fence to wait for the worker")
    late, entered = _in_thread(gate.enter)  # a worker arriving while the fence waits
    assert not entered.wait(BLOCKED_S)
    gate.leave()
    assert inside.wait(WAIT_S)
    assert not entered.wait(BLOCKED_S)  # the fence runs: still no post
    release.set()
    assert fenced.wait(WAIT_S) and entered.wait(WAIT_S)
    gate.leave()
    fencer.join(WAIT_S)
    late.join(WAIT_S)


def test_two_fences_run_one_at_a_time() -> None:
    gate = FenceGate()
    first_in, first_out = threading.Event(), threading.Event()
    second_in, second_out = threading.Event(), threading.Event()
    first, _ = _in_thread(_fence(gate, first_in, first_out))
    assert first_in.wait(WAIT_S)
    second, _ = _in_thread(_fence(gate, second_in, second_out))
    assert not second_in.wait(BLOCKED_S)
    first_out.set()
    assert second_in.wait(WAIT_S)
    second_out.set()
    first.join(WAIT_S)
    second.join(WAIT_S)


def test_the_gate_opens_again_after_a_fence() -> None:
    gate = FenceGate()
    with gate.exclusive():
        pass
    _, entered = _in_thread(gate.enter)
    assert entered.wait(WAIT_S)
    gate.leave()
    inside, release = threading.Event(), threading.Event()
    release.set()
    fencer, fenced = _in_thread(_fence(gate, inside, release))  # nobody inside: at once
    assert fenced.wait(WAIT_S)
    fencer.join(WAIT_S)
