"""The owner fence on a Mooncake region: the region's engine destroyed and
its memory registered with a new one. After it the memory is intact, the old
metadata lands nothing (a writer still connected with it, a new writer given
it), and writers connecting with the new metadata write byte-exact. (The
frozen-writer proof, across hosts too, is the conformance suite's
``test_owner_fence_stops_frozen_writer``.)"""

from __future__ import annotations

from typing import Any

from kvconn.testing.libraries import require_library

require_library("mooncake", module_level=True)  # by the library: the plugin installs without it

MiB = 1 << 20
REGION = 16 * MiB


def test_owner_fence_keeps_memory_and_cuts_the_old_metadata(spawn: Any) -> None:
    decode, w1, w2 = spawn(3)
    md0 = decode.call("region_open", REGION)
    w1.call("writer_open", REGION, 1, {})
    assert w1.call("connect", "d", md0) is True
    first = [(0, 0, 4 * MiB), (5 * MiB, 9 * MiB, MiB + 17)]
    assert w1.call("transfer", "d", first, 20)[0] == "landed"
    assert decode.call("verify", 1, REGION, first) == 0
    before = decode.call("region_digest")

    md1, fence_s = decode.call("owner_fence")
    print(f"MOONCAKE owner_fence {fence_s * 1000:.0f} ms")
    assert md1 != md0 and fence_s < 10
    assert decode.call("region_digest") == before  # memory and contents stay

    # The old metadata lands nothing: the writer still connected with it,
    # and a writer that is handed it now.
    settled, _ = w1.call("transfer", "d", [(8 * MiB, 12 * MiB, 2 * MiB)], 8, timeout=60)
    assert settled != "landed"
    w2.call("writer_open", REGION, 2, {})
    assert w2.call("connect", "old", md0, 10) is False  # the old engine's port is gone
    assert decode.call("region_digest") == before

    # Writers connecting with the new metadata write byte-exact (w1: a re-bootstrap).
    assert w2.call("connect", "new", md1) is True
    second = [(MiB + i * 4096, 12 * MiB + (63 - i) * 4096, 4096) for i in range(64)]
    assert w2.call("transfer", "new", second, 20)[0] == "landed"
    assert decode.call("verify", 2, REGION, second) == 0
    assert w1.call("connect", "d", md1) is True
    third = [(0, 14 * MiB, MiB)]
    assert w1.call("transfer", "d", third, 20)[0] == "landed"
    assert decode.call("verify", 1, REGION, [*first, *third]) == 0

    # A second fence (the region's own engine now) works the same way.
    md2, _ = decode.call("owner_fence")
    assert md2 not in (md0, md1)


def test_owner_fence_refused_while_another_region_shares_the_engine(spawn: Any) -> None:
    (decode,) = spawn(1)
    decode.call("region_open", REGION)
    # A second region in the same process shares the engine: destroying it
    # would fence that one behind its back.
    decode.call("second_region", MiB)
    try:
        decode.call("owner_fence")
    except RuntimeError as exc:
        assert "shares the engine" in str(exc)
    else:
        raise AssertionError("owner fence on a shared engine was not refused")


def test_owner_fence_capability() -> None:
    from kvconn_mooncake import backend

    assert backend.capabilities.owner_fence is True
    assert backend.capabilities_for({"protocol": "rdma"}).owner_fence is False
