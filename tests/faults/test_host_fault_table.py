"""The five faults between hosts (``kvconn.testing.host_faults``, the fault
table of ``kvconn bench --hosts``), kvconn's mode, on nixl and on mooncake:
a prefill host partitioned and healed late, lost, frozen, the decode host
restarted, and one of two prefill hosts lost while the other serves. For
each: no page a late write corrupted, no page pinned for good (every page
back, by a proof, never at a deadline), and the other host's rooms that
completed landed byte for byte.

Each backend runs the five faults one after the other in one call. Mooncake
runs with its engine's write timeout at its floor (5 s, ``MC_TRANSFER_TIMEOUT``),
so decode's deadline is 6 s rather than 11 s: the faults are the same, the
waits shorter.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvconn.testing import host_faults, hosts
from kvconn.testing.host_faults import HostOutcome
from kvconn.testing.libraries import why_unavailable

pytestmark = pytest.mark.skipif(bool(hosts.unavailable()), reason=hosts.unavailable() or "n/a")

#: The other host's stream of rooms runs through these faults.
STREAMED = ("partition", "frozen", "lost_one_of_two")


@pytest.fixture
def fabric() -> Iterator[hosts.Fabric]:
    with hosts.hosts(("decode", "prefill0", "prefill1")) as made:
        yield made


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_every_host_fault_corrupts_nothing_and_pins_nothing(
    backend: str, fabric: hosts.Fabric, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if why_unavailable(backend):
        pytest.skip(f"{backend}: {why_unavailable(backend)}")
    if backend == "mooncake":  # read by this process (decode's deadline) and by every child
        monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
        monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "5")
    started = time.monotonic()
    outcomes = host_faults.run_all(fabric, backend, {}, host_faults.FAULTS, lambda _: None, modes=("kvconn",))
    took = time.monotonic() - started
    with capsys.disabled():  # the figures, for whoever reads the CI log
        print(f"\n{backend}: the five host faults in {took:.0f} s")
        for o in outcomes:
            print("  " + _line(o))
    assert [o.fault for o in outcomes] == list(host_faults.FAULTS)
    for o in outcomes:
        assert o.mode == "kvconn" and o.owner_fence, o
        assert o.corrupted_pages == 0, _line(o)  # no late write reached a page handed back
        assert o.held_pages == 0, _line(o)  # nothing pinned: every page came back ...
        assert o.back_s is not None and o.proof, _line(o)  # ... by a proof (or a fresh decode that serves)
        assert o.proof != "unsafe_timeout", _line(o)  # never at a deadline
        assert o.others_wrong == 0, _line(o)
        if o.fault in STREAMED:
            assert o.others_done > 0, _line(o)  # the other host kept serving
    by_fault = {o.fault: o for o in outcomes}
    # A lost host can give no proof: its pages came back by decode's own fence.
    assert by_fault["lost"].proof == "owner_fence"
    assert by_fault["lost_one_of_two"].proof == "owner_fence"
    assert by_fault["decode_restart"].proof == "fresh decode: a new room completed"


def _line(o: HostOutcome) -> str:
    back = "held" if o.back_s is None else f"{o.back_s:.1f} s by {o.proof}"
    return (
        f"{o.fault}: corrupted {o.corrupted_pages}, held {o.held_pages} of {o.pages}, back after {back}; "
        f"other host {o.others_failed} failed / {o.others_done} done / {o.others_wrong} wrong"
    )
