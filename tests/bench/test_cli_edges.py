"""The rough edges a new user hit in ``kvconn bench`` and ``kvconn backends``
(issue 32): Ctrl-C, markup, the exit code's targets, piped output, backend
names, children that die, native libraries' logging, help, the plot; and
the bench's modules, which import one another without a circle."""

from __future__ import annotations

import ast
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvconn.bench import cli as bench_cli
from kvconn.bench import plot as plot_mod
from kvconn.bench import report as report_mod
from kvconn.bench.mode_result import ModeResult
from kvconn.testing.child import Child, ChildError, StderrLog

BENCH = Path(bench_cli.__file__).parent


def recorder() -> Console:
    return Console(file=io.StringIO(), width=300, color_system=None)


def text_of(console: Console) -> str:
    out = console.file
    assert isinstance(out, io.StringIO)
    return out.getvalue()


# -- the split: no import circle ------------------------------------------------


def bench_imports(path: Path) -> set[str]:
    """The kvconn.bench modules ``path`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvconn.bench"):
            if node.module == "kvconn.bench":
                found.update(f"kvconn.bench.{a.name}" for a in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvconn.bench."))
    return found


def test_bench_modules_import_without_a_circle() -> None:
    graph = {f"kvconn.bench.{p.stem}": bench_imports(p) for p in BENCH.glob("*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, f"import circle: {' -> '.join((*path, mod))}"
        if mod in done:
            return
        for dep in graph.get(mod, ()):
            visit(dep, (*path, mod))
        done.add(mod)

    for mod in graph:
        visit(mod, ())
    assert "kvconn.bench.cli" not in graph["kvconn.bench.transport"]


@pytest.mark.parametrize("module", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"))
def test_each_bench_module_imports_alone(module: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", f"import kvconn.bench.{module}"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_transport_is_a_command_line_only() -> None:
    """The module that was six jobs in 1,035 lines keeps one."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in BENCH.glob("*.py")}
    assert sizes["transport.py"] < 150, sizes
    assert all(n <= 650 for n in sizes.values()), sizes  # issue 31: none over about 600


# -- Ctrl-C ---------------------------------------------------------------------


def children_running(parent: int, module: str) -> bool:
    """Whether a child process of ``parent`` runs ``python -m module`` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == parent and module.encode() in cmdline:
            return True
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="finds the bench's children in /proc")
def test_ctrl_c_stops_with_one_line_and_quiet_children() -> None:
    """The terminal sends SIGINT to every process of the bench at once (its
    process group): one line, exit 130, no child's traceback."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvconn.cli",
            "bench",
            "--no-progress",
            "--requests",
            "5000",
            "--faults",
            "off",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the signal reaches only the bench's processes
    )
    try:
        deadline = time.monotonic() + 90
        while not children_running(proc.pid, "kvconn.bench.prefill_worker"):  # into the workload
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
        time.sleep(1)  # the ranks serving requests
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert any("kvconn bench: interrupted" in line for line in lines), out
    assert len(lines) <= 3, out  # the line, and at most multiprocessing's leaked-memory warning


# -- markup ---------------------------------------------------------------------


def test_violation_lines_keep_their_mode_label() -> None:
    console = recorder()
    violation = {"kind": "late_write", "room": 7, "detail": "page [3] written", "page": 3}
    report_mod._print_violations(console, {"kvconn": [violation], "legacy": [violation]})
    out = text_of(console)
    assert "[kvconn] late_write room=7: page [3] written" in out
    assert "[legacy] (expected to be possible there) late_write" in out


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises, as if not installed
    err = recorder()
    plot_mod.plot("/nonexistent.png", {}, 1.5, [], err)
    assert "pip install 'kvconn-core[plot]'" in text_of(err)


# -- the targets and the exit code ------------------------------------------------


def report(busy: float, *, violations: int = 0) -> dict[str, Any]:
    return {
        "targets": [
            {
                "target": "fast release p99",
                "goal": "<= 5 ms",
                "value": "9 ms",
                "ok": False,
                "gates_exit": False,
            },
            {
                "target": "violations (kvconn)",
                "goal": "0",
                "value": str(violations),
                "ok": not violations,
                "gates_exit": True,
            },
        ],
        "modes": {"kvconn": {"cpu": {"busy": busy, "steal": 0.0, "idle": 100 - busy}}},
    }


def test_a_missed_stated_target_says_it_does_not_gate_and_why() -> None:
    console = recorder()
    report_mod._print_targets(console, report(busy=97.0))
    out = text_of(console)
    assert "NO" not in out  # the exit code is 0: no bare NO beside it
    assert "no (stated)" in out and "gates exit code" in out
    assert "exit code: 1 only if kvconn's mode shows a violation" in out
    assert "stated targets missed: fast release p99" in out and "97% busy" in out


def test_a_missed_gating_target_is_a_no() -> None:
    console = recorder()
    report_mod._print_targets(console, report(busy=10.0, violations=2))
    out = text_of(console)
    assert re.search(r"violations \(kvconn\).*\bNO\b.*yes", out), out
    assert "not saturated (10% busy" in out


# -- piped output, backend names ------------------------------------------------------

TINY = [
    "--transport", "--repeat", "1", "--no-progress", "--shape", "4KiBx16:scattered",
    "--bytes-per-run", "128KiB", "--room-bytes", "64 KiB",
]  # fmt: skip


def test_transport_output_to_a_pipe_is_not_cut_at_80_columns() -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvconn.cli", "bench", *TINY, "--backend", "loopback"],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "…" not in proc.stdout, proc.stdout  # rich's mark of a cut cell
    assert max(len(line) for line in proc.stdout.splitlines()) > 80
    assert "pairs: kvconn / raw within each repetition" in " ".join(proc.stdout.split())


def test_every_backend_name_is_checked_before_measuring() -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kvconn.cli", "bench", *TINY, "--backend", "loopback,nosuch"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no kvconn backend 'nosuch' is installed" in " ".join(proc.stderr.split())
    assert "kvconn bench --transport: loopback" not in proc.stdout  # nothing was measured
    assert time.monotonic() - t0 < 30


# -- a backend that loads but does not open; a child that dies ------------------------

BROKEN = """
from kvconn.transport import Capabilities

class _Broken:
    name = "fakebroken"
    capabilities = Capabilities(writer_fence=True)

    def open_region(self, nbytes, options):
        # what kvconn_mooncake raises when its engine cannot load
        raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")

    open_writer = open_region

BACKEND = _Broken()
"""


@pytest.fixture
def broken_backend(tmp_path: Path) -> dict[str, str]:
    """An installed backend whose module loads and whose native library does
    not (Mooncake without libibverbs): a distribution on PYTHONPATH."""
    (tmp_path / "kvconn_fakebroken.py").write_text(BROKEN)
    info = tmp_path / "kvconn_fakebroken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvconn-fakebroken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvconn.backends]\nfakebroken = kvconn_fakebroken:BACKEND\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "200"}


def test_backends_opens_what_it_lists(broken_backend: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvconn.cli", "backends"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**broken_backend, "KVCONN_BACKENDS": "fakebroken,loopback"},
    )
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "does not open here: ImportError: libibverbs.so.1: cannot open shared object file" in out, out
    assert out.count("does not open here") == 1  # loopback opens


CLAIMS_VRAM = """
import attrs
from kvconn.backends.loopback import backend as _loopback

class _ClaimsVram:
    name = "fakevram"
    capabilities = attrs.evolve(_loopback.capabilities, memory=frozenset({"dram", "vram"}))

    def open_region(self, nbytes, options):
        return _loopback.open_region(nbytes, options)

    def open_writer(self, nbytes, options):
        return _loopback.open_writer(nbytes, options)

BACKEND = _ClaimsVram()
"""


def test_backends_says_when_claimed_vram_is_not_here(tmp_path: Path) -> None:
    """A backend that opens here and declares ``vram`` on a host where no
    device memory can be allocated: the row says so, with the cause."""
    from kvconn.memory import Memory

    try:
        Memory(4096, "vram").free()
        pytest.skip("device memory can be allocated here")
    except Exception as exc:
        cause = " ".join(str(exc).split())
    (tmp_path / "kvconn_fakevram.py").write_text(CLAIMS_VRAM)
    info = tmp_path / "kvconn_fakevram-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvconn-fakevram\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvconn.backends]\nfakevram = kvconn_fakevram:BACKEND\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "kvconn.cli", "backends"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path, "COLUMNS": "400", "KVCONN_BACKENDS": "fakevram"},
    )
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stdout + proc.stderr  # it opens: vram missing here is no failure
    assert "memory=dram,vram (vram not here: " in out, out
    assert cause.split(":")[0] in out, (cause, out)
    assert "does not open here" not in out


def test_a_child_that_dies_is_one_line_with_its_cause(broken_backend: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvconn.cli", "bench", *TINY, "--backend", "fakebroken"],
        capture_output=True,
        text=True,
        timeout=120,
        env=broken_backend,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) <= 2, lines
    text = " ".join(" ".join(lines).split())
    assert "bench rank child exited with 1" in text and "libibverbs.so.1" in text, text


def test_the_abort_bench_on_a_backend_that_does_not_open_is_one_line(broken_backend: dict[str, str]) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvconn.cli",
            "bench",
            "--no-progress",
            "--backend",
            "fakebroken",
            "--faults",
            "off",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=broken_backend,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) <= 2 and "libibverbs.so.1" in " ".join(lines), lines


def test_a_native_library_that_fails_to_load_here_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """kvconn_mooncake raises an ImportError when decode's engine cannot load
    in the bench's own process: the bench says so, as for any failure to run."""
    import argparse

    def fails(*_: object) -> int:
        raise ImportError("the Mooncake engine needs the system library libibverbs.so.1")

    monkeypatch.setattr(bench_cli, "_run", fails)
    monkeypatch.setattr(StderrLog, "verbose", False)  # main sets both: restored after the test
    monkeypatch.setenv("MC_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("GLOG_minloglevel", "2")
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    assert bench_cli.main(parser, parser.parse_args(["--no-progress"])) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "kvconn bench: the Mooncake engine needs the system library libibverbs.so.1" in err


def test_child_stderr_is_kept_for_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dies.py").write_text(
        "import sys\nprint('noise', file=sys.stderr)\nraise RuntimeError('the cause')\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(tmp_path), os.environ.get("PYTHONPATH", ""))))
    monkeypatch.setattr(StderrLog, "verbose", False)
    child = Child("dies", {}, log=StderrLog(), name="bench x child", failure=ChildError)
    try:
        with pytest.raises(ChildError, match=r"bench x child exited with 1: RuntimeError: the cause"):
            child.next_with("ready", 60, "the child's start")
    finally:
        child.close()


# -- native logging, help ---------------------------------------------------------


def test_mooncake_logging_is_quiet_unless_verbose() -> None:
    env: dict[str, str] = {}
    bench_cli.quiet_native_logs(False, env)
    assert env == {"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "3"}
    env = {}
    bench_cli.quiet_native_logs(True, env)
    assert env == {}
    env = {"MC_LOG_LEVEL": "INFO", "GLOG_minloglevel": "0"}
    bench_cli.quiet_native_logs(False, env)
    assert env == {"MC_LOG_LEVEL": "INFO", "GLOG_minloglevel": "0"}  # the user's choice stands


MOONCAKE_LOG_LINES = ("Local segment descriptor not found", "No RDMA devices found", "InitGoogleLogging")


def test_a_mooncake_bench_prints_none_of_mooncakes_own_log_lines() -> None:
    """Decode's engine runs in the bench's own process: its glog lines, the
    per-start ERROR among them, reached the terminal on every run."""
    from kvconn.testing.libraries import why_unavailable

    why = why_unavailable("mooncake")
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k not in ("GLOG_minloglevel", "MC_LOG_LEVEL")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvconn.cli", "bench", "--backend", "mooncake", "--faults", "off",
            "--modes", "kvconn", "--requests", "4", "--stream-requests", "0", "--abort-window-ms", "1",
            "--overhead-chunks", "1", "--pages", "8", "--page-bytes", "16384", "--chunk-pages", "2",
            "--concurrency", "4", "--drain-s", "1", "--settle-s", "0.1", "--no-progress",
        ],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [line for line in MOONCAKE_LOG_LINES if line in proc.stderr], proc.stderr


def help_of(*argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "kvconn.cli", *argv, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "2000"},  # one line per option
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_help_reads_as_text() -> None:
    top = help_of()
    assert "The ``kvconn`` command" not in top and "``" not in top and "--version" in top
    bench = help_of("bench")
    assert ":mod:" not in bench and "``" not in bench
    options: dict[str, str] = {}  # first flag -> its whole entry, wrapped lines joined
    flag = ""
    for line in bench.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0]
            options[flag] = line
        elif line.startswith("   ") and flag:
            options[flag] += " " + line.strip()
        else:
            flag = ""
    for flag in ("--seed", "--no-progress", "-v,"):
        assert len(options[flag].split()) > 2, options[flag]  # a flag and its help
    assert options["--abort-window-ms"].count("default") == 1
    assert "kv:LAYERSxCHUNK_PAGES" in options["--shape"]
    assert "-o KEY=VALUE, --option KEY=VALUE" in options["--backend-option"]
    assert "[plot]" in options["--plot"]


def test_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvconn.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and re.fullmatch(r"kvconn \S+\n", proc.stdout), proc.stdout


def test_both_option_spellings_reach_the_bench() -> None:
    import argparse

    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    args = p.parse_args(["--backend-option", "a=1", "-o", "b=2", "--option", "c=3"])
    assert args.backend_option == ["a=1", "b=2", "c=3"]


# -- the plot ---------------------------------------------------------------------


def test_plot_marks_the_deployment_deadline_and_shows_the_fault_table() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    results = {
        "kvconn": ModeResult("kvconn", latencies_ms=[1.0, 2.0, 5.0]),
        "legacy": ModeResult("legacy", latencies_ms=[1500.0]),
    }
    faults = [
        {"fault": "frozen", "mode": "kvconn", "corrupted": 0, "skipped": ""},
        {"fault": "frozen", "mode": "legacy", "corrupted": 3, "skipped": ""},
        {"fault": "partition", "mode": "kvconn", "corrupted": 0, "skipped": "needs root"},
        {"fault": "partition", "mode": "legacy", "corrupted": 0, "skipped": "needs root"},
    ]
    fig = plot_mod.figure(results, 1.5, faults)
    latency, bars = fig.axes
    vertical = {line.get_xdata()[0] for line in latency.get_lines() if len(set(line.get_xdata())) == 1}
    assert {1500.0, 30000.0} <= vertical
    assert any("30 s" in t.get_text() for t in latency.get_legend().get_texts())
    heights = sorted(p.get_height() for p in bars.patches)
    assert heights == [0, 3]  # the fault that ran, in both modes; the skipped one is not drawn
    assert [t.get_text() for t in bars.get_xticklabels()] == ["frozen"]
    import matplotlib.pyplot as plt

    plt.close(fig)
    one = plot_mod.figure(results, 1.5, [])
    assert len(one.axes) == 1  # no fault phase: the latency alone
    plt.close(one)


def hosts_summary(violations: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "release_latency_ms": {"p50": 1.0, "p99": 2.0},
        "throughput_gbps": 1.0,
        "requests_per_s": 100.0,
        "completed": 10,
        "aborted_mid_transfer": 3,
        "prefill_failed": 0,
        "violations": violations,
    }


def test_hosts_violation_lines_keep_their_placement_label() -> None:
    from kvconn.bench import hosts_run

    violation = {"kind": "late_write", "room": 7, "detail": "page [3] written", "page": 3}
    rep = {
        "backend": "nixl",
        "hosts": 3,
        "link_rtt_ms": 0.1,
        "runs": {
            hosts_run.ONE_HOST: {"summary": hosts_summary([violation])},
            hosts_run.ACROSS: {"summary": hosts_summary([violation])},
        },
        "ratios": {"release_p50": 1.0, "release_p99": 1.0, "throughput": 1.0, "requests_per_s": 1.0},
        "goals": {"p99_met": True, "throughput_met": True},
        "faults": [
            {
                "fault": "partition",
                "mode": "kvconn",
                "owner_fence": False,
                "corrupted_pages": 0,
                "held_pages": 4,
                "back_s": 1.5,
                "proof": "late_acks",
                "others_done": 2,
                "others_failed": 0,
            }
        ],
    }
    console = recorder()
    hosts_run.print_report(console, rep)
    out = text_of(console)
    assert "violation [one_host] late_write room=7: page [3] written" in out, out
    assert "violation [across_hosts] late_write room=7: page [3] written" in out, out


def test_transport_tables_keep_bracketed_backend_options() -> None:
    from kvconn.bench import transport_report

    shape = {
        "shape": "1 x 4 KiB",
        "verdict": "met",
        "verify_bad_pages": 0,
        "ratio_interval": (0.9, 1.1),
        "chunk_bytes": 4096,
        "room_chunks": 1,
        "bytes_per_run": 4096,
        "kvconn_gbps": 1.0,
        "kvconn_gbps_all": [1.0],
        "raw_gbps": 1.0,
        "raw_gbps_all": [1.0],
        "ratio": 1.0,
        "ratio_pairwise_median": 1.0,
        "interval_confidence": 0.9,
        "cpu": {"kvconn": {}, "raw": {}},
        "target_met": True,
        "repeats": 1,
    }
    rep = {
        "backend": "plug[in]",
        "backend_options": {"devices": "[mlx5_0]"},
        "shapes": [shape],
        "raw_path": "the plugin's [raw] API",
    }
    console = recorder()
    transport_report.print_report(console, rep)
    out = text_of(console)
    assert "kvconn bench --transport: plug[in] (devices=[mlx5_0])" in out, out
    assert "5% target met on plug[in] for every shape (1 pairs; raw path: the plugin's [raw] API)" in out


def test_the_overhead_measure_runs_with_fewer_chunks_than_rooms() -> None:
    """``--overhead-chunks 100`` failed every bench: the round-trip rooms
    (3..102) wrote source pages the rank had not allocated."""
    from kvconn.bench import overhead as overhead_mod

    measured = overhead_mod.measure(chunks=10, rooms=20)
    assert measured.chunks == 10 and measured.control_rtt_ms > 0
