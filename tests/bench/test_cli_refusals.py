"""``kvconn bench`` refuses what cannot run before anything starts, in one
line that names the option (issue 43): sizes past this machine's memory, a
plot it cannot write, a metrics port in use, points that are not numbers;
and a Ctrl-C while kvconn still imports is one line, as in any phase."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvconn import cli
from kvconn.bench import cli as bench_cli
from kvconn.bench.sizes import memory_available
from kvconn.config import Config
from kvconn.plugins import get_backend
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing import waiting

SMALL = ["--requests", "4", "--pages", "2", "--page-bytes", "4096", "--no-progress", "--faults", "off"]


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before the run: starting it fails the test."""

    def started(*_: Any) -> int:
        raise AssertionError("the run started")

    monkeypatch.setattr(bench_cli, "plan", started)  # the abort bench's first step
    monkeypatch.setattr(bench_cli, "_curve", started)


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``kvconn bench ARGV`` in this process: exit code 2 and one line, returned."""
    code = cli.main(["bench", *argv])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert err.startswith("kvconn bench: ") and "Traceback" not in err, err
    return err


# -- memory ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--pages", "100000000"], "--pages 100000000"),  # grew to 20.7 GB, then the OOM killer
        (["--page-bytes", "99999999999999"], "--page-bytes 99999999999999"),
        (["--pages", "4096", "--page-bytes", str(1 << 30)], "--pages 4096 --page-bytes 1073741824"),
    ],
)
def test_sizes_past_this_machines_memory_are_refused_naming_the_option(
    capsys: pytest.CaptureFixture[str], nothing_runs: None, argv: list[str], flag: str
) -> None:
    line = refusal(capsys, *argv, "--no-progress")
    assert line.startswith(f"kvconn bench: {flag} needs about "), line
    assert "this machine has" in line and line.endswith(f": lower {' or '.join(flag.split()[::2])}"), line


def test_the_default_sizes_fit() -> None:
    have, _ = memory_available(shared=True)
    assert have > 1 << 30  # the estimate of a default run is ~160 MiB: nothing here refuses it


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_an_address_space_limit_is_what_the_machine_can_give() -> None:
    """With ``ulimit -v`` (what issue 43's run had), a run past it is one line,
    exit 2, naming the limit: not a MemoryError's 25-line traceback and exit 1."""
    limit = 3 << 30

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = waiting.run(
        [sys.executable, "-m", "kvconn.cli", "bench", "--pages", "4096", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limited,
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},  # not cut at a terminal's width
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].endswith("this machine has (ulimit -v): lower --pages"), lines


def test_a_memory_error_the_estimate_missed_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(*_: Any) -> int:
        raise MemoryError

    monkeypatch.setattr(bench_cli, "_run", out_of_memory)
    line = refusal(capsys, *SMALL)
    assert line == "kvconn bench: out of memory: lower --pages, --page-bytes, --concurrency or --pool-pages"


# -- --plot ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["out.txt", "out"])
def test_a_plot_matplotlib_cannot_write_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], nothing_runs: None, tmp_path: Any, name: str
) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / name
    line = refusal(capsys, *SMALL, "--plot", str(path))
    assert f"--plot {path}: matplotlib writes " in line and "png" in line, line


def test_plot_without_matplotlib_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], nothing_runs: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises, as if not installed
    line = refusal(capsys, *SMALL, "--plot", str(tmp_path / "out.png"))
    assert line == "kvconn bench: --plot needs matplotlib: pip install 'kvconn-core[plot]'"


def test_a_curve_has_no_plot(capsys: pytest.CaptureFixture[str], nothing_runs: None, tmp_path: Any) -> None:
    line = refusal(capsys, *SMALL, "--curve", "rooms", "--plot", str(tmp_path / "out.png"))
    assert "--curve rooms has no plot" in line, line


# -- --metrics-port ----------------------------------------------------------------


@pytest.fixture
def taken() -> Iterator[tuple[int, socket.socket]]:
    """A port of 127.0.0.1 some other program holds, with the two after it free."""
    for _ in range(50):
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        if port + 3 > 65535:
            holder.close()
            continue
        free = True
        for other in (port + 1, port + 2):
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", other))
                except OSError:
                    free = False
        if free:
            holder.listen()
            try:
                yield port, holder
            finally:
                holder.close()
            return
        holder.close()
    pytest.skip("no three free ports in a row")


def test_a_metrics_port_in_use_is_named(
    capsys: pytest.CaptureFixture[str], nothing_runs: None, taken: tuple[int, socket.socket]
) -> None:
    port, _ = taken
    line = refusal(capsys, *SMALL, "--metrics-port", str(port))
    assert f"--metrics-port {port}: port {port} (decode's metrics) is not free on 127.0.0.1" in line, line


def test_a_ranks_metrics_port_in_use_is_named(
    capsys: pytest.CaptureFixture[str], nothing_runs: None, taken: tuple[int, socket.socket]
) -> None:
    """The port a rank would serve on (P+1+rank) taken: was a rank's traceback."""
    port, _ = taken
    line = refusal(capsys, *SMALL, "--metrics-port", str(port - 2))  # rank 1's is `port`
    assert f"port {port} (prefill rank 1's metrics) is not free" in line, line


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_an_endpoint_whose_metrics_port_is_taken_names_it(
    side: str, taken: tuple[int, socket.socket]
) -> None:
    """Was "cannot join thread before it is started": the listener, never
    started, was joined while the endpoint gave up."""
    port, _ = taken
    config = Config(metrics_port=port)
    with pytest.raises(OSError, match=rf"^cannot serve metrics on 127\.0\.0\.1:{port}: "):
        if side == "decode":
            DecodeEndpoint(get_backend("loopback"), num_pages=8, page_bytes=4096, config=config)
        else:
            PrefillRank(get_backend("loopback"), rank=0, source_bytes=1 << 16, config=config)


# -- --curve-points -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("curve", "points", "message"),
    [
        ("rooms", "x,y", "argument --curve-points: 'x' is not a number"),
        ("storm", ",", "argument --curve-points: ',' names no point"),
        ("rooms", "8,1.5", "argument --curve-points: --curve rooms takes whole numbers, got '1.5'"),
        (
            "tombstones",
            "1e3,2.5",
            "argument --curve-points: --curve tombstones takes whole numbers, got '2.5'",
        ),
    ],
)
def test_curve_points_that_are_not_numbers_are_an_argument_error(
    capsys: pytest.CaptureFixture[str], curve: str, points: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--curve", curve, "--curve-points", points])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"kvconn bench: error: {message}" in err, err


# -- Ctrl-C while importing -----------------------------------------------------------


def test_an_interrupt_during_the_subcommands_import_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(command: str, module: str) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_import_subcommand", interrupted)
    assert cli.main(["bench", "--requests", "5"]) == 130
    assert capsys.readouterr().err == "kvconn bench: interrupted (Ctrl-C)\n"


def test_an_interrupt_a_library_swallowed_while_importing_still_stops_the_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands in an imported library's bare ``except:`` (the
    bench then ran to its end, exit 0, once under load) still stops it."""

    def import_that_swallows(command: str, module: str, parser: Any) -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, raising inside this try
        except BaseException:  # what some libraries do around optional imports
            pass

    monkeypatch.setattr(cli, "_add_arguments", import_that_swallows)
    assert cli.main(["bench"]) == 130
    assert capsys.readouterr().err == "kvconn bench: interrupted (Ctrl-C)\n"


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_ctrl_c_while_kvconn_still_imports_is_one_line() -> None:
    """SIGINT while the bench's modules (rich, numpy, zmq: a second or more
    on a loaded machine) import, once kvconn.cli's main() has begun: was a
    30-line traceback. (Before main(), Python's own startup and kvconn.cli's
    few standard-library imports, a Ctrl-C is still Python's traceback.)"""
    launcher = "import sys\nfrom kvconn.cli import main\nsys.exit(main())\n"
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-c", launcher, "bench", "--no-progress", "--faults", "off"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # -X importtime: a line as each module has imported
            if line.rstrip().endswith("| kvconn.plugins"):  # main() imports it first
                break
        else:
            pytest.fail("kvconn.plugins was never imported")
        proc.send_signal(signal.SIGINT)
        _, err = waiting.communicate(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = [line for line in err.splitlines() if not line.startswith("import time:")]
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")
    }
    assert "kvconn.bench.cli" not in imported, "the signal came after the import: nothing was tested"
    assert proc.returncode == 130, err
    assert said == ["kvconn bench: interrupted (Ctrl-C)"], err


# -- Ctrl-C, again and again, while the bench closes -----------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals and process groups")
def test_every_ctrl_c_after_the_first_is_ignored_to_the_exit() -> None:
    """A user who keeps pressing Ctrl-C: the first stops the run, every later
    one, during the teardown or while Python finalizes (where it put back the
    default action: the process died of SIGINT, exit -2, no line), is ignored."""
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
        start_new_session=True,  # its own process group, as a terminal gives it
    )
    try:
        budget = waiting.Budget(90)
        while not _workers_of(proc.pid):  # into the workload: its ranks run
            assert proc.poll() is None and budget.left() > 0, proc.communicate()[0]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        budget = waiting.Budget(60)
        while proc.poll() is None and budget.left() > 0:
            try:
                os.killpg(proc.pid, signal.SIGINT)  # every 5 ms until it has exited
            except ProcessLookupError:
                break
            time.sleep(0.005)
        out, _ = waiting.communicate(proc, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, out)
    lines = [line for line in out.splitlines() if line.strip()]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert any(line == "kvconn bench: interrupted (Ctrl-C); no results" for line in lines), out
    assert len(lines) <= 3, out  # the line, and at most multiprocessing's leaked-memory warning


def _workers_of(parent: int) -> bool:
    """Whether ``parent`` has a child running the bench's prefill worker (Linux /proc)."""
    for stat in os.scandir("/proc"):
        if not stat.name.isdigit():
            continue
        try:
            with open(f"/proc/{stat.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{stat.name}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"kvconn.bench.prefill_worker" in cmdline:
            return True
    return False


def test_an_unknown_option_is_still_argparses_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--no-such-option"])
    assert re.search(r"unrecognized arguments: --no-such-option", capsys.readouterr().err)
