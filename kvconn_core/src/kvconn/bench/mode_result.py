"""One mode's figures (:class:`ModeResult`), its violations, and the merge of
several decode endpoints' results into one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvconn.bench.stats import stats

#: The two modes: ABORT_ACK (fast release, quarantine on timeout), and
#: timeout-only (acks off, pages freed at the deadline without proof).
KVCONN, LEGACY = "kvconn", "legacy"


@attrs.define
class Violation:
    kind: str
    room: int | None
    detail: str
    page: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define
class ModeResult:
    mode: str
    requests: int = 0
    completed: int = 0
    aborted_mid_transfer: int = 0
    completed_before_abort_point: int = 0
    prefill_failed: int = 0
    elapsed_s: float = 0.0
    bytes_completed: int = 0
    latencies_ms: list[float] = attrs.Factory(list)
    prefill_fail_latencies_ms: list[float] = attrs.Factory(list)
    releases_by_proof: dict[str, int] = attrs.Factory(dict)
    acks_received: float = 0.0
    aborts_sent: float = 0.0
    quarantines: float = 0.0
    quarantine_seconds: float = 0.0
    rooms_unreleased_end: int = 0
    pages_held_end: int = 0
    pages_quarantined_end: int = 0
    peak_pages_held: int = 0
    peak_pages_aborted_unreleased: int = 0
    prefill: dict[str, float] = attrs.Factory(dict)
    violations: list[Violation] = attrs.Factory(list)
    #: This machine's CPU shares while the mode ran (kvconn.bench.cpu).
    cpu: dict[str, float] = attrs.Factory(dict)
    #: The workload phase's CPU per request, by part (kvconn.bench.cpu.per_request).
    cpu_per_request_us: dict[str, Any] = attrs.Factory(dict)
    #: Abort to each rank's accepted ack: how many, and the bucket bounds (ms)
    #: that half and 99% of them were under (decode's ``kvconn_abort_to_ack_seconds``
    #: histogram): which rank the releases waited for.
    ack_wait_ms_by_rank: dict[str, dict[str, float]] = attrs.Factory(dict)
    #: Pages of completed rooms compared byte for byte with their pattern.
    pages_verified: int = 0
    #: Each decode endpoint's own counts (one entry per decode).
    per_decode: list[dict[str, int]] = attrs.Factory(list)

    def summary(self) -> dict[str, Any]:
        d = attrs.asdict(
            self, filter=lambda a, _: a.name not in ("latencies_ms", "prefill_fail_latencies_ms")
        )
        d["violations"] = [v.as_dict() for v in self.violations]
        d["throughput_gbps"] = self.bytes_completed / self.elapsed_s / 1e9 if self.elapsed_s else 0.0
        d["requests_per_s"] = self.requests / self.elapsed_s if self.elapsed_s else 0.0
        d["release_latency_ms"] = stats(self.latencies_ms)
        d["prefill_fail_release_latency_ms"] = stats(self.prefill_fail_latencies_ms)
        return d


def merge(results: Sequence[ModeResult]) -> ModeResult:
    """One result for several decode endpoints that ran side by side: counts,
    latencies and violations summed over decodes (a violation's detail names
    its decode), peaks summed (each decode's own bound is checked in its run),
    wall time the longest; prefill counters are the shared ranks' own."""
    counts = ("requests", "completed", "aborted_mid_transfer", "prefill_failed", "pages_verified")
    per_decode = [{**{k: getattr(r, k) for k in counts}, "violations": len(r.violations)} for r in results]
    if len(results) == 1:
        results[0].per_decode = per_decode
        return results[0]
    out = ModeResult(results[0].mode, prefill=results[0].prefill, cpu=results[0].cpu)
    summed = [k for k, v in attrs.asdict(out).items() if isinstance(v, int | float) and k != "elapsed_s"]
    for d, r in enumerate(results):
        for name in summed:
            setattr(out, name, getattr(out, name) + getattr(r, name))
        out.elapsed_s = max(out.elapsed_s, r.elapsed_s)
        out.latencies_ms += r.latencies_ms
        out.prefill_fail_latencies_ms += r.prefill_fail_latencies_ms
        for proof, n in r.releases_by_proof.items():
            out.releases_by_proof[proof] = out.releases_by_proof.get(proof, 0) + n
        out.violations += [attrs.evolve(v, detail=f"decode {d}: {v.detail}") for v in r.violations]
        for rank, wait in r.ack_wait_ms_by_rank.items():
            out.ack_wait_ms_by_rank[f"{rank} (decode {d})"] = wait
    out.per_decode = per_decode
    return out
