"""``kvconn bench --transport`` on loopback with tiny sizes: the table and the
JSON carry every field (no timing asserts: this is a benchmark, not a test)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from bench_doc import undocumented

from kvconn.bench.shapes import Shape, check_pages, make_plan, source_pattern
from kvconn.bench.sizes import parse_size
from kvconn.testing import waiting

TINY = [
    "--transport", "--backend", "loopback", "--repeat", "2", "--no-progress",
    "--shape", "4KiBx16:scattered", "--shape", "65536",
    "--bytes-per-run", "256KiB", "--room-bytes", "64 KiB", "--profile",
]  # fmt: skip


def test_transport_bench_reports_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    proc = waiting.run(
        [sys.executable, "-m", "kvconn.cli", "bench", *TINY, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},  # rich wraps the table to the terminal
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "kvconn bench --transport: loopback" in text
    assert "5% target" in text and "kvconn / raw" in text
    assert "exit code: 1 only if a spot-checked page came out wrong" in " ".join(text.split())
    doc = json.loads(out.read_text())
    assert not undocumented(doc), "fields docs/bench.md does not explain"
    (rep,) = doc["transport"]
    assert rep["backend"] == "loopback" and rep["verified"] is True
    assert isinstance(rep["target_met"], bool) and rep["raw_path"]
    assert [s["shape"] for s in rep["shapes"]] == ["16 x 4 KiB scattered", "1 x 64 KiB"]
    for s in rep["shapes"]:
        for key in ("kvconn_gbps", "raw_gbps", "ratio", "raw_child_gbps", "kvconn_ms_per_chunk"):
            assert s[key] > 0, key
        assert s["verdict"] in ("met", "missed", "unclear")
        assert s["target_met"] is (s["verdict"] == "met")
        lo, hi = s["ratio_interval"]
        assert lo <= s["ratio_pairwise_median"] <= hi and len(s["ratio_pairwise_all"]) == 2
        assert s["interval_confidence"] == 0.5  # two pairs: the widest interval, and it says so
        assert s["repeats"] == 2 and len(s["kvconn_gbps_all"]) == len(s["raw_gbps_all"]) == 2
        assert s["bytes_per_run"] == 262144 and s["verify_bad_pages"] == 0
        assert {"transport_ms_per_chunk", "gap_in_room_ms_per_chunk", "request_ms", "status_ms"} <= set(
            s["profile"]
        )
        # one chunk per room here (64 KiB rooms): only first chunks to place
        first, *later = s["profile"]["transport_ms_by_position"]
        assert first > 0 and later == [None, None, None]
    assert rep["shapes"][0]["scattered"] is True and rep["shapes"][0]["chunk_pages"] == 16
    if sys.platform == "linux":  # CPU time per process from /proc
        assert "CPU per chunk on loopback" in text
        for s in rep["shapes"]:
            for side, procs in (("kvconn", ("decode", "rank")), ("raw", ("decode", "raw_writer"))):
                c = s["cpu"][side]
                assert all(c[f"{p}_ms_per_chunk"] >= 0 for p in procs), c
                # machine shares only when a clock tick passed (tiny runs may fit in one)
                assert all(0 <= c[k] <= 100 for k in ("busy", "steal", "idle") if k in c)


def test_bad_shape_exits_2() -> None:
    proc = waiting.run(
        [sys.executable, "-m", "kvconn.cli", "bench", "--transport", "--shape", "4096x:bogus"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "shape" in proc.stderr


def test_sizes_read_as_the_tables_print_them() -> None:
    assert [parse_size(t) for t in ("65536", "64KiB", "256 MiB", "1gib", "7 B")] == [
        65536,
        65536,
        256 << 20,
        1 << 30,
        7,
    ]
    for bad in ("256MB", "1.5MiB", "-1", "", "MiB"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    assert Shape.parse("4KiBx1024:scattered") == Shape(4096, 1024, True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile"], "the abort bench (no --transport) does not use --profile"),
        (["--transport", "--requests", "5", "--ranks", "3"], "--transport does not use --ranks, --requests"),
        (["--transport", "--bytes-per-run", "256MB"], "'256MB' is not a size"),
    ],
)
def test_an_option_of_the_other_bench_exits_2(argv: list[str], message: str) -> None:
    """A flag the chosen bench never reads is refused, not silently ignored."""
    proc = waiting.run(
        [sys.executable, "-m", "kvconn.cli", "bench", *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in " ".join(proc.stderr.split())


def test_source_pattern_is_one_pattern_for_every_process_at_any_size() -> None:
    """Both children and the parent derive the source from (size, seed); a
    room of 256 MiB needs 256 MiB of it (``random.randbytes`` overflowed there)."""
    big = (256 << 20) + 8
    pattern = source_pattern(big, 7)
    assert len(pattern) == big
    assert pattern[:4096] == source_pattern(4096, 7)  # a prefix of the same stream
    assert source_pattern(4096, 7) != source_pattern(4096, 8)


def test_spot_checks_expect_the_last_writer_of_a_page() -> None:
    """64 scattered rooms in two slots: later rooms of a slot rewrite some of
    the first room's pages with their own source pages. The check expects
    what the last writer put there (it expected the first room's page, and a
    correct 1 GiB run came out 'WRONG')."""
    plan = make_plan(Shape(4096, 1024, scattered=True), 1 << 30, 16 << 20, 2, seed=0)
    checks = check_pages(plan)
    first = plan.dst[0][0]
    later = [j for j in range(1, plan.rooms) if first in plan.dst[j]]
    assert later, "this plan no longer rewrites the first room's page: pick one that does"
    j = later[-1]
    assert (plan.src[j][plan.dst[j].index(first)], first) in checks
    assert (plan.src[0][0], first) not in checks
    assert (plan.src[-1][-1], plan.dst[-1][-1]) in checks  # the last room's page: nothing writes it later


def test_kv_shapes_parse_and_refuse_mixing() -> None:
    from kvconn.bench.shapes import kv_shapes

    kv = Shape.parse("kv:2x4:scattered")
    assert (kv.layers, kv.chunk_pages, kv.scattered, kv.page_bytes) == (2, 4, True, 16 * 8 * 256)
    assert kv.buffers == 4 and kv.chunk_bytes == 4 * 4 * 32768
    assert kv.name == "2 layers x K/V x 4 x 32 KiB scattered"
    for bad in ("kv:0x4", "kv:2xz", "kv:2x4:tight"):
        with pytest.raises(ValueError, match="shape"):
            Shape.parse(bad)
    assert kv_shapes([kv, Shape.parse("kv:2x8")])
    with pytest.raises(ValueError, match="cannot run together"):
        kv_shapes([kv, Shape.parse("4096")])
    with pytest.raises(ValueError, match="same number of layers"):
        kv_shapes([kv, Shape.parse("kv:3x4")])


def test_kv_shape_runs_over_engine_buffers_and_counts_segments(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    args = ["--transport", "--backend", "loopback", "--repeat", "2", "--no-progress"]
    args += [
        "--shape",
        "kv:2x4",
        "--shape",
        "kv:2x4:scattered",
        "--bytes-per-run",
        "2MiB",
        "--room-bytes",
        "512KiB",
    ]
    proc = waiting.run(
        [sys.executable, "-m", "kvconn.cli", "bench", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert not undocumented(doc), "fields docs/bench.md does not explain"
    (rep,) = doc["transport"]
    assert rep["verified"] is True  # every checked page equal to its source page, in all 4 buffers
    runs, scattered = rep["shapes"]
    assert runs["segments_per_chunk"] == 4  # 4 adjacent pages merge: one segment per buffer
    assert 4 < scattered["segments_per_chunk"] <= 16
    for s in rep["shapes"]:
        assert s["lowering_us_per_chunk"] > 0 and s["kvconn_gbps"] > 0 and s["raw_gbps"] > 0
