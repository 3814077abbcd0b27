"""A decode endpoint's bootstrap of a prefill instance, sans-I/O: the Hellos,
when they are re-sent, when the bootstrap gives up, and what its answers make
of the instance (:class:`EndpointState` calls these; the state is its).

The runtime's waiter feeds :class:`~kvconn.protocol.endpoint_events.BootstrapTick`
whenever it wakes (with the time on its own clock: the schedule runs on the
waiter's clock, the ranks are heard from at the endpoint's ``now``) (an answer came, or its wait ran out) and
carries out what comes back: Hellos to send, :class:`AwaitAnswers` (wait
until then, or until an answer wakes it), and at the end
:class:`Bootstrapped` (the instance is kept) or :class:`GiveUp` (raise its
error). A Hello or its HelloAck can be lost, and a rank's connection to an
earlier decode at our address, not yet seen closed, takes the HelloAck with
it: the unanswered ranks are Hello'd again every ``resend_every`` (a rank
answers a repeated Hello as the first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kvconn.errors import BootstrapError, RequestError, UnavailableError
from kvconn.protocol import wire
from kvconn.protocol.endpoint_events import Action, AwaitAnswers, Bootstrapped, GiveUp, Instance, Send
from kvconn.protocol.messages import Hello

if TYPE_CHECKING:
    from kvconn.protocol.endpoint import EndpointState

#: Hellos a bootstrap sends at least within its deadline.
MIN_HELLOS = 4


def resend_every(resend_interval_s: float, timeout_s: float) -> float:
    """How often a bootstrap Hellos its unanswered ranks: every
    ``resend_interval_s``, but at least :data:`MIN_HELLOS` times within
    ``timeout_s`` (one lost Hello must not cost the whole bootstrap)."""
    return min(resend_interval_s, timeout_s / MIN_HELLOS)


def begin(
    state: EndpointState,
    addresses: tuple[str, ...],
    hello: Hello,
    at: float,
    timeout_s: float,
    resend_interval_s: float,
) -> Instance:
    """Start bootstrapping the instance at ``addresses`` at ``at`` (the
    waiter's clock); refused (nothing recorded) with
    :class:`~kvconn.errors.RequestError` for no address, one named twice,
    or a rank of another instance."""
    if state.endpoint_down is not None:
        raise UnavailableError(
            f"decode has no transport endpoint since its owner fence ({state.endpoint_down}): "
            "no prefill instance can be bootstrapped until it makes a new one",
            cause="endpoint_down",
        )
    if not addresses:
        raise RequestError("a prefill instance needs at least one rank address")
    if len(set(addresses)) != len(addresses):
        raise RequestError(f"prefill addresses {list(addresses)} name one rank twice")
    taken = [a for a in addresses if a in state._id_at or a in state.pending]
    if taken:
        raise RequestError(
            f"prefill addresses {taken} are ranks of another prefill instance of this endpoint"
        )
    instance = Instance(addresses, hello)
    instance.timeout_s = timeout_s
    instance.give_up_at = at + timeout_s
    instance.resend_at = at
    instance.resend_every = resend_every(resend_interval_s, timeout_s)
    for address in addresses:
        state.pending[address] = instance
    return instance


def unanswered(instance: Instance) -> list[str]:
    """The addresses of ``instance`` that have neither answered nor refused."""
    answered = {w.address for w in instance.answers.values()} | set(instance.refusals)
    return [a for a in instance.addresses if a not in answered]


def hello(state: EndpointState, instance: Instance) -> Hello:
    """``instance``'s Hello, with this endpoint's name and region metadata
    since its last owner fence."""
    if state.metadata is None:
        return instance.hello
    return attrs.evolve(instance.hello, decode=state.name, metadata=state.metadata)


def step(state: EndpointState, instance: Instance, now: float, at: float) -> list[Action]:
    """The bootstrap's waiter woke at ``at`` on its clock (``now`` on the
    endpoint's): Hello the ranks still silent if it is time, and say how
    long to wait; or end it."""
    waiting = unanswered(instance)
    if not waiting:
        return over(state, instance, now)
    if at >= instance.give_up_at:
        answered = len(instance.addresses) - len(waiting)
        forget(state, instance)
        # A rank of another wire version or key drops every Hello unread
        # and cannot answer: only its own drop counter can tell which.
        return [
            GiveUp(
                BootstrapError(
                    f"{answered} of {len(instance.addresses)} prefill ranks answered within "
                    f"{instance.timeout_s} s (unanswered: {', '.join(waiting)}; a rank that counts "
                    "Hellos as dropped, bad_version or bad_mac, speaks another wire version than this "
                    f"side's {wire.VERSION} or holds another key)"
                )
            )
        ]
    actions: list[Action] = []
    if at >= instance.resend_at:
        actions += [Send(address, hello(state, instance)) for address in waiting]
        instance.resend_at = at + instance.resend_every
    return [*actions, AwaitAnswers(min(instance.resend_at, instance.give_up_at))]


def over(state: EndpointState, instance: Instance, now: float) -> list[Action]:
    """Every rank answered: keep the instance, giving its ranks endpoint-wide
    ids, unless a rank refused or the ranks that answered are not 0..n-1."""
    forget(state, instance)
    if instance.refusals:
        return [GiveUp(BootstrapError("; ".join(f"{a}: {e}" for a, e in instance.refusals.items())))]
    if sorted(instance.answers) != list(range(len(instance.addresses))):
        expected = f"0..{len(instance.addresses) - 1}"
        return [GiveUp(BootstrapError(f"ranks {sorted(instance.answers)} answered, expected {expected}"))]
    # Ids follow on from the instances before: the first instance's ranks
    # keep their own numbers.
    first = max(state.ranks, default=-1) + 1
    instance.ids = tuple(range(first, first + len(instance.addresses)))
    for rank, writer in instance.answers.items():
        rank_id = instance.ids[rank]
        state.writers[rank_id] = writer
        state._rank_of[rank_id] = (instance, rank)
        state._id_at[writer.address] = rank_id
        state._id_of_session[rank, writer.session] = rank_id
        state._heard[rank_id] = now
    if not state.ranks:
        state._next_heartbeat = now + state.heartbeat_interval_s
    state.ranks |= frozenset(instance.ids)
    state.instances[instance.addresses] = instance
    return [Bootstrapped(instance)]


def forget(state: EndpointState, instance: Instance) -> None:
    """``instance``'s bootstrap is over, kept or not: its later HelloAcks are
    heartbeats (or strangers')."""
    for address in instance.addresses:
        if state.pending.get(address) is instance:
            del state.pending[address]


__all__ = ["MIN_HELLOS", "begin", "forget", "hello", "over", "resend_every", "step", "unanswered"]
