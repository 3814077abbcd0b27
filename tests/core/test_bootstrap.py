"""A decode endpoint's bootstrap of a prefill instance, stimulus by stimulus
(protocol/bootstrap.py): when Hellos are re-sent, when it gives up, what
its answers make of the instance. No sockets, no clock but ``now``."""

from __future__ import annotations

import pytest
from endpoint_world import HERE, NAME, announce, endpoint, hello, writer

from kvconn.errors import BootstrapError
from kvconn.protocol import bootstrap
from kvconn.protocol.endpoint import EndpointState
from kvconn.protocol.endpoint_events import (
    Answered,
    AwaitAnswers,
    Bootstrapped,
    BootstrapTick,
    GiveUp,
    Instance,
    Send,
)
from kvconn.protocol.messages import Hello, HelloAck


def _begin(state: EndpointState, addresses: tuple[str, ...], now: float = 0.0, **timing: float) -> Instance:
    options = {"timeout_s": 2.0, "resend_interval_s": 0.3, **timing}
    return state.begin_bootstrap(addresses, hello(len(addresses)), now, **options)


def _hellos(actions: list[object]) -> list[str]:
    return [a.address for a in actions if isinstance(a, Send) and isinstance(a.message, Hello)]


def test_unanswered_ranks_are_helloed_again_each_resend_interval_until_they_answer() -> None:
    state = endpoint(())
    instance = _begin(state, ("p0", "p1"), now=10.0)
    first = state.handle(BootstrapTick(instance), 10.0)
    assert _hellos(first) == ["p0", "p1"] and first[-1] == AwaitAnswers(10.3)
    # woken early (another rank's answer, a spurious wake-up): no Hello before its time
    assert state.handle(BootstrapTick(instance), 10.1) == [AwaitAnswers(10.3)]
    assert announce(state, 0, "p0", 1, 10.2) == [Answered("p0")]
    again = state.handle(BootstrapTick(instance), 10.3)
    assert _hellos(again) == ["p1"] and again[-1] == AwaitAnswers(pytest.approx(10.6))  # only the silent one
    announce(state, 1, "p1", 4, 10.4)
    assert state.handle(BootstrapTick(instance), 10.4) == [Bootstrapped(instance)]
    assert state.instances[("p0", "p1")] is instance and instance.ids == (0, 1)
    assert state.pending == {}  # its later HelloAcks are heartbeats
    assert state.session_of(1, ("p0", "p1")) == 4


def test_at_least_four_hellos_fit_in_the_deadline() -> None:
    assert bootstrap.resend_every(1.0, 2.0) == 0.5
    assert bootstrap.resend_every(0.3, 2.0) == 0.3
    state = endpoint(())
    instance = _begin(state, ("p0",), timeout_s=1.0, resend_interval_s=5.0)
    sent_at = []
    now = 0.0
    while True:
        actions = state.handle(BootstrapTick(instance), now)
        if _hellos(actions):
            sent_at.append(now)
        if not isinstance(actions[-1], AwaitAnswers):
            break
        now = actions[-1].until  # the waiter wakes when told, no answer comes
    assert sent_at == [0.0, 0.25, 0.5, 0.75]
    [give_up] = actions
    assert isinstance(give_up, GiveUp) and now == 1.0


def test_the_bootstrap_gives_up_at_its_deadline_naming_the_silent_ranks() -> None:
    state = endpoint(())
    instance = _begin(state, ("p0", "p1"), now=5.0, timeout_s=2.0)
    state.handle(BootstrapTick(instance), 5.0)
    announce(state, 0, "p0", 1, 5.5)
    [wait] = state.handle(BootstrapTick(instance), 6.99)[-1:]
    assert wait == AwaitAnswers(7.0)  # the deadline comes before the next re-send
    [give_up] = state.handle(BootstrapTick(instance), 7.0)
    assert isinstance(give_up, GiveUp) and isinstance(give_up.error, BootstrapError)
    assert "1 of 2 prefill ranks answered within 2.0 s (unanswered: p1;" in str(give_up.error)
    assert state.instances == {} and state.pending == {}  # nothing kept
    # the addresses are free again: a later bootstrap may try them
    assert _begin(state, ("p0", "p1"), now=8.0).addresses == ("p0", "p1")


def test_an_answer_that_came_by_the_deadline_is_taken() -> None:
    state = endpoint(())
    instance = _begin(state, ("p0",), timeout_s=1.0)
    state.handle(BootstrapTick(instance), 0.0)
    announce(state, 0, "p0", 1, 0.9)
    assert state.handle(BootstrapTick(instance), 3.0) == [Bootstrapped(instance)]  # the waiter was late


def test_a_refusal_or_a_wrong_set_of_ranks_gives_up_once_every_rank_answered() -> None:
    state = endpoint(())
    refused = _begin(state, ("p0", "p1"))
    state.handle(BootstrapTick(refused), 0.0)
    assert state.handle(HelloAck(0, "p0", HERE, 1, 1, "layouts do not fit", 1), 0.1) == [Answered("p0")]
    assert state.handle(BootstrapTick(refused), 0.1) == [AwaitAnswers(0.3)]  # p1 may still answer
    announce(state, 1, "p1", 1, 0.2)
    [give_up] = state.handle(BootstrapTick(refused), 0.2)
    assert isinstance(give_up, GiveUp) and "p0: layouts do not fit" in str(give_up.error)
    wrong = _begin(state, ("q0", "q1"))
    announce(state, 1, "q0", 1, 0.3)
    announce(state, 2, "q1", 1, 0.3)
    [give_up] = state.handle(BootstrapTick(wrong), 0.3)
    assert isinstance(give_up, GiveUp) and "ranks [1, 2] answered, expected 0..1" in str(give_up.error)
    assert state.instances == {}


def test_a_bootstrap_hellos_under_the_name_its_endpoint_has_now() -> None:
    state = endpoint(())
    state.name, state.metadata = f"{NAME}.f1", b"fenced"  # what an owner fence leaves
    instance = _begin(state, ("p0",))
    [send, _] = state.handle(BootstrapTick(instance), 0.0)
    assert isinstance(send, Send) and isinstance(send.message, Hello)
    assert (send.message.decode, send.message.metadata) == (f"{NAME}.f1", b"fenced")


def test_a_second_instance_gets_ids_after_the_first_and_its_own_heartbeat_clock() -> None:
    state = endpoint((("a0", "a1"),))
    instance = _begin(state, ("b0",), now=3.0)
    state.handle(BootstrapTick(instance), 3.0)
    announce(state, 0, "b0", 9, 3.1)
    assert state.handle(BootstrapTick(instance), 3.1) == [Bootstrapped(instance)]
    assert instance.ids == (2,) and state.writers[2] == writer("b0", 9)


@pytest.mark.parametrize(
    ("addresses", "match"),
    [((), "at least one rank address"), (("p0", "p0"), "name one rank twice")],
)
def test_bad_addresses_are_refused_with_nothing_recorded(addresses: tuple[str, ...], match: str) -> None:
    state = endpoint(())
    with pytest.raises(ValueError, match=match):
        _begin(state, addresses)
    assert state.pending == {}


def test_the_schedule_runs_on_the_waiters_clock_the_ranks_are_heard_from_on_the_endpoints() -> None:
    """The runtime's waiter blocks an engine call: its waits are real time,
    while a test may run the endpoint's timers on a clock of its own."""
    state = endpoint(())
    instance = _begin(state, ("p0",), now=7.0, timeout_s=1.0)  # the waiter's clock
    assert state.handle(BootstrapTick(instance, 7.0), 1000.0)[-1] == AwaitAnswers(7.25)
    assert state.handle(BootstrapTick(instance, 7.1), 1000.0) == [
        AwaitAnswers(7.25)
    ]  # endpoint's clock frozen
    [give_up] = state.handle(BootstrapTick(instance, 8.0), 1000.0)
    assert isinstance(give_up, GiveUp)
    other = _begin(state, ("q0",), now=9.0)
    announce(state, 0, "q0", 1, 1000.0)
    assert state.handle(BootstrapTick(other, 9.1), 1000.0) == [Bootstrapped(other)]
    assert state._heard[other.ids[0]] == 1000.0  # heartbeats count on the endpoint's clock
