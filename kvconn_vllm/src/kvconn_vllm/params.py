"""What travels in vLLM's ``kv_transfer_params`` between prefill, the proxy
and decode, and how a room id is derived from a vLLM request id.

A proxy sends the prompt to prefill with ``{"do_remote_decode": True}`` and
``max_tokens=1``; prefill's output carries :meth:`RemotePrefill.to_params`;
the proxy sends the prompt to decode with those params unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
ROOM = "kvconn_room"
PREFILL = "kvconn_prefill"
NUM_TOKENS = "remote_num_tokens"

#: Rooms are unsigned 63-bit on the wire.
_ROOM_BITS = 63


class ParamsError(ValueError):
    """``kv_transfer_params`` that ask for a kvconn transfer but are malformed."""


def room_for(engine_id: str, request_id: str) -> int:
    """The room of ``request_id`` at the prefill engine ``engine_id``.

    vLLM request ids are unique within one engine only; every prefill
    instance has its own engine id, so two instances never derive one room
    (a decode tracks rooms of every instance in one table) unless 63-bit
    hashes collide, which decode detects and fails safe (the request is
    recomputed)."""
    digest = hashlib.blake2b(f"{engine_id}\0{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - _ROOM_BITS)


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    return bool(params and params.get(DO_REMOTE_DECODE))


@attrs.frozen
class RemotePrefill:
    """Where decode's KV comes from: ``room`` at the ranks ``prefill``
    (addresses in rank order), ``num_tokens`` of it."""

    room: int
    prefill: tuple[str, ...]
    num_tokens: int

    def to_params(self) -> dict[str, Any]:
        return {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            ROOM: self.room,
            PREFILL: list(self.prefill),
            NUM_TOKENS: self.num_tokens,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> RemotePrefill | None:
        """The remote prefill ``params`` ask for, None if they ask for none.
        Raises ParamsError naming the bad field."""
        if not params or not params.get(DO_REMOTE_PREFILL):
            return None
        room = params.get(ROOM)
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << _ROOM_BITS:
            raise ParamsError(f"{ROOM} must be an int in [0, 2**63), got {room!r}")
        prefill = params.get(PREFILL)
        if (
            isinstance(prefill, str)
            or not isinstance(prefill, Sequence)
            or not prefill
            or not all(isinstance(a, str) and a for a in prefill)
        ):
            raise ParamsError(f"{PREFILL} must be a non-empty list of rank addresses, got {prefill!r}")
        num_tokens = params.get(NUM_TOKENS)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ParamsError(f"{NUM_TOKENS} must be a positive int, got {num_tokens!r}")
        return cls(room, tuple(prefill), num_tokens)
