"""A bare writer process (:mod:`kvconn.conformance.writer_proc`) and the
regions it writes into, for the checks of the transport's own promises:
the rounds it runs, the late-write watch, and handing what a check fenced
or cancelled to the run's guard."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kvconn.conformance import guard, region_host
from kvconn.conformance.harness import (
    Child,
    ConformanceFailure,
    RegionImage,
    Settings,
    decode_host,
    host_options,
    prefill_host,
)
from kvconn.testing.hosts import Host
from kvconn.transport import PageRegion, Settlement

MiB = 1 << 20
LANDED, FAILED_SETTLED, UNSETTLED = (s.value for s in Settlement)


class BareWriter(Child):
    """A writer process and the rounds it runs (see ``writer_proc``)."""

    def __init__(
        self,
        settings: Settings,
        peers: Mapping[str, bytes],
        rounds: Sequence[Mapping[str, Any]],
        src_bytes: int,
        options: Mapping[str, str] | None = None,
        write_timeout_s: float | None = None,
        prefix: Sequence[str] = (),
        host: Host | None = None,
    ) -> None:
        """``host``: where the writer runs; in cross-host mode it defaults to
        the first prefill host (with its address and interface options)."""
        if host is None and not prefix:
            host = prefill_host(0)
        extra = host_options(settings.backend, host)
        super().__init__(
            "kvconn.conformance.writer_proc",
            {
                "backend": settings.backend_name,
                "options": {**(settings.options if options is None else options), **extra},
                "src_bytes": src_bytes,
                "peers": {name: metadata.hex() for name, metadata in peers.items()},
                "write_timeout_s": settings.write_timeout_s if write_timeout_s is None else write_timeout_s,
                "rounds": [dict(r) for r in rounds],
            },
            prefix,
            host=host,
        )

    def answer(self, step: str, round_no: int) -> dict[str, Any]:
        """The report of ``step`` in round ``round_no`` (already received)."""
        for event in reversed(self.history()):
            if event.get("event") == step and event.get("round") == round_no:
                return dict(event)
        raise ConformanceFailure(f"suite bug: no {step!r} report for round {round_no}")

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def settlement(self, settings: Settings, what: str, round_no: int = 1) -> str:
        """Wait until the writer froze after round ``round_no``'s barrier and
        return the settlement that barrier answered."""
        self.frozen(HEALTHY_WRITE_S + 30 + limit_of(settings), what, round=round_no)
        return str(self.answer("barrier", round_no)["settlement"])


def round_of(
    rows: list[list[int]], steps: Sequence[str], peer: str = "a", room: int | None = None
) -> dict[str, Any]:
    """A round of a bare writer (``writer_proc``); ``room``: its chunk's
    room id (else the round's number)."""
    spec: dict[str, Any] = {"peer": peer, "segments": rows, "steps": list(steps)}
    if room is not None:
        spec["room"] = room
    return spec


@contextmanager
def open_regions(
    settings: Settings, sizes: Mapping[str, int], **extra: str
) -> Iterator[dict[str, PageRegion]]:
    options = {**settings.options_on(decode_host()), **extra}
    opened: dict[str, PageRegion] = {}
    try:
        for name, size in sizes.items():
            opened[name] = region_host.open_region(settings.backend_name, size, options, decode_host())
        yield opened
    finally:
        for region in opened.values():
            region.close()


def metadata_of(regions: Mapping[str, PageRegion]) -> dict[str, bytes]:
    return {name: region.metadata for name, region in regions.items()}


def limit_of(settings: Settings) -> float:
    return settings.capabilities.max_write_timeout_s or 0.0


# A write that must land is given this long: only a write that will not land
# misses it, also on a loaded host (nixl missed 5 s and 10 s in CI while two
# engine venvs were unpacked beside the suite). A write that lands answers as
# soon as it does, so a long deadline costs a passing check nothing.
HEALTHY_WRITE_S = 30.0


def healthy_write_timeout(settings: Settings) -> float:
    """The deadline of a write a check needs LANDED (a first write may set up
    a connection): the configured one, at least :data:`HEALTHY_WRITE_S`."""
    return max(settings.write_timeout_s, HEALTHY_WRITE_S) + limit_of(settings)


def watch(settings: Settings, images: Sequence[RegionImage], what: str, at_least_s: float = 0.0) -> None:
    """Watch ``images`` for the late-write window (``at_least_s`` if that is
    longer): any change is a late write."""
    deadline = time.monotonic() + max(settings.late_write_watch_s, at_least_s)
    while True:
        for image in images:
            found = image.diff()
            if found:
                raise ConformanceFailure(f"{what}: {found}")
        if time.monotonic() >= deadline:
            return
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


def keep_for_the_run(
    regions: dict[str, PageRegion], images: Mapping[str, RegionImage], what: str, writer: Child
) -> None:
    """``images`` (their regions taken out of ``regions``, so that the
    check's own ``open_regions`` leaves them open) and ``writer``, still
    alive, go to the run's guard: the suite's last check compares them again
    and closes them."""
    kept = {name: regions.pop(name) for name in images}

    def diff() -> str:
        return "; ".join(f"region {name!r}: {d}" for name, image in images.items() if (d := image.diff()))

    def close() -> None:
        writer.close()
        for region in kept.values():
            region.close()

    guard.GUARD.keep(what, diff, close)
