"""``kvconn bench --curve segments|tombstones|fleet``: the curves with a
module of their own, end to end in a subprocess at a tiny size. No timing
threshold (the machine decides those): the structure, the checked bytes, and
values that make sense."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench_doc import undocumented

from kvconn.testing import waiting


def curve(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "curve.json"
    proc = waiting.run(
        [sys.executable, "-m", "kvconn.cli", "bench", "--no-progress", "--json", str(out), "--curve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, proc.stdout + proc.stderr


def test_segments_compares_kvconns_lowering_and_post_with_the_raw_path(tmp_path: Path) -> None:
    code, rep, out = curve(tmp_path, "segments", "--curve-points", "100,300", "--repeat", "3")
    assert code == 0, out
    assert rep["curve"] == "segments" and rep["layers"] == 59 and rep["segment_bytes"] == 4096
    (loopback,) = rep["backends"]
    assert loopback["backend"] == "loopback" and loopback["verified"] is True
    # whole pages of 118 segments (59 layers' K and V), no two pages adjacent
    assert [p["segments"] for p in loopback["points"]] == [118, 354]
    for point in loopback["points"]:
        assert point["repeats"] == 3 and point["chunk_bytes"] == point["segments"] * 4096
        assert point["verify_bad_segments"] == 0
        for side in ("kvconn_post", "kvconn_total", "raw_post", "raw_total", "kvconn_lowering"):
            assert point[f"{side}_us_per_segment"] > 0
        assert point["kvconn_lowering_us_per_segment"] <= point["kvconn_post_us_per_segment"]
        for ratio in (point["post_ratio"], point["total_ratio"]):
            low, high = ratio["interval"]
            assert 0 < low <= ratio["median"] <= high
        assert point["verdict"] in ("met", "missed", "unclear")
    assert "within 5% of raw" in out
    assert not undocumented(rep), "fields docs/bench.md does not explain"


def test_tombstones_and_fleet_are_curves_of_the_bench(tmp_path: Path) -> None:
    code, rep, out = curve(tmp_path, "tombstones", "--curve-points", "300,600")
    assert code == 0, out
    assert [p["rooms"] for p in rep["points"]] == [300, 600]
    for point in rep["points"]:
        assert 0 < point["bytes_per_tombstone"] < 1000 and point["us_per_abort"] > 0
        assert point["mib_after_expiry"] < 0.01  # every tombstone forgotten, memory back
    assert "bytes per tombstone" in out
    assert not undocumented(rep), "fields docs/bench.md does not explain"

    code, rep, out = curve(tmp_path, "fleet", "--curve-points", "0.02,0.05")
    assert code == 0, out
    assert [p["decodes"] for p in rep["points"]] == [2, 5]
    for point in rep["points"]:
        assert point["requests_per_s"] == 10 * point["decodes"] and point["work_per_s"] > 0
        every_rank = point["per_s"]["heartbeat (every rank)"]
        assert every_rank == 2 * point["decodes"] * point["ranks"]  # the rule before, counted
        assert 0 <= point["per_s"]["heartbeat"] < every_rank  # the endpoints' own Hellos
    assert "heartbeat" in out
    assert not undocumented(rep), "fields docs/bench.md does not explain"


def test_an_option_the_curve_does_not_read_is_refused(tmp_path: Path) -> None:
    code, _, out = curve(tmp_path, "tombstones", "--backend", "nixl")
    assert code == 2 and "--curve tombstones does not use --backend" in out
    code, _, out = curve(tmp_path, "segments", "--requests", "5")
    assert code == 2 and "--curve segments does not use --requests" in out
