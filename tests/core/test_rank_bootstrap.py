"""Whether a prefill rank takes a decode's bootstrap, decided by RankState:
each Hello is a stimulus, the runtime's pairing of the layouts and the
writer's connect are stimuli, and an accept or a refusal (with its reason)
is an action. No sockets, no layouts: the pairing is given."""

from __future__ import annotations

import re

import pytest

from kvconn.config import Config, check_deadlines
from kvconn.errors import DeadlineError
from kvconn.protocol.ledger import RoomLedger
from kvconn.protocol.messages import Hello
from kvconn.protocol.rank import AnswerHello, Bootstrap, Connect, Pairing, RankState, WriterTerms
from kvconn.protocol.write_deadline import deadline_conflict

TERMS = WriterTerms("loopback", write_timeout_s=2.0, max_write_timeout_s=None)
FITS = Pairing("layout", tp_size=2, source_pages=8)


def _state(terms: WriterTerms | None = TERMS) -> RankState[str]:
    return RankState(RoomLedger(0, 60.0, 7), writer=terms)


def _hello(
    decode: str = "d", reply_to: str = "tcp://d", backend: str = "loopback", abort_s: float = 5.0
) -> Hello:
    return Hello(decode, reply_to, backend, 4096, 1, int(abort_s * 1000), b"meta")


def _bootstrap(state: RankState[str], hello: Hello, pairing: Pairing[str] = FITS, error: str = "") -> str:
    """The whole exchange, as the runtime carries it out; the HelloAck's error."""
    actions = state.handle(hello, 0.0)
    if actions == [Bootstrap(hello)]:
        actions = state.bootstrap(hello, pairing)
    if len(actions) == 1 and isinstance(actions[0], Connect):
        actions = state.connected(actions[0], error)
    (answer,) = actions
    assert isinstance(answer, AnswerHello) and answer.hello == hello
    return answer.error


def test_a_fitting_hello_is_connected_then_acked_and_its_decode_is_a_peer() -> None:
    state, hello = _state(), _hello()
    assert state.handle(hello, 0.0) == [Bootstrap(hello)]
    (connect,) = state.bootstrap(hello, FITS)
    assert connect == Connect(hello, FITS, reset=False)
    assert "d" not in state.peers  # not before the writer connected
    assert state.connected(connect) == [AnswerHello(hello)]
    peer = state.peers["d"]
    assert (peer.reply_to, peer.layout, peer.tp_size) == ("tcp://d", "layout", 2)
    assert _bootstrap(state, hello) == ""  # the same Hello again: acked, nothing connected
    assert state.bootstrap(hello, FITS) == [AnswerHello(hello)]


def test_a_decode_of_another_transport_is_refused_before_any_pairing() -> None:
    state, hello = _state(), _hello(backend="nixl")
    assert state.handle(hello, 0.0) == [
        AnswerHello(hello, "decode uses backend 'nixl', this rank 'loopback'")
    ]
    assert not state.peers


@pytest.mark.parametrize(
    ("terms", "abort_s", "why"),
    [
        (TERMS, 2.0, "write_timeout_s (2.0 s) must be shorter than decode's abort_timeout_s (2.0 s)"),
        (TERMS, 1.5, "write_timeout_s (2.0 s) must be shorter"),
        (
            WriterTerms("loopback", 2.0, max_write_timeout_s=6.0),
            5.0,
            "loopback's write timeout (6.0 s) must be shorter than decode's abort_timeout_s (5.0 s)",
        ),
    ],
)
def test_a_writer_deadline_not_shorter_than_decodes_is_refused(
    terms: WriterTerms, abort_s: float, why: str
) -> None:
    """The rule Config checks at start-up, checked again against each decode."""
    state, hello = _state(terms), _hello(abort_s=abort_s)
    (answer,) = state.handle(hello, 0.0)
    assert isinstance(answer, AnswerHello) and why in answer.error
    assert not state.peers


def test_a_writer_deadline_just_shorter_is_taken() -> None:
    assert (
        _bootstrap(_state(WriterTerms("loopback", 2.0, max_write_timeout_s=4.9)), _hello(abort_s=5.0)) == ""
    )


def test_config_and_bootstrap_apply_the_same_rule() -> None:
    assert deadline_conflict(1.0, 2.0) == ""
    with pytest.raises(DeadlineError, match=re.escape(deadline_conflict(2.0, 2.0))):
        check_deadlines(2.0, 2.0)
    (answer,) = _state().handle(_hello(abort_s=2.0), 0.0)  # the rank refuses with the same words
    assert isinstance(answer, AnswerHello) and answer.error == deadline_conflict(2.0, 2.0)
    with pytest.raises(ValueError, match="must be shorter"):
        Config(write_timeout_s=3.0, abort_timeout_s=3.0)


def test_layouts_that_do_not_fit_are_refused_with_the_pairings_reason() -> None:
    state, hello = _state(), _hello()
    misfit = Pairing[str](None, "decode's pages are an engine layout")
    assert _bootstrap(state, hello, misfit) == "decode's pages are an engine layout"
    assert not state.peers


def test_a_hello_changing_a_known_decode_is_refused() -> None:
    """A decode's name is new with every endpoint: another address or layout
    under a known name is not that decode's (nor may a replay reset it)."""
    state = _state()
    assert _bootstrap(state, _hello()) == ""
    assert "already bootstrapped" in _bootstrap(state, _hello(reply_to="tcp://elsewhere"))
    assert "already bootstrapped" in _bootstrap(state, _hello(), Pairing("other layout", source_pages=8))
    assert state.peers["d"].reply_to == "tcp://d"


def test_a_new_decode_at_a_known_address_resets_the_connection_there() -> None:
    state = _state()
    assert _bootstrap(state, _hello("d1", "tcp://x")) == ""
    hello = _hello("d2", "tcp://x")
    state.handle(hello, 0.0)
    assert state.bootstrap(hello, FITS) == [Connect(hello, FITS, reset=True)]
    other = _hello("d3", "tcp://y")
    assert state.bootstrap(other, FITS) == [Connect(other, FITS, reset=False)]


def test_a_writer_that_cannot_connect_refuses_and_records_nothing() -> None:
    state = _state()
    assert _bootstrap(state, _hello(), error="connect raised") == "connect raised"
    assert not state.peers


def test_two_hellos_that_raced_keep_the_first_connected() -> None:
    state, hello = _state(), _hello()
    (first,) = state.bootstrap(hello, FITS)
    (second,) = state.bootstrap(hello, Pairing("late", source_pages=8))  # before either connected
    assert isinstance(first, Connect) and isinstance(second, Connect)
    state.connected(first)
    assert state.connected(second) == [AnswerHello(hello)]
    assert state.peers["d"].layout == "layout"


def test_a_rank_with_no_writer_takes_no_bootstrap() -> None:
    state, hello = _state(None), _hello()
    assert state.handle(hello, 0.0) == [AnswerHello(hello, "this rank has no writer to bootstrap")]
