"""Why a control frame was dropped: the ``reason`` label of
``kvconn_dropped_messages_total``.

A dropped frame is counted and ignored; a listener never stops for one.
``docs/metrics.md`` explains each reason; a test checks that it lists all of
them.
"""

from __future__ import annotations

import enum


class DropReason(str, enum.Enum):
    """One reason a frame was dropped, never acted on."""

    # A frame that does not decode (protocol/wire.py).
    OVERSIZE = "oversize"
    SHORT = "short"
    BAD_MAC = "bad_mac"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    UNKNOWN_TAG = "unknown_tag"
    BAD_BODY = "bad_body"
    TRAILING_BYTES = "trailing_bytes"
    # ABORT_ACKs at decode that prove nothing (protocol/hold.py).
    NOT_HELD = "not_held"
    STRANGER_RANK = "stranger_rank"
    STALE_GENERATION = "stale_generation"
    DUPLICATE = "duplicate"
    DRAIN_BACKLOG_FULL = "drain_backlog_full"
    # Acks and statuses meant for another decode endpoint or rank process.
    OTHER_DECODE = "other_decode"
    OTHER_SESSION = "other_session"
    # Other messages that decode but prove nothing.
    STRANGER_STATUS = "stranger_status"
    STRANGER_HELLO = "stranger_hello"
    HELLO_ACK_CHANGED = "hello_ack_changed"
    HELLO_REFUSED = "hello_refused"
    RETIRED_SESSION = "retired_session"
    STALE_REQUEST = "stale_request"
    UNKNOWN_DECODE = "unknown_decode"
    UNEXPECTED_TYPE = "unexpected_type"
    BAD_REPLY_TO = "bad_reply_to"
    # Frames this endpoint could not send.
    UNSENDABLE_ADDRESS = "unsendable_address"
    SEND_QUEUE_FULL = "send_queue_full"
    # The listener's own trouble (a bug: the log has the traceback).
    HANDLER_ERROR = "handler_error"
    IDLE_ERROR = "idle_error"

    def __str__(self) -> str:
        # The metric label is the value, on every Python kvconn supports.
        return self.value
