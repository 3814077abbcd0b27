"""The same chunked writes through the raw nixl API, without kvconn (no hooks,
no Chunk/Segment, no handle table), for side-by-side benchmarks."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from kvconn_nixl._nixl import Options, RegionInfo, make_agent


def raw_write(
    region_metadata: bytes,
    segments: Sequence[tuple[int, int, int]],
    source: np.ndarray,
    options: Mapping[str, str] | None = None,
    repeat: int = 1,
) -> tuple[int, float]:
    """Write ``segments`` ((src, dst, nbytes) byte offsets) from ``source``
    (a contiguous uint8 DRAM array) into the region, ``repeat`` times, one
    transfer per repetition, polling ``check_xfer_state`` until DONE.

    Returns (bytes written, seconds spent posting and waiting). Agent creation,
    registration and connection are not timed. Raises on any nixl error.
    """
    opts = Options.parse(options or {})
    info = RegionInfo.decode(region_metadata)
    rows = np.asarray(segments, dtype=np.uint64).reshape(-1, 3)
    agent = make_agent("raw", opts, progress_thread=bool(opts.progress_thread))
    base = int(source.ctypes.data)
    reg = agent.register_memory([(base, source.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(info.agent_md)
    local = np.stack([rows[:, 0] + np.uint64(base), rows[:, 2], np.zeros_like(rows[:, 2])], axis=1)
    remote = np.stack(
        [rows[:, 1] + np.uint64(info.addr), rows[:, 2], np.full_like(rows[:, 2], info.dev_id)], axis=1
    )
    seconds = 0.0
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, info.mem),
                peer,
            )
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            seconds += time.perf_counter() - t0
            if state != "DONE":
                raise RuntimeError(f"nixl transfer ended {state}")
            agent.release_xfer_handle(handle)
            del handle
    finally:
        agent.deregister_memory(reg)
    return int(rows[:, 2].sum()) * repeat, seconds
