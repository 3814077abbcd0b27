"""SGLang's KVPoll and kvconn's, translated by name.

SGLang numbers Failed=0 < Bootstrapping < WaitingForInput < Transferring <
Success=4 and takes the minimum over TP ranks (so one failed rank fails the
request everywhere); kvconn numbers the other way round (FAILED=4). Passing
the integers through would turn a failure into a success.
"""

from __future__ import annotations

from kvconn.runtime.prefill import KVPoll as KvconnPoll

#: kvconn's states by the name SGLang gives the same state.
_SGLANG_NAME = {
    KvconnPoll.BOOTSTRAPPING: "Bootstrapping",
    KvconnPoll.WAITING_FOR_INPUT: "WaitingForInput",
    KvconnPoll.TRANSFERRING: "Transferring",
    KvconnPoll.SUCCESS: "Success",
    KvconnPoll.FAILED: "Failed",
}


def to_sglang(status: KvconnPoll, sglang_poll: type) -> int:
    """kvconn's ``status`` as the value of ``sglang_poll`` (SGLang's KVPoll)."""
    value: int = getattr(sglang_poll, _SGLANG_NAME[status])
    return value


__all__ = ["to_sglang"]
