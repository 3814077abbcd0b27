"""The rule between the two sides' deadlines: a live writer gives up on a
write before decode gives up waiting for its ack.

A prefill rank fails a chunk not settled within its write deadline
(``Config.write_timeout_s``, and the transport's own longest wait for a
write, ``Capabilities.max_write_timeout_s``); decode quarantines an aborted
room not proven within ``abort_timeout_s``. Were the writer's deadline the
longer, a writer that is merely slow would still be inside a post when
decode's deadline passed, and the deadline would be how pages came back.
Decode checks its transport's limit when it is built and ``Config`` checks
the pair it is given (:func:`check_writer_deadline`); each rank checks its
own and its transport's against the deadline every decode's Hello names
(:func:`deadline_conflict`, the reason its HelloAck refuses with,
``protocol/rank_bootstrap.py``): all with :func:`writer_gives_up_first`.
"""

from __future__ import annotations

from kvconn.errors import DeadlineError


def writer_gives_up_first(write_timeout_s: float, abort_timeout_s: float) -> bool:
    """A writer whose deadline is ``write_timeout_s`` stops before decode's
    ``abort_timeout_s`` passes."""
    return write_timeout_s < abort_timeout_s


def deadline_conflict(write_timeout_s: float, abort_timeout_s: float, what: str = "write_timeout_s") -> str:
    """Why the writer's deadline does not fit under decode's ("" when
    :func:`writer_gives_up_first`): what a rank's HelloAck refusal says and
    what :func:`check_writer_deadline` raises; ``what`` names the writer's
    deadline."""
    if writer_gives_up_first(write_timeout_s, abort_timeout_s):
        return ""
    return (
        f"{what} ({write_timeout_s} s) must be shorter than decode's abort_timeout_s "
        f"({abort_timeout_s} s): a live writer has to give up before decode quarantines"
    )


def check_writer_deadline(
    write_timeout_s: float, abort_timeout_s: float, what: str = "write_timeout_s"
) -> None:
    """Raise :class:`~kvconn.errors.DeadlineError` (a ValueError) unless
    :func:`writer_gives_up_first`, saying :func:`deadline_conflict`."""
    conflict = deadline_conflict(write_timeout_s, abort_timeout_s, what)
    if conflict:
        raise DeadlineError(conflict)


__all__ = ["check_writer_deadline", "deadline_conflict", "writer_gives_up_first"]
