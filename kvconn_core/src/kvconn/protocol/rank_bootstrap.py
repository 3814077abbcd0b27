"""Whether a prefill rank takes a decode's bootstrap (its Hello), sans-I/O
(decode's side of the bootstrap: ``bootstrap.py``).

A Hello is refused, with a reason the decode sees in its HelloAck, when:

* the decode uses another transport;
* this rank's write deadline (or its transport's own longest wait) is not
  shorter than decode's abort deadline: a live writer must give up on a
  write before decode quarantines the room, or decode would hold pages a
  write can still reach past the point where it stops waiting for proof
  (:func:`kvconn.protocol.write_deadline.deadline_conflict`: the rule
  :class:`kvconn.config.Config` and decode's constructor check at start-up);
* the two layouts do not fit (the runtime pairs them: :class:`Pairing`);
* it names a known decode with another address or layout: a decode's name
  is new with every endpoint, so it is not that decode's own (nor may a
  replay reset it);
* the writer failed to connect to it.

Otherwise the rank connects its writer (a new decode, or one at the address
another decode listened at: that one is gone, one endpoint binds an
address) and acks. A Hello of a known decode, unchanged, is acked at once.
:class:`~kvconn.protocol.rank.RankState` calls these; ``runtime/`` pairs the
layouts and connects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvconn.protocol.messages import Hello
from kvconn.protocol.rank_events import AnswerHello, Bootstrap, Connect, Pairing, Peer
from kvconn.protocol.write_deadline import deadline_conflict

if TYPE_CHECKING:
    from kvconn.protocol.rank import Action, RankState


def refusal(state: RankState[Any], hello: Hello) -> str:
    """Why the rank refuses ``hello`` before looking at its layout ("": it
    does not)."""
    terms = state.writer
    if terms is None:
        return "this rank has no writer to bootstrap"
    if hello.backend != terms.backend:
        return f"decode uses backend {hello.backend!r}, this rank {terms.backend!r}"
    abort_timeout_s = hello.abort_timeout_ms / 1000
    conflict = deadline_conflict(terms.write_timeout_s, abort_timeout_s)
    if not conflict and terms.max_write_timeout_s is not None:
        what = f"{terms.backend}'s write timeout"
        conflict = deadline_conflict(terms.max_write_timeout_s, abort_timeout_s, what)
    return conflict


def hello(state: RankState[Any], msg: Hello) -> list[Action]:
    """A Hello arrived: refused at once, or the runtime pairs the layouts."""
    why = refusal(state, msg)
    return [AnswerHello(msg, why)] if why else [Bootstrap(msg)]


def paired(state: RankState[Any], msg: Hello, pairing: Pairing[Any]) -> list[Action]:
    """The runtime paired the layouts: refuse, ack a known decode, or connect."""
    if pairing.layout is None:
        return [AnswerHello(msg, pairing.misfit or "the layouts do not fit")]
    known = state.peers.get(msg.decode)
    if known is None:
        reset = any(peer.reply_to == msg.reply_to for peer in state.peers.values())
        return [Connect(msg, pairing, reset)]
    if (known.reply_to, known.layout) != (msg.reply_to, pairing.layout):
        return [
            AnswerHello(msg, f"decode {msg.decode} is already bootstrapped with another address or layout")
        ]
    return [AnswerHello(msg)]


def connected(state: RankState[Any], connect: Connect, error: str) -> list[Action]:
    """The writer connected to the decode (``error``: it raised, and why)."""
    if error:
        return [AnswerHello(connect.hello, error)]
    # A second Hello that raced this one keeps the first.
    state.peers.setdefault(connect.hello.decode, Peer(connect.hello.reply_to, connect.pairing))
    return [AnswerHello(connect.hello)]


__all__ = ["connected", "hello", "paired", "refusal"]
