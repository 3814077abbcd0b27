"""The owner fence on a NIXL region: the region's whole agent destroyed and
its memory registered with a new one. After it the memory is intact, the old
metadata lands nothing (a writer still connected with it, a new writer given
it), and writers connecting with the new metadata write byte-exact. (The
frozen-writer proof, across hosts too, is the conformance suite's
``test_owner_fence_stops_frozen_writer``.)"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import pytest

import kvconn_nixl
from kvconn.testing.libraries import require_library

kvconn_nixl.prepare_env()
require_library("nixl", module_level=True)  # by the library: the plugin installs without it

import numpy as np  # noqa: E402
from nixl_procs import PAGE, children, pattern, writer_main  # noqa: E402

from kvconn.transport import OwnerFenceFailed, OwnerFenceUnsupported, owner_fence  # noqa: E402
from kvconn_nixl import backend  # noqa: E402

MiB = 1 << 20
REGION = 16 * MiB


def digest(region: Any) -> str:
    return hashlib.sha256(region.array().tobytes()).hexdigest()


def exact(region: Any, seed: int, segs: list[tuple[int, int, int]]) -> bool:
    src, arr = pattern(seed, REGION), region.array()
    return all(np.array_equal(arr[d : d + n], src[s : s + n]) for s, d, n in segs)


def lands(w: Any, *cmd: Any) -> bool:
    """Whether the child's ``cmd`` (a connect, a write) succeeded: a write
    must answer "landed", a connect True; NIXL may raise instead of failing."""
    try:
        out = w.call(*cmd)
    except Exception:  # e.g. nixlRemoteDisconnectError: refused
        return False
    return out is True or (isinstance(out, tuple) and out[0] == "landed")


def test_owner_fence_keeps_memory_and_cuts_the_old_metadata() -> None:
    region = backend.open_region(REGION, {})
    try:
        md0 = region.metadata
        with children((writer_main, REGION, {}), (writer_main, REGION, {})) as (w1, w2):
            w1.call("fill_seed", 1)
            w1.call("connect", "d", md0)
            first = [(0, 0, 4 * MiB), (5 * MiB, 9 * MiB, MiB + 17)]
            assert w1.call("write", "d", first, 20)[0] == "landed"
            assert exact(region, 1, first)
            before = digest(region)

            md1 = owner_fence(region)
            print(f"NIXL owner_fence {region.last_owner_fence_s * 1000:.0f} ms")
            assert md1 != md0 and region.metadata == md1
            assert digest(region) == before  # memory and contents stay

            # The old metadata lands nothing: the writer still connected with
            # it, and a writer handed it now (loading it may fail, or the write).
            assert not lands(w1, "write", "d", [(8 * MiB, 12 * MiB, 2 * MiB)], 3)
            w2.call("fill_seed", 2)
            if lands(w2, "connect", "old", md0):
                assert not lands(w2, "write", "old", [(0, 0, MiB)], 3)
            assert digest(region) == before

            # Writers connecting with the new metadata write byte-exact (w1: a re-bootstrap).
            assert w2.call("connect", "new", md1) is True
            second = [(MiB + i * PAGE, 12 * MiB + (63 - i) * PAGE, PAGE) for i in range(64)]
            assert w2.call("write", "new", second, 20)[0] == "landed"
            assert exact(region, 2, second)
            assert w1.call("connect", "d", md1) is True
            third = [(0, 14 * MiB, MiB)]
            assert w1.call("write", "d", third, 20)[0] == "landed"
            assert exact(region, 1, [*first, *third])

            md2 = owner_fence(region)  # and again
            assert md2 not in (md0, md1)
    finally:
        region.close()


def test_owner_fence_refused_where_unproven() -> None:
    assert backend.capabilities.owner_fence is True
    assert backend.capabilities_for({"ucx_tls": "cma"}).owner_fence is False
    region = backend.open_region(MiB, {})
    # A region whose options were cma (UCX cma cannot start on every host):
    # the check is the region's, on its own options.
    region.options = attrs.evolve(region.options, ucx_tls="cma")
    try:
        with pytest.raises(OwnerFenceUnsupported, match="not proven"):
            owner_fence(region)
    finally:
        region.close()


def test_owner_fence_refused_while_the_agent_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent something else still references is not destroyed: no fence
    (an error, never new metadata that would pretend one)."""
    region = backend.open_region(MiB, {})
    held = region._agent.agent  # a stray reference, as a traceback's frame would keep
    try:
        with pytest.raises(OwnerFenceFailed, match="outlived"):
            owner_fence(region)
        del held
        assert owner_fence(region) != b""  # nothing holds it now: the next call fences
    finally:
        region.close()
