"""``kvconn bench``: abort-mid-transfer, verified and measured.

Runs the same seeded workload twice against one decode endpoint (this
process) and N prefill rank processes: once with ABORT_ACK (kvconn: fast
release, quarantine on timeout) and once timeout-only (legacy: acks off,
pages freed at the deadline without proof). Exit code 1 if kvconn's mode
showed any violation, 2 if the bench could not run.

``kvconn bench --transport [--backend a,b] [--repeat N]`` instead compares
bytes/s of the same chunked writes through kvconn and through each
transport's raw API; exit code 1 if a spot-checked page came out wrong.

docs/bench.md explains every row of the output and every JSON field.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import attrs
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvconn.bench import curve as curve_mod
from kvconn.bench import hosts_run, preflight
from kvconn.bench import overhead as overhead_mod
from kvconn.bench import plot as plot_mod
from kvconn.bench import report as report_mod
from kvconn.bench import transport as transport_mod
from kvconn.bench.mode_result import KVCONN, LEGACY, ModeResult, Violation, merge
from kvconn.bench.output import check_output_paths, write_json
from kvconn.bench.output import console as make_console
from kvconn.bench.raw import RawResult, run_raw
from kvconn.bench.sizes import size_arg
from kvconn.bench.workload import (
    DEFAULT_ABORT_WINDOW_MS,
    ModeRun,
    Planned,
    Settings,
    Workload,
    plan,
    plan_for_decode,
    pool_pages,
)
from kvconn.errors import KvconnError
from kvconn.options import parse_key_values
from kvconn.plugins import get_backend
from kvconn.testing import host_faults, scenarios
from kvconn.testing.child import StderrLog
from kvconn.transport import capabilities_of


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown once: not for a flag that is off or an option with no
    default (its help says what happens then), nor where the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, []) or "default" in text:
            return text
        return super()._get_help_string(action)


#: Environment that quiets a transport library's own logging unless --verbose:
#: Mooncake logs through glog on every run, warnings ("No RDMA devices
#: found", "Using default malloc/free") at the level MC_LOG_LEVEL sets when it
#: loads, and an ERROR, "Local segment descriptor not found", that no
#: MC_LOG_LEVEL silences: kvconn_mooncake applies GLOG_minloglevel (3: FATAL
#: only) after Mooncake loads. A child that fails still says why (its
#: Python error); -v shows every line.
QUIET_NATIVE_ENV = {"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "3"}
DEFAULT_HOST_FAULTS = ",".join(host_faults.FAULTS)


def quiet_native_logs(verbose: bool, env: dict[str, str] | None = None) -> None:
    """Set :data:`QUIET_NATIVE_ENV` in ``env`` (this process's, which every
    child inherits) unless ``verbose`` or the user set the variable already."""
    target: Any = os.environ if env is None else env
    if not verbose:
        for key, value in QUIET_NATIVE_ENV.items():
            target.setdefault(key, value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = HelpFormatter
    p.description = (__doc__ or "").replace("``", "")
    p.add_argument("--backend", default="loopback", help="loopback, nixl, mooncake or any installed plugin")
    p.add_argument(
        "--backend-option",
        "-o",
        "--option",
        dest="backend_option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="transport option for decode and prefill (repeatable), e.g. piece_delay_s=0.001",
    )
    p.add_argument("--ranks", type=int, default=2, help="prefill rank processes")
    p.add_argument(
        "--decodes",
        type=int,
        default=1,
        help="decode endpoints (in this process, each its own pool) asking every rank for the same "
        "rooms, each aborting its copy on its own (prefill TP smaller than decode TP)",
    )
    p.add_argument("--requests", type=int, default=300, help="requests per mode")
    p.add_argument("--pages", type=int, default=16, help="pages per request")
    p.add_argument("--page-bytes", type=size_arg, default=64 << 10, help="bytes per page (all ranks' shards)")
    p.add_argument("--chunk-pages", type=int, default=4, help="pages per chunk")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--abort-fraction", type=float, default=0.3, help="decode-initiated aborts")
    p.add_argument(
        "--prefill-fail-fraction",
        type=float,
        default=0.02,
        help="chance that a rank fails a room itself (prefill-initiated)",
    )
    p.add_argument(
        "--abort-window-ms",
        type=float,
        default=DEFAULT_ABORT_WINDOW_MS,
        help="aborts fall uniformly in [0, window] after the request, at times drawn from --seed: the "
        "same schedule for every run and every curve point",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (which rooms abort, and when)")
    p.add_argument(
        "--pool-pages", type=int, default=None, help="decode pages (default: sized from the workload)"
    )
    p.add_argument(
        "--stream-requests", type=int, default=128, help="requests of the no-abort throughput phase"
    )
    p.add_argument("--abort-timeout", type=float, default=30.0, help="decode deadline in kvconn's mode (s)")
    p.add_argument(
        "--gil-switch-ms",
        type=float,
        default=0.5,
        help="Config.gil_switch_interval_s of decode and every rank, in ms (0: Python's own, 5 ms)",
    )
    p.add_argument(
        "--legacy-timeout",
        type=float,
        default=1.5,
        help="decode deadline of the timeout-only mode (s); short to keep the run short",
    )
    p.add_argument("--modes", default="kvconn,legacy", help="which modes to run: kvconn, legacy or both")
    p.add_argument("--compare-raw", action="store_true", help="also time the same writes through the raw API")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': stdout)")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="plot release latency after abort and the fault table "
        "(needs matplotlib: pip install 'kvconn-core[plot]')",
    )
    p.add_argument(
        "--drain-s", type=float, default=5.0, help="kvconn mode: wait this long for held rooms at the end"
    )
    p.add_argument(
        "--settle-s", type=float, default=0.5, help="wait before the final canary check (late writes)"
    )
    p.add_argument(
        "--overhead-chunks", type=int, default=10000, help="chunks of the null-transport micro-measure"
    )
    p.add_argument(
        "--faults",
        choices=("short", "long", "off"),
        default="short",
        help="after the modes, on loopback, in both modes at once: production faults (ranks frozen, "
        "killed, restarted, partitioned (needs root), decode frozen and killed, an overloaded host, an "
        "abort storm) under a steady load of requests; short: six of them, long: the whole matrix",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="trace every room of the modes' runs with OpenTelemetry: decode's and every rank's spans, "
        "one trace per room, as JSON lines in FILE (needs pip install 'kvconn-core[trace]')",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="P",
        help="while the modes run, serve the decode endpoints' metrics on http://127.0.0.1:P/metrics "
        "and prefill rank r's on port P+1+r (Config.metrics_port; the fault phase is not served)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=None,
        metavar="N",
        help="decode on one host, the ranks on N-1 others (network namespaces; needs root; nixl or "
        "mooncake): release latency and throughput against the same run on one host, and the faults "
        "between hosts (docs/multi-host.md)",
    )
    p.add_argument(
        "--host-faults",
        default=DEFAULT_HOST_FAULTS,
        metavar="LIST",
        help="with --hosts: the faults between hosts to run (comma-separated)",
    )
    p.add_argument(
        "--curve",
        choices=curve_mod.CHOICES,
        default=None,
        help="instead of both modes: kvconn's mode at each point of one axis (rooms: --concurrency, "
        "ranks: --ranks, storm: --abort-fraction), and each point's ratios to the first; or segments "
        "(kvconn's lowering and post against the raw library's, scattered KV, --backend a,b), "
        "tombstones (a rank's ledger in an abort storm), fleet (a simulated fleet's control messages)",
    )
    p.add_argument(
        "--curve-points",
        default=None,
        type=preflight.points_arg,
        metavar="A,B,...",
        help="the --curve axis' points (default rooms 8,512; ranks 2,8; storm 0.1,0.9; segments "
        "118,1000,5000,20000 per chunk; tombstones 10000,100000 rooms; fleet 0.1,1,10 x 100 decodes)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars (on stderr)")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="pass child processes' stderr and transport libraries' own logging (Mooncake's glog) through",
    )
    transport_mod.add_arguments(p)


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not hasattr(args, "requests"):  # called by a cli.py that did not add our options
        add_arguments(parser)
        args = parser.parse_args(sys.argv[2:])
    to_stdout = args.json == "-"
    console = make_console(stderr=to_stdout)
    err = make_console(stderr=True)
    why = preflight.curve_points_error(args.curve, args.curve_points)
    if why:
        parser.error(why)
    unused = _unused_options(parser, args)
    if unused:
        bench = "--transport" if args.transport else "the abort bench (no --transport)"
        if _own_curve(args):
            bench = f"--curve {args.curve}"
        err.print(f"[red]kvconn bench: {bench} does not use {escape(', '.join(unused))}[/red]")
        return 2
    StderrLog.verbose = args.verbose
    args.sizing_defaults = preflight.sizing_defaults(parser)
    quiet_native_logs(args.verbose)
    try:
        with _interruptible():
            options = parse_key_values(args.backend_option, "--backend-option")
            if args.transport:
                return transport_mod.main(args, options, console, err)
            if _own_curve(args):
                return curve_mod.run_own(args, options, console, err)
            return _run(args, options, console, err)
    except Interrupted as stop:
        err.print(f"kvconn bench: {stop.why}; no results")
        return 128 + stop.signum
    except (ValueError, RuntimeError, OSError, LookupError, ImportError, KvconnError) as exc:
        # ImportError: a transport's native library that does not load here
        # (Mooncake without libibverbs), raised when decode opens its region.
        err.print(f"[red]kvconn bench: {escape(str(exc))}[/red]", soft_wrap=True)  # one line, however long
        return 2
    except MemoryError:  # a limit the up-front estimate (preflight.check_memory) did not see
        err.print(
            "[red]kvconn bench: out of memory: lower --pages, --page-bytes, --concurrency or --pool-pages[/red]"
        )
        return 2


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, raised in the main thread: a KeyboardInterrupt, so
    every ``except Exception`` on the way lets it through to the ``finally``
    blocks that close children, endpoints and hosts."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.why = (
            "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        )


@contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C or SIGTERM stops the run with one line: the signal unwinds the
    main thread through every ``finally`` that closes children, endpoints
    and hosts (the fault phase's threads are stopped by
    :func:`kvconn.testing.scenarios.run`), while the logging and thread
    tracebacks of that teardown (connections closing under the runtime's
    threads, until the process exits) are silenced. A second signal during
    the teardown is ignored: it would cut the teardown short and print."""
    interrupted = False
    previous_hook = threading.excepthook

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal interrupted
        if interrupted:
            return
        interrupted = True
        logging.disable(logging.CRITICAL)
        threading.excepthook = lambda args: None
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if not interrupted:  # else threads still winding down stay quiet until the exit
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            threading.excepthook = previous_hook
            logging.disable(logging.NOTSET)
        else:
            # Torn down; the process only exits now. Python puts back the
            # default action of each signal it handles as it finalizes, where
            # another Ctrl-C would kill it (exit -2, no line): ignored from
            # here, at the kernel, until the exit.
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)


def _check_args(args: argparse.Namespace) -> None:
    """Refuse values that cannot make a run (they would hang, or measure
    nonsense), before anything starts."""
    at_least = {
        "--ranks": (args.ranks, 1),
        "--decodes": (args.decodes, 1),
        "--requests": (args.requests, 1),
        "--pages": (args.pages, 1),
        "--page-bytes": (args.page_bytes, 8),
        "--chunk-pages": (args.chunk_pages, 1),
        "--concurrency": (args.concurrency, 1),
        "--stream-requests": (args.stream_requests, 0),
        "--overhead-chunks": (args.overhead_chunks, 1),
        "--pool-pages": (args.pool_pages if args.pool_pages is not None else args.pages, args.pages),
    }
    for flag, (value, low) in at_least.items():
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535 - args.ranks:
        raise ValueError(
            f"--metrics-port must be 1-{65535 - args.ranks} (P+1+rank is a port too), got {args.metrics_port}"
        )
    if not 0 <= args.abort_fraction <= 1:
        raise ValueError(f"--abort-fraction must be within [0, 1], got {args.abort_fraction}")
    if not 0 <= args.prefill_fail_fraction < 1:
        raise ValueError(f"--prefill-fail-fraction must be within [0, 1), got {args.prefill_fail_fraction}")
    for flag, value in (("--abort-timeout", args.abort_timeout), ("--legacy-timeout", args.legacy_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0 s, got {value}")
    for flag, value in (
        ("--drain-s", args.drain_s),
        ("--settle-s", args.settle_s),
        ("--gil-switch-ms", args.gil_switch_ms),
        ("--abort-window-ms", args.abort_window_ms),
    ):
        if not value >= 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    check_output_paths(args.json, args.plot)
    if args.plot:
        preflight.check_plot(args.plot, args.curve)
    if args.metrics_port is not None:
        preflight.check_ports_free(args.metrics_port, args.ranks)


#: Options both benches read; every other one belongs to one of them.
_SHARED = frozenset({"backend", "backend_option", "json", "no_progress", "seed", "transport", "verbose"})
#: What a --curve with a module of its own reads besides its curve.OWN options.
_OUTPUT = frozenset({"curve", "curve_points", "json", "no_progress", "verbose"})


def _own_curve(args: argparse.Namespace) -> bool:
    """``--curve segments|tombstones|fleet`` (without ``--transport``)."""
    return not args.transport and args.curve in curve_mod.OWN


def _unused_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags given a value other than their default that the chosen bench
    never reads (``--profile`` without ``--transport``, say), so that a run
    does not silently measure something other than what was asked."""
    unused = []
    own = curve_mod.OWN[args.curve] | _OUTPUT if _own_curve(args) else None
    for action in parser._actions:  # argparse has no public list of a parser's options
        dest = action.dest
        if dest == "help" or not action.option_strings:
            continue
        if own is not None:
            if dest in own:
                continue
        elif dest in _SHARED or (dest in transport_mod.OPTIONS) == args.transport:
            continue  # read by the bench that runs
        if getattr(args, dest, None) != parser.get_default(dest):
            unused.append(action.option_strings[0])
    return unused


def _run(args: argparse.Namespace, options: dict[str, str], console: Console, err: Console) -> int:
    _check_args(args)
    provider = _start_trace(args.trace) if args.trace else None
    try:
        return _run_traced(args, options, console, err)
    finally:
        if provider is not None:
            provider.shutdown()


def _start_trace(path: str) -> Any:
    """This process's spans go to ``path`` (emptied first); the ranks' too, by their arguments."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise ImportError("--trace needs opentelemetry-sdk: pip install 'kvconn-core[trace]'") from None
    from kvconn.runtime.trace_export import write_spans_to

    open(path, "w").close()
    return write_spans_to(path)


def _run_traced(args: argparse.Namespace, options: dict[str, str], console: Console, err: Console) -> int:
    # A room's only chunk holds all its pages: the chunk the report (and the
    # drain estimate) speaks of is that one.
    args.chunk_pages = min(args.chunk_pages, args.pages)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in (KVCONN, LEGACY) for m in modes):
        raise ValueError(f"--modes takes kvconn and/or legacy, got {args.modes!r}")
    backend = get_backend(args.backend)
    limit = capabilities_of(backend, options).max_write_timeout_s
    legacy_timeout = args.legacy_timeout
    notes: list[str] = []
    if LEGACY in modes and limit is not None and legacy_timeout <= limit:
        legacy_timeout = limit + 1.0
        notes.append(
            f"{args.backend} may take {limit} s to fail a write: legacy timeout raised to {legacy_timeout} s"
        )
    stream_n = min(args.stream_requests, max(1, args.requests)) if args.stream_requests else 0
    pool = args.pool_pages or pool_pages(args.pages, args.concurrency, stream_n)
    # Every field but these two is the option of the same name.
    sized = {"pool_pages": pool, "stream_requests": stream_n}
    wl = Workload(**{f.name: sized.get(f.name, getattr(args, f.name)) for f in attrs.fields(Workload)})
    preflight.check_memory(args, wl)
    if args.page_bytes % (8 * args.ranks):
        raise ValueError("--page-bytes must split evenly over --ranks (in 8-byte words)")
    if args.hosts is not None:
        return hosts_run.run(args, wl, options, console, err)
    if args.host_faults != DEFAULT_HOST_FAULTS:
        raise ValueError("--host-faults needs --hosts")
    if args.curve:
        return _curve(args, console, options, wl)
    work, stream_rooms = plan(wl)
    results: dict[str, ModeResult] = {}
    stream_info: dict[str, float] = {}
    raw: RawResult | None = None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, disable=args.no_progress) as progress:
        task = progress.add_task("per-chunk overhead (null transport)", total=1)
        ovh = overhead_mod.measure(args.overhead_chunks)
        progress.update(task, advance=1)
        window = args.abort_window_ms / 1e3
        for mode in modes:
            legacy = mode == LEGACY
            runs: list[ModeRun] = []
            settings = Settings.of(
                args,
                options,
                legacy=legacy,
                decode_timeout_s=legacy_timeout if legacy else args.abort_timeout,
                drain_s=(legacy_timeout + 1.0) if legacy else args.drain_s,
                trace_file=args.trace,
                metrics_port=args.metrics_port,
            )
            try:
                # decode 0 starts the prefill ranks; every other decode shares them
                run = ModeRun(wl, settings)
                runs.append(run)
                while len(runs) < wl.decodes:
                    runs.append(ModeRun(wl, settings, run.procs))
                if not legacy and stream_n and not stream_info:
                    t = progress.add_task(f"{mode}: streaming (no aborts)", total=len(stream_rooms))
                    stream_info = run.stream(stream_rooms, functools.partial(progress.advance, t))
                    if args.compare_raw and raw is None:
                        t = progress.add_task(escape(f"raw {args.backend} (same writes, no kvconn)"), total=1)
                        raw = run_raw(
                            args.backend,
                            backend,
                            run.stream_rooms,
                            wl.page_bytes,
                            wl.ranks,
                            wl.chunk_pages,
                            wl.pool_pages,
                            options,
                        )
                        progress.update(t, advance=1)
                t = progress.add_task(
                    f"{mode}: {'timeout-only' if legacy else 'ABORT_ACK'} workload",
                    total=len(work) * wl.decodes,
                )
                per_decode = _run_decodes(runs, work, wl, window, functools.partial(progress.advance, t))
            finally:
                for r in reversed(runs):  # decode 0, owner of the ranks, last
                    r.close()
            results[mode] = merge(per_decode)
        faults = _faults(args, progress, notes)
    report = report_mod.build(
        args, options, wl, ovh, stream_info, window, raw, results, legacy_timeout, notes
    )
    if faults is not None:
        report["faults"] = [o.as_dict() for o in faults]
        report["violations"][KVCONN] += [
            Violation("fault_corruption", None, f"{o.fault}: {o.corrupted} pages").as_dict()
            for o in faults
            if o.mode == KVCONN and o.corrupted
        ]
        report["ok"] = not report["violations"][KVCONN]
    report_mod.print_report(console, report)
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot_mod.plot(args.plot, results, legacy_timeout, report.get("faults", []), err)
    return 1 if report["violations"][KVCONN] else 0


def _curve(args: argparse.Namespace, console: Console, options: dict[str, str], wl: Workload) -> int:
    """``--curve``: kvconn's mode at each point of one axis (kvconn.bench.curve)."""
    report = curve_mod.run(args, wl, Settings.of(args, options), args.abort_window_ms / 1e3)
    curve_mod.print_report(console, report)
    if args.json:
        write_json(args.json, report)
    return 1 if any(row["violations"] for row in report["points"]) else 0


def _run_decodes(
    runs: list[ModeRun], work: list[Planned], wl: Workload, window: float, progress: Callable[[int], None]
) -> list[ModeResult]:
    """Every decode runs the workload at once, each in its own thread with its
    own aborts, asking the shared ranks for the same room ids."""
    if len(runs) == 1:
        return [runs[0].run(work, window, progress)]
    with ThreadPoolExecutor(len(runs), thread_name_prefix="bench-decode") as pool:
        return list(
            pool.map(lambda d: runs[d].run(plan_for_decode(work, d, wl), window, progress), range(len(runs)))
        )


def _faults(args: argparse.Namespace, progress: Progress, notes: list[str]) -> list[scenarios.Outcome] | None:
    if args.faults == "off":
        return None
    if args.backend != "loopback":
        notes.append("--faults runs on loopback only (its fault injection): not run")
        return None
    faults = scenarios.SHORT if args.faults == "short" else scenarios.FAULTS
    task = progress.add_task("production faults, both modes", total=2 * len(faults))
    runtime = logging.getLogger("kvconn.runtime")
    level = runtime.level
    runtime.setLevel(logging.ERROR)  # each fault's quarantine is expected: the table reports it
    try:
        return scenarios.run(faults, on_step=lambda _: progress.update(task, advance=1))
    finally:
        runtime.setLevel(level)
