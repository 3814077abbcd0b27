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
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvconn.bench import child as child_mod
from kvconn.bench import overhead as overhead_mod
from kvconn.bench import transport as transport_mod
from kvconn.bench.output import check_output_paths, write_json
from kvconn.bench.output import console as make_console
from kvconn.bench.raw import RawResult, run_raw
from kvconn.bench.sizes import size_arg
from kvconn.bench.workload import (
    ModeResult,
    ModeRun,
    Planned,
    Workload,
    merge,
    plan,
    plan_for_decode,
    stats,
)
from kvconn.plugins import get_backend
from kvconn.testing import scenarios
from kvconn.transport import capabilities_of

KVCONN, LEGACY = "kvconn", "legacy"
#: Steal (percent of CPU time) above which the report warns that latencies include it.
STEAL_NOTE_PCT = 5.0


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown once: not for a flag that is off or an option with no
    default (its help says what happens then), nor where the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, []) or "default" in text:
            return text
        return super()._get_help_string(action)


#: Environment that quiets a transport library's own logging unless --verbose:
#: Mooncake logs warnings through glog on every run ("No RDMA devices found",
#: "Using default malloc/free") at the level MC_LOG_LEVEL sets when it loads
#: (it ignores GLOG_minloglevel). Its one ERROR line, "Local segment
#: descriptor not found", is not below any level that keeps real errors.
QUIET_NATIVE_ENV = {"MC_LOG_LEVEL": "ERROR"}


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
        default=None,
        help="aborts fall uniformly in [0, window] after the request (default: the streaming phase's "
        "p50 latency)",
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
        help="after the modes, on loopback: a rank frozen mid-write, a late transport queue and a "
        "partitioned rank (needs root), in both modes; short: one room each, long: four",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars (on stderr)")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="pass child processes' stderr and transport libraries' own logging (Mooncake's glog) through",
    )
    transport_mod.add_arguments(p)


def _options(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--backend-option wants KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not hasattr(args, "requests"):  # called by a cli.py that did not add our options
        add_arguments(parser)
        args = parser.parse_args(sys.argv[2:])
    to_stdout = args.json == "-"
    console = make_console(stderr=to_stdout)
    err = make_console(stderr=True)
    unused = _unused_options(parser, args)
    if unused:
        bench = "--transport" if args.transport else "the abort bench (no --transport)"
        err.print(f"[red]kvconn bench: {bench} does not use {escape(', '.join(unused))}[/red]")
        return 2
    child_mod.VERBOSE = args.verbose
    quiet_native_logs(args.verbose)
    try:
        with _interruptible():
            if args.transport:
                return transport_mod.main(args, _options(args.backend_option), console, err)
            return _run(args, console, err)
    except KeyboardInterrupt:
        err.print("kvconn bench: interrupted (Ctrl-C); no results")
        return 130
    except (ValueError, RuntimeError, OSError, KeyError, LookupError) as exc:
        err.print(f"[red]kvconn bench: {escape(str(exc))}[/red]")
        return 2


@contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C stops the run with one line: the interrupt unwinds the main
    thread through every ``finally`` that closes children and endpoints,
    while the logging and thread tracebacks of that teardown (connections
    closing under the runtime's threads) are silenced."""
    previous_hook = threading.excepthook

    def on_interrupt(signum: int, frame: Any) -> None:
        logging.disable(logging.CRITICAL)
        threading.excepthook = lambda args: None
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        threading.excepthook = previous_hook
        logging.disable(logging.NOTSET)


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
    if not 0 <= args.abort_fraction <= 1:
        raise ValueError(f"--abort-fraction must be within [0, 1], got {args.abort_fraction}")
    if not 0 <= args.prefill_fail_fraction < 1:
        raise ValueError(f"--prefill-fail-fraction must be within [0, 1), got {args.prefill_fail_fraction}")
    for flag, value in (("--abort-timeout", args.abort_timeout), ("--legacy-timeout", args.legacy_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0 s, got {value}")
    window = args.abort_window_ms if args.abort_window_ms is not None else 0.0
    for flag, value in (
        ("--drain-s", args.drain_s),
        ("--settle-s", args.settle_s),
        ("--gil-switch-ms", args.gil_switch_ms),
        ("--abort-window-ms", window),
    ):
        if not value >= 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    check_output_paths(args.json, args.plot)


#: Options both benches read; every other one belongs to one of them.
_SHARED = frozenset({"backend", "backend_option", "json", "no_progress", "seed", "transport", "verbose"})


def _unused_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags given a value other than their default that the chosen bench
    never reads (``--profile`` without ``--transport``, say), so that a run
    does not silently measure something other than what was asked."""
    unused = []
    for action in parser._actions:  # argparse has no public list of a parser's options
        dest = action.dest
        if dest in _SHARED or dest == "help" or not action.option_strings:
            continue
        if (dest in transport_mod.OPTIONS) == args.transport:
            continue  # read by the bench that runs
        if getattr(args, dest, None) != parser.get_default(dest):
            unused.append(action.option_strings[0])
    return unused


def _run(args: argparse.Namespace, console: Console, err: Console) -> int:
    _check_args(args)
    # A room's only chunk holds all its pages: the chunk the report (and the
    # drain estimate) speaks of is that one.
    args.chunk_pages = min(args.chunk_pages, args.pages)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in (KVCONN, LEGACY) for m in modes):
        raise ValueError(f"--modes takes kvconn and/or legacy, got {args.modes!r}")
    options = _options(args.backend_option)
    backend = get_backend(args.backend)
    if args.page_bytes % (8 * args.ranks):
        raise ValueError("--page-bytes must split evenly over --ranks (in 8-byte words)")
    limit = capabilities_of(backend, options).max_write_timeout_s
    legacy_timeout = args.legacy_timeout
    notes: list[str] = []
    if limit is not None and legacy_timeout <= limit:
        legacy_timeout = limit + 1.0
        notes.append(
            f"{args.backend} may take {limit} s to fail a write: legacy timeout raised to {legacy_timeout} s"
        )
    stream_n = min(args.stream_requests, max(1, args.requests)) if args.stream_requests else 0
    pool = args.pool_pages or max(stream_n * args.pages, 8 * args.concurrency * args.pages, args.pages)
    wl = Workload(
        requests=args.requests,
        pages=args.pages,
        page_bytes=args.page_bytes,
        chunk_pages=args.chunk_pages,
        ranks=args.ranks,
        concurrency=args.concurrency,
        abort_fraction=args.abort_fraction,
        prefill_fail_fraction=args.prefill_fail_fraction,
        seed=args.seed,
        pool_pages=pool,
        stream_requests=stream_n,
        decodes=args.decodes,
    )
    work, stream_rooms = plan(wl)
    results: dict[str, ModeResult] = {}
    stream_info: dict[str, float] = {}
    raw: RawResult | None = None
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=args.no_progress,
        transient=False,
    ) as progress:
        task = progress.add_task("per-chunk overhead (null transport)", total=1)
        ovh = overhead_mod.measure(args.overhead_chunks)
        progress.update(task, advance=1)
        window = args.abort_window_ms / 1e3 if args.abort_window_ms is not None else None
        for mode in modes:
            legacy = mode == LEGACY
            timeout = legacy_timeout if legacy else args.abort_timeout
            runs: list[ModeRun] = []

            new_run = functools.partial(
                ModeRun,
                mode,
                args.backend,
                backend,
                wl,
                timeout,
                min(5.0, timeout / 2),
                legacy,
                options,
                drain_s=(legacy_timeout + 1.0) if legacy else args.drain_s,
                settle_s=args.settle_s,
                gil_switch_interval_s=args.gil_switch_ms / 1e3 if args.gil_switch_ms > 0 else None,
            )
            try:
                # decode 0 starts the prefill ranks; every other decode shares them
                run = new_run(procs=None)
                runs.append(run)
                while len(runs) < wl.decodes:
                    runs.append(new_run(procs=run.procs))
                if window is None or (not legacy and stream_n and not stream_info):
                    t = progress.add_task(f"{mode}: streaming (no aborts)", total=len(stream_rooms))
                    stream_info = run.stream(stream_rooms, _adv(progress, t))
                    if window is None:
                        window = stream_info["latency_p50_ms"] / 1e3 or 0.01
                    if args.compare_raw and raw is None:
                        t = progress.add_task(f"raw {args.backend} (same writes, no kvconn)", total=1)
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
                per_decode = _run_decodes(runs, work, wl, window, _adv(progress, t))
            finally:
                for r in reversed(runs):  # decode 0, owner of the ranks, last
                    r.close()
            results[mode] = merge(per_decode)
        faults = _faults(args, progress, notes)
    report = _report(args, wl, ovh, stream_info, window or 0.0, raw, results, legacy_timeout, notes)
    if faults is not None:
        report["faults"] = [o.as_dict() for o in faults]
        report["violations"][KVCONN] += [
            {
                "kind": "fault_corruption",
                "room": None,
                "detail": f"{o.fault}: {o.corrupted_pages} pages",
                "page": None,
            }
            for o in faults
            if o.mode == KVCONN and o.corrupted_pages
        ]
        report["ok"] = not report["violations"][KVCONN]
    _print(console, report)
    if args.json:
        write_json(args.json, report)
    if args.plot:
        _plot(args.plot, results, legacy_timeout, report.get("faults", []), err)
    return 1 if report["violations"][KVCONN] else 0


def _run_decodes(
    runs: list[ModeRun], work: list[Planned], wl: Workload, window: float, progress: Callable[[int], None]
) -> list[ModeResult]:
    """Every decode runs the workload at once, each in its own thread with its
    own aborts, asking the shared ranks for the same room ids."""
    if len(runs) == 1:
        return [runs[0].run(work, window, progress)]
    out: list[ModeResult | None] = [None] * len(runs)
    errors: list[BaseException] = []

    def one(d: int) -> None:
        try:
            out[d] = runs[d].run(plan_for_decode(work, d, wl), window, progress)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(d,), name=f"bench-decode-{d}") for d in range(len(runs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return [r for r in out if r is not None]


def _faults(args: argparse.Namespace, progress: Progress, notes: list[str]) -> list[scenarios.Outcome] | None:
    if args.faults == "off":
        return None
    if args.backend != "loopback":
        notes.append("--faults runs on loopback only (its fault injection): not run")
        return None
    task = progress.add_task("production faults, both modes", total=2 * len(scenarios.FAULTS))
    runtime = logging.getLogger("kvconn.runtime")
    level = runtime.level
    runtime.setLevel(logging.ERROR)  # each fault's quarantine is expected: the table reports it
    try:
        return scenarios.run(
            rooms=1 if args.faults == "short" else 4, on_step=lambda _: progress.update(task, advance=1)
        )
    finally:
        runtime.setLevel(level)


def _adv(progress: Progress, task: Any) -> Callable[[int], None]:
    def advance(n: int) -> None:
        progress.update(task, advance=n)

    return advance


def _report(
    args: argparse.Namespace,
    wl: Workload,
    ovh: overhead_mod.Overhead,
    stream_info: dict[str, float],
    window: float,
    raw: RawResult | None,
    results: dict[str, ModeResult],
    legacy_timeout: float,
    notes: list[str],
) -> dict[str, Any]:
    modes = {m: r.summary() for m, r in results.items()}
    chunk_bytes = wl.chunk_pages * wl.shard
    per_rank_gbps = stream_info.get("gbps", 0.0) / wl.ranks
    drain_ms = chunk_bytes / (per_rank_gbps * 1e9) * 1e3 if per_rank_gbps else 0.0
    fast = modes.get(KVCONN, {}).get("release_latency_ms", stats([]))
    slow = modes.get(LEGACY, {}).get("release_latency_ms", stats([]))
    cmp: dict[str, Any] = {
        "legacy_timeout_s": legacy_timeout,
        "kvconn_abort_timeout_s": args.abort_timeout,
        "gil_switch_interval_ms": args.gil_switch_ms or None,
    }
    if fast["n"] and slow["n"]:
        cmp["ratio_p50"] = slow["p50"] / fast["p50"] if fast["p50"] else None
        cmp["ratio_p99"] = slow["p99"] / fast["p99"] if fast["p99"] else None
    if fast["n"]:
        cmp["ratio_vs_30s_timeout_p99"] = 30e3 / fast["p99"] if fast["p99"] else None
    raw_d: dict[str, Any] | None = None
    if raw is not None:
        raw_d = {"available": raw.available, "detail": raw.detail, "gbps": raw.gbps, "seconds": raw.seconds}
        if raw.available and stream_info.get("gbps"):
            raw_d["kvconn_over_raw"] = stream_info["gbps"] / raw.gbps if raw.gbps else None
            raw_d["overhead_ratio"] = raw.gbps / stream_info["gbps"]
    violations = {m: modes[m]["violations"] for m in modes}
    violations.setdefault(KVCONN, [])
    targets: list[dict[str, Any]] = []

    def target(name: str, goal: str, value: str, ok: bool | None, gates_exit: bool = False) -> None:
        targets.append({"target": name, "goal": goal, "value": value, "ok": ok, "gates_exit": gates_exit})

    if fast["n"]:
        target(
            "fast release p99",
            f"<= chunk drain ({drain_ms:.3f} ms) + 5 ms",
            f"{fast['p99']:.2f} ms at {wl.abort_fraction:.0%} aborts",
            fast["p99"] <= drain_ms + 5,
        )
        r30 = cmp.get("ratio_vs_30s_timeout_p99")
        target(
            "vs 30 s timeout-only",
            ">= 1000x",
            f"{r30:,.0f}x (30 s / p99)" if r30 else "n/a",
            None if r30 is None else r30 >= 1000,
        )
        if cmp.get("ratio_p99"):
            target(
                f"vs {legacy_timeout:g} s timeout-only (measured)",
                "ratio, stated",
                f"{cmp['ratio_p99']:,.0f}x p99, {cmp['ratio_p50']:,.0f}x p50",
                None,
            )
    target("per-chunk overhead (hooks+ledger)", "<= 10 us", f"{ovh.direct_us:.1f} us", ovh.direct_us <= 10)
    if raw_d is not None and raw_d.get("kvconn_over_raw") is not None:
        target(
            # Stated, not judged: both sides run one process per rank, but a raw
            # process fills a chunk, then writes it and spins on it, while a
            # kvconn rank fills the next chunk on its engine's thread as its
            # worker writes, and its barrier yields the CPU now and then (with
            # more writers than cores, a raw spin starves the page owner's
            # progress). kvconn bench --transport is like for like, and judges.
            "throughput vs raw (raw: fill, then write)",
            f"ratio, stated ({chunk_bytes >> 10} KiB chunks; >= 95% judged by --transport)",
            f"{raw_d['kvconn_over_raw']:.0%}",
            None,
        )
    if KVCONN in results:
        r = results[KVCONN]
        exceeded = any(v.kind == "held_exceeds_aborted" for v in r.violations)
        target(
            "peak pages held <= aborted, unreleased",
            "always",
            f"peak {r.peak_pages_held} <= {r.peak_pages_aborted_unreleased}",
            not exceeded,
            gates_exit=True,  # a page held past what aborts explain is a violation
        )
        target("violations (kvconn)", "0", str(len(r.violations)), not r.violations, gates_exit=True)
    notes.append(
        f"GIL switch interval {args.gil_switch_ms:g} ms in decode and every rank (--gil-switch-ms, "
        "Config.gil_switch_interval_s)"
        if args.gil_switch_ms > 0
        else "GIL switch interval: Python's default (5 ms), which can add up to 5 ms per hop of an abort"
    )
    notes.append(
        f"timeout-only mode ran with a {legacy_timeout:g} s deadline to keep the run short; the ratio against it "
        "is measured, the one against the default 30 s deadline is 30 s / kvconn's p99"
    )
    steal = max((m["cpu"].get("steal", 0.0) for m in modes.values()), default=0.0)
    if steal >= STEAL_NOTE_PCT:
        notes.append(
            f"the hypervisor took up to {steal:.0f}% of this machine's CPU time during a mode (steal): "
            "every hop of an abort waited for it, so latencies here overstate kvconn's own"
        )
    if args.requests < 10000:
        notes.append("the 0-violation target is stated for 10,000 requests: run with --requests 10000")
    return {
        "backend": args.backend,
        "workload": {
            "requests": wl.requests,
            "pages": wl.pages,
            "page_bytes": wl.page_bytes,
            "chunk_pages": wl.chunk_pages,
            "chunk_bytes_per_rank": chunk_bytes,
            "ranks": wl.ranks,
            "decodes": wl.decodes,
            "concurrency": wl.concurrency,
            "abort_fraction": wl.abort_fraction,
            "prefill_fail_fraction": wl.prefill_fail_fraction,
            "seed": wl.seed,
            "pool_pages": wl.pool_pages,
            "abort_window_ms": window * 1e3,
            "backend_options": _options(args.backend_option),
        },
        "overhead": ovh.as_dict(),
        "stream": stream_info,
        "chunk_drain_ms": drain_ms,
        "raw": raw_d
        if raw_d is not None
        else ({"available": False, "detail": "not requested (--compare-raw)"}),
        "modes": modes,
        "comparison": cmp,
        "targets": targets,
        "violations": violations,
        "notes": notes,
        "ok": not violations[KVCONN],
    }


def _fmt_lat(d: dict[str, float]) -> str:
    return f"{d['p50']:.2f} / {d['p99']:.2f} / {d['max']:.2f}" if d["n"] else "-"


def _print(console: Console, rep: dict[str, Any]) -> None:
    modes = rep["modes"]
    names = [m for m in (KVCONN, LEGACY) if m in modes]
    title = {
        KVCONN: "kvconn (ABORT_ACK)",
        LEGACY: f"timeout-only ({rep['comparison']['legacy_timeout_s']:g} s)",
    }
    w = rep["workload"]
    t = Table(
        title=f"kvconn bench: {rep['backend']}, {w['requests']} requests/mode, "
        f"{w['ranks']} prefill rank(s) -> {w['decodes']} decode(s)"
    )
    t.add_column("metric")
    for m in names:
        t.add_column(title[m], justify="right")

    def row(label: str, fn: Callable[[dict[str, Any]], str]) -> None:
        t.add_row(label, *(fn(modes[m]) for m in names))

    row(
        "requests (done / aborted / prefill-failed)",
        lambda d: f"{d['completed']} / {d['aborted_mid_transfer']} / {d['prefill_failed']}",
    )
    row("completed before their abort point", lambda d: str(d["completed_before_abort_point"]))
    row("throughput (GB/s, req/s)", lambda d: f"{d['throughput_gbps']:.2f}, {d['requests_per_s']:.0f}")
    row("abort->release ms p50 / p99 / max", lambda d: _fmt_lat(d["release_latency_ms"]))
    row("prefill-fail->release ms p50 / p99", lambda d: _fmt_lat(d["prefill_fail_release_latency_ms"]))
    row(
        "abort->ack ms p50 / p99, by rank: at most",
        lambda d: (
            ", ".join(
                f"rank {rank}: {w['p50_at_most']:g} / {w['p99_at_most']:g}"
                for rank, w in sorted(d["ack_wait_ms_by_rank"].items())
            )
            or "-"
        ),
    )
    row(
        "releases by proof",
        lambda d: ", ".join(f"{k}={v}" for k, v in sorted(d["releases_by_proof"].items())),
    )
    row(
        "acks received / sent", lambda d: f"{d['acks_received']:.0f} / {d['prefill'].get('acks_sent', 0):.0f}"
    )
    row(
        "fences ok / failed",
        lambda d: f"{d['prefill'].get('fences_ok', 0):.0f} / {d['prefill'].get('fences_failed', 0):.0f}",
    )
    row(
        "poisoned (unsettled chunks / at end)",
        lambda d: (
            f"{d['prefill'].get('chunks_unsettled', 0) + d['prefill'].get('chunks_plugin_error', 0):.0f} / {d['prefill'].get('poisoned_rooms_end', 0):.0f}"
        ),
    )
    row(
        "quarantines / time in quarantine",
        lambda d: f"{d['quarantines']:.0f} / {d['quarantine_seconds']:.2f} s",
    )
    row(
        "peak pages held (aborted, unreleased)",
        lambda d: f"{d['peak_pages_held']} ({d['peak_pages_aborted_unreleased']})",
    )
    row(
        "unreleased at end: rooms / held / quarantined pages",
        lambda d: f"{d['rooms_unreleased_end']} / {d['pages_held_end']} / {d['pages_quarantined_end']}",
    )
    row(
        "machine CPU: busy / stolen by the hypervisor",
        lambda d: f"{d['cpu']['busy']:.0f}% / {d['cpu']['steal']:.0f}%" if d["cpu"] else "-",
    )
    row(
        "violations",
        lambda d: f"[red]{len(d['violations'])}[/red]" if d["violations"] else "[green]0[/green]",
    )
    console.print(t)

    s, o = rep["stream"], rep["overhead"]
    if s:
        console.print(
            f"streaming (no aborts): {s['requests']:.0f} requests, {s['gbps']:.2f} GB/s, "
            f"latency p50 {s['latency_p50_ms']:.2f} ms; abort window {rep['workload']['abort_window_ms']:.2f}"
            f" ms; drain of one {rep['workload']['chunk_bytes_per_rank'] >> 10} KiB chunk "
            f"~{rep['chunk_drain_ms']:.3f} ms"
        )
    console.print(
        f"per-chunk runtime overhead (null transport): {o['direct_us']:.1f} us direct "
        f"(ledger+hooks+metrics), {o['queued_us']:.1f} us via Sender.send + worker queue; "
        f"control round trip per room p50 {o['control_rtt_ms']:.2f} ms"
    )
    raw = rep["raw"]
    if raw.get("available"):
        console.print(
            f"raw {rep['backend']}: {raw['gbps']:.2f} GB/s ({raw['detail']}); kvconn streaming "
            f"{s.get('gbps', 0):.2f} GB/s = {raw.get('kvconn_over_raw', 0):.0%} of raw "
            f"(overhead ratio {raw.get('overhead_ratio', 0):.2f}x)"
        )
    else:
        console.print(f"raw comparison: {escape(raw['detail'])}")
    if rep.get("faults"):
        _print_faults(console, rep["faults"])
    _print_targets(console, rep)
    _print_violations(console, rep["violations"])
    for n in rep["notes"]:
        console.print(f"note: {escape(n)}")


def _print_violations(console: Console, violations: dict[str, list[dict[str, Any]]]) -> None:
    """Up to 20 violations of each mode, each labelled with its mode."""
    for mode, vs in violations.items():
        label = escape("[kvconn]" if mode == KVCONN else "[legacy] (expected to be possible there)")
        for v in vs[:20]:
            console.print(
                f"[red]violation[/red] {label} {escape(str(v['kind']))} room={v['room']}: "
                f"{escape(str(v['detail']))}"
            )
        if len(vs) > 20:
            console.print(f"... and {len(vs) - 20} more {mode} violations (see --json)")


#: Busy share of the machine's CPUs during kvconn's mode above which a
#: missed latency target is put down to the machine, in the report.
SATURATED_BUSY_PCT = 90.0


def _print_targets(console: Console, rep: dict[str, Any]) -> None:
    """The targets, which of them decide the exit code, and why a stated one
    missed on this machine."""
    tt = Table(title="targets")
    for c in ("target", "goal", "value", "met", "gates exit code"):
        tt.add_column(c)
    for tg in rep["targets"]:
        gates = tg.get("gates_exit", False)
        if tg["ok"] is None:
            ok = "-"
        elif tg["ok"]:
            ok = "[green]yes[/green]"
        else:
            ok = "[red]NO[/red]" if gates else "[yellow]no[/yellow] (stated)"
        tt.add_row(
            escape(tg["target"]), escape(tg["goal"]), escape(tg["value"]), ok, "yes" if gates else "no"
        )
    console.print(tt)
    console.print(
        "exit code: 1 only if kvconn's mode shows a violation (a late write into a released page, "
        "wrong bytes, pages held past what aborts explain, a production fault corrupting a page): "
        "the safety targets, which hold on any machine. The latency, overhead and throughput targets "
        "are measured and stated, never gated: they depend on this machine's cores and load."
    )
    missed = [tg["target"] for tg in rep["targets"] if tg["ok"] is False and not tg.get("gates_exit")]
    if not missed:
        return
    cpu = rep["modes"].get(KVCONN, {}).get("cpu") or {}
    busy, steal = cpu.get("busy", 0.0), cpu.get("steal", 0.0)
    if busy >= SATURATED_BUSY_PCT or steal >= STEAL_NOTE_PCT:
        why = (
            f"the machine's CPUs were {busy:.0f}% busy ({steal:.0f}% stolen by the hypervisor) during "
            "kvconn's mode: every hop of an abort waited for a core, so these figures measure the "
            "machine as much as kvconn"
        )
    else:
        why = f"the machine was not saturated ({busy:.0f}% busy, {steal:.0f}% steal): worth a look"
    console.print(f"stated targets missed: {escape(', '.join(missed))}; {escape(why)}")


def _print_faults(console: Console, faults: list[dict[str, Any]]) -> None:
    t = Table(
        title=f"production faults (loopback; decode deadline {scenarios.DEADLINE_S:g} s in both modes): "
        "pages a late write reached after decode handed them back"
    )
    for col in (
        "fault",
        "timeout-only: corrupted",
        "kvconn: corrupted",
        "kvconn's cost: quarantined, back after",
    ):
        t.add_column(col, justify="left" if col == "fault" else "right")
    by = {(f["fault"], f["mode"]): f for f in faults}
    for fault in scenarios.FAULTS:
        k, leg = by.get((fault, KVCONN)), by.get((fault, LEGACY))
        if k is None or leg is None:
            continue
        if k["skipped"]:
            t.add_row(fault, "-", "-", f"not run: {escape(k['skipped'])}")
            continue
        back = ", ".join(f"{s:.2f} s" for s in k["recovery_s"]) or "-"
        cost = f"{k['quarantined_pages']} of {k['pages']} pages, {back} ({', '.join(k['proofs'])})"
        if k["unreleased"]:
            cost += f"; {k['unreleased']} rooms still held"
        bad = leg["corrupted_pages"]
        t.add_row(
            fault,
            f"[red]{bad}[/red] of {leg['pages']}" if bad else f"0 of {leg['pages']}",
            f"[red]{k['corrupted_pages']}[/red]" if k["corrupted_pages"] else "[green]0[/green]",
            escape(cost),
        )
    console.print(t)


#: The decode deadline a deployment runs with (the default of
#: ``Config.abort_timeout_s``): where a timeout-only engine frees pages.
DEPLOYMENT_DEADLINE_S = 30.0


def _plot(
    path: str,
    results: dict[str, ModeResult],
    legacy_timeout: float,
    faults: list[dict[str, Any]],
    err: Console,
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        err.print(escape("--plot needs matplotlib: pip install 'kvconn-core[plot]'; no plot written"))
        return
    fig = figure(results, legacy_timeout, faults)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    err.print(f"plot written to {escape(path)}")


def figure(results: dict[str, ModeResult], legacy_timeout: float, faults: list[dict[str, Any]]) -> Any:
    """Release latency after abort in each mode, the deadlines that bound
    timeout-only release (the bench's short one and a deployment's 30 s)
    and, when the fault phase ran, the pages each mode let a late write
    corrupt."""
    import matplotlib.pyplot as plt

    ran = [f for f in faults if not f.get("skipped")]
    fig, axes = plt.subplots(1, 2 if ran else 1, figsize=(12 if ran else 8, 4.5), squeeze=False)
    ax = axes[0][0]
    for mode, res in results.items():
        xs = sorted(res.latencies_ms)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        label = "kvconn (ABORT_ACK)" if mode == KVCONN else f"timeout-only ({legacy_timeout:g} s)"
        ax.step(xs, ys, where="post", label=f"{label}, n={len(xs)}")
    ax.axvline(
        legacy_timeout * 1e3, color="grey", linestyle=":", label=f"bench deadline ({legacy_timeout:g} s)"
    )
    ax.axvline(
        DEPLOYMENT_DEADLINE_S * 1e3,
        color="red",
        linestyle="--",
        label=f"deployment deadline ({DEPLOYMENT_DEADLINE_S:g} s): timeout-only frees pages here",
    )
    ax.set_xscale("log")
    ax.set_xlabel("abort -> release (ms, log)")
    ax.set_ylabel("fraction of aborted rooms")
    ax.set_title("release latency after abort")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    if ran:
        bx = axes[0][1]
        names = [f["fault"] for f in ran if f["mode"] == KVCONN]
        by = {(f["fault"], f["mode"]): f["corrupted_pages"] for f in ran}
        at = range(len(names))
        for shift, mode, label in ((-0.2, LEGACY, "timeout-only"), (0.2, KVCONN, "kvconn")):
            heights = [by.get((n, mode), 0) for n in names]
            bars = bx.bar([x + shift for x in at], heights, width=0.4, label=label)
            bx.bar_label(bars)
        bx.set_xticks(list(at), names, rotation=15, fontsize="small")
        bx.set_ylabel("pages corrupted by a late write")
        bx.set_title("production faults: pages handed back, then written")
        bx.legend(fontsize="small")
    fig.suptitle("kvconn bench")
    fig.tight_layout()
    return fig
