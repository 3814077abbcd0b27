"""The rule between the two sides' deadlines: a live writer gives up on a
write before decode gives up waiting for its ack.

A prefill rank fails a chunk not settled within its write deadline
(``Config.write_timeout_s``, and the transport's own longest wait for a
write, ``Capabilities.max_write_timeout_s``); decode quarantines an aborted
room not proven within ``abort_timeout_s``. Were the writer's deadline the
longer, a writer that is merely slow would still be inside a post when
decode's deadline passed, and the deadline would be how pages came back.
Decode checks its transport's limit when it is built, each rank checks its
own and its transport's against the deadline every decode's Hello names,
and ``Config`` checks the pair it is given: all with :func:`check_writer_deadline`.
"""

from __future__ import annotations

from kvconn.errors import DeadlineError


def writer_gives_up_first(write_timeout_s: float, abort_timeout_s: float) -> bool:
    """A writer whose deadline is ``write_timeout_s`` stops before decode's
    ``abort_timeout_s`` passes."""
    return write_timeout_s < abort_timeout_s


def check_writer_deadline(
    write_timeout_s: float, abort_timeout_s: float, what: str = "write_timeout_s"
) -> None:
    """Raise :class:`~kvconn.errors.DeadlineError` (a ValueError) unless
    :func:`writer_gives_up_first`; ``what`` names the writer's deadline."""
    if not writer_gives_up_first(write_timeout_s, abort_timeout_s):
        raise DeadlineError(
            f"{what} ({write_timeout_s} s) must be shorter than decode's abort_timeout_s "
            f"({abort_timeout_s} s): a live writer has to give up before decode quarantines"
        )


__all__ = ["check_writer_deadline", "writer_gives_up_first"]
