"""The run's tables (Markdown) and its full record (JSON)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import attrs

from kvconn_vllm.faults.happy import ONE_ENGINE, HappyResult
from kvconn_vllm.faults.scenarios import FaultResult

FAULT_TITLES = {
    "abort": "abort mid-transfer",
    "prefill_frozen": "prefill frozen past every lease",
    "decode_frozen": "decode frozen past prefill's lease",
    "prefill_killed": "prefill killed mid-transfer",
    "prefill_restarted": "prefill restarted at the same address",
    "decode_killed": "decode killed mid-transfer",
}


def _seconds(values: Iterable[float | None]) -> str:
    got = sorted(v for v in values if v is not None)
    if not got:
        return "-"
    if len(got) == 1:
        return f"{got[0]:.2f} s"
    return f"{statistics.median(got):.2f} s (max {got[-1]:.2f})"


def _outcomes(result: FaultResult) -> str:
    counts: dict[str, int] = {}
    for request in result.requests:
        label = request.outcome
        if request.received_match is False:
            label += ", bytes of another request"
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{n} {label}" for label, n in sorted(counts.items()))


def _pinned(result: FaultResult) -> str:
    cells = []
    for role in ("decode", "prefill"):
        if role in result.pinned_end:
            end, most = result.pinned_end[role], result.pinned_max.get(role, 0)
            cells.append(f"{role[0].upper()} {end}" + (f" (max {most})" if most != end else ""))
    return ", ".join(cells) or "-"


def _corrupted(result: FaultResult) -> str:
    parts = []
    wrong = result.wrong
    if wrong:
        reads = sum(r.received_match is False for r in wrong)
        tokens = sum(r.outcome == "wrong" for r in wrong)
        parts.append(f"{len(wrong)} request(s): {reads} received other bytes, {tokens} wrong tokens")
    for role, writes in result.late_writes.items():
        if writes:
            parts.append(f"{len(writes)} late write(s) into free {role} blocks")
    return "; ".join(parts) if parts else "0"


def fault_table(results: list[FaultResult]) -> str:
    lines = [
        "| connector | fault | corrupted | hung | failed | blocks pinned at the end (max) | abort to blocks back | requests | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        releases = [q.release_s for q in r.requests if q.client_abort]
        prefill = [q.prefill_release_s for q in r.requests]
        release = _seconds(releases)
        if r.never_released:
            release += f"; {r.never_released} never"
        if r.fault == "decode_killed":
            release = "prefill: " + _seconds(prefill)
        notes = "; ".join(r.notes)
        if r.proofs:
            notes = (notes + "; " if notes else "") + "proofs " + ", ".join(f"{k} {v}" for k, v in sorted(r.proofs.items()))
        lines.append(
            f"| {r.connector} | {FAULT_TITLES.get(r.fault, r.fault)} | {_corrupted(r)} | {r.hung} | {r.failed} "
            f"| {_pinned(r)} | {release} | {_outcomes(r)} | {notes} |"
        )
    return "\n".join(lines)


def happy_table(results: list[HappyResult], anchor: str | None) -> str:
    lines = [
        "| prompt tokens | at once | target | TTFT (median) | x one engine | x " + (anchor or "anchor")
        + " | end to end | x one engine | decode's share of TTFT | CPU s / request | steps / request | tokens differ | no answer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for h in results:
        one_ttft, one_e2e = h.median(ONE_ENGINE, "ttft"), h.median(ONE_ENGINE, "e2e")
        anchor_ttft = h.median(anchor, "ttft") if anchor else None
        for target in h.timings:
            ttft, e2e = h.median(target, "ttft"), h.median(target, "e2e")
            if ttft is None or e2e is None:
                lines.append(f"| {h.prompt_tokens} | {h.concurrency} | {target} | no answer |" + " - |" * 8 + f" {h.hung.get(target, 0)} |")
                continue
            share = [t.at_decode / t.ttft for t in h.timings[target] if t.at_decode is not None and t.ttft > 0]
            lines.append(
                f"| {h.prompt_tokens} | {h.concurrency} | {target} | {ttft * 1e3:.1f} ms "
                f"| {_ratio(ttft, one_ttft)} | {_ratio(ttft, anchor_ttft) if target != ONE_ENGINE else '-'} "
                f"| {e2e * 1e3:.1f} ms | {_ratio(e2e, one_e2e)} "
                f"| {f'{statistics.median(share):.0%}' if share else '-'} "
                f"| {h.cpu_s.get(target, 0.0):.3f} | {h.steps.get(target, 0.0):.1f} | {h.mismatches.get(target, 0)} | {h.hung.get(target, 0)} |"
            )
    return "\n".join(lines)


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def record(
    faults: list[FaultResult], happy: list[HappyResult], meta: dict[str, Any]
) -> dict[str, Any]:
    """Everything measured, as plain data."""
    return {
        "meta": meta,
        "faults": [
            attrs.asdict(r)
            | {"corrupted": r.corrupted, "hung": r.hung, "failed": r.failed, "never_released": r.never_released}
            for r in faults
        ],
        "happy": [attrs.asdict(h) for h in happy],
    }
