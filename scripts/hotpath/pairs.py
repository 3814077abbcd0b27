"""Two kvconn trees, the same `kvconn bench` workload, run in pairs
interleaved (A B, B A, A B, ...), so that the machine's load falls on both
alike. For a shared machine: it counts CPU seconds, context switches and
page faults, and states the load average with every run.

    python3 scripts/hotpath/pairs.py --tree OLD_TREE --tree NEW_TREE [--pairs 8] [--hops] [-- BENCH ARGS]

Each tree is a checkout with a venv of its own (TREE/.venv/bin/kvconn, as
GUIDE.md sets one up); the default bench arguments are issue 42's 8-room
workload. scripts/hotpath/sitecustomize.py, loaded into every process of a
run, measures the workload phase (``ModeRun.run``) of kvconn's mode:

* ``release p50`` / ``p99``: the bench's own abort-to-release figures;
* ``CPU us/req``: the CPU of decode's process (the bench's: decode's
  threads and the stand-in engine) and of every rank process (their
  threads, the stand-in engine's page filling and the transport's copy),
  over the workload phase, per request of it;
* ``csw/req``, ``faults/req``: context switches and minor page faults, the same way;
* with ``--hops``, each abort's path, medians in ms: decode's ``abort()`` to
  its ABORT sent, that to a rank's listener taking it, the rank to its
  ABORT_ACK (sent by the listener itself: nothing was in flight; by a
  worker: once the chunk in flight settled), the ack to decode's listener,
  and the last ack to the release.

Per pair it prints both runs; then each figure's median per tree, B over
A, and in how many pairs B was lower. ``--together`` runs a pair's two
benches at once instead (the load of the moment falls on both alike; each
is also the other's load). Exit code 0 (it judges nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT = [
    "--faults", "off", "--modes", "kvconn", "--requests", "400", "--abort-window-ms", "50",
    "--stream-requests", "32", "--overhead-chunks", "200", "--no-progress",
]  # fmt: skip


def _q(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def run(tree: Path, bench: list[str], hops: bool) -> dict[str, float]:
    return run_together([tree], bench, hops)[0]


def run_together(trees: list[Path], bench: list[str], hops: bool) -> list[dict[str, float]]:
    """One bench run per tree, all at once (one tree: a run alone)."""
    with tempfile.TemporaryDirectory() as top:
        load = os.getloadavg()[0]
        runs = []
        for i, tree in enumerate(trees):
            folder = Path(top) / str(i)
            folder.mkdir()
            env = dict(os.environ, KVCONN_HOTPATH_DIR=str(folder), PYTHONPATH=str(HERE))
            if hops:
                env["KVCONN_HOTPATH_HOPS"] = "1"
            out = folder / "bench.json"
            cmd = [str(tree / ".venv/bin/kvconn"), "bench", *bench, "--json", str(out)]
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            runs.append((tree, folder, out, proc))
        figures = []
        for tree, folder, out, proc in runs:
            _, err = proc.communicate()
            if not out.exists():
                raise SystemExit(f"{tree}: kvconn bench exited {proc.returncode}: {err[-2000:]}")
            report = json.loads(out.read_text())
            procs = [json.loads(p.read_text()) for p in folder.glob("[0-9]*.json")]
            f = analyse(report, procs)
            f["load (1 min)"] = load
            figures.append(f)
    return figures


def _window(samples: list[list[float]], t0: float, t1: float) -> list[float]:
    """(cpu, vcsw, ivcsw, minflt) of a process between t0 and t1, from its
    periodic samples (the nearest ones: about 50 ms at either end)."""

    def at(t: float) -> list[float]:
        best = min(samples, key=lambda s: abs(s[0] - t))
        return best[1:]

    a, b = at(t0), at(t1)
    return [y - x for x, y in zip(a, b, strict=True)]


def analyse(report: dict[str, Any], procs: list[dict[str, Any]]) -> dict[str, float]:
    mode = report["modes"]["kvconn"]
    bench = [p for p in procs if p["runs"]]
    if not bench:
        raise SystemExit("no ModeRun.run measured: is scripts/hotpath on PYTHONPATH?")
    run = bench[0]["runs"][-1]
    n = mode["requests"]
    others = [p for p in procs if not p["runs"] and len(p["samples"]) > 2]
    ranks = [p for p in others if p["samples"][0][0] < run["t0"] and p["samples"][-1][0] > run["t1"]]
    f: dict[str, float] = {
        "release p50 ms": mode["release_latency_ms"]["p50"],
        "release p99 ms": mode["release_latency_ms"]["p99"],
        "aborted mid-transfer": mode["aborted_mid_transfer"],
        "decode CPU us/req": run["cpu_s"] / n * 1e6,
        "decode csw/req": (run["vcsw"] + run["ivcsw"]) / n,
        "decode faults/req": run["minflt"] / n,
    }
    rank_cpu = [_window(p["samples"], run["t0"], run["t1"]) for p in ranks]
    f["ranks CPU us/req"] = sum(r[0] for r in rank_cpu) / n * 1e6
    f["ranks csw/req"] = sum(r[1] + r[2] for r in rank_cpu) / n
    f["ranks faults/req"] = sum(r[3] for r in rank_cpu) / n
    f["all CPU us/req"] = f["decode CPU us/req"] + f["ranks CPU us/req"]
    f.update(_hops(procs))
    return f


def _hops(procs: list[dict[str, Any]]) -> dict[str, float]:
    hops: dict[str, list[float]] = defaultdict(list)
    out_at: dict[tuple[int, int], float] = {}
    ack_in: dict[tuple[int, int], list[float]] = defaultdict(list)
    call_at: dict[int, float] = {}
    release: dict[int, float] = {}
    for p in procs:
        for t, kind, room, gen, _ in p["events"]:
            if kind == "abort_out":
                out_at.setdefault((room, gen), t)
            elif kind == "ack_in":
                ack_in[(room, gen)].append(t)
            elif kind == "abort_call":
                call_at[room] = t
            elif kind == "release":
                release[room] = t
    for room, t in call_at.items():
        sent = [at for (r, _), at in out_at.items() if r == room and at >= t]
        if sent:
            hops["hop: abort() -> ABORT sent ms"].append(min(sent) - t)
    for p in procs:
        seen: dict[tuple[int, int], dict[str, tuple[float, str]]] = defaultdict(dict)
        for t, kind, room, gen, extra in p["events"]:
            if kind in ("abort_in", "abort_done", "ack_out"):
                seen[(room, gen)].setdefault(kind, (t, extra))
        for key, e in seen.items():
            if key not in out_at or "abort_in" not in e:
                continue
            t_in = e["abort_in"][0]
            hops["hop: ABORT sent -> rank's listener ms"].append(t_in - out_at[key])
            if "ack_out" in e:
                t_out = e["ack_out"][0]
                by_listener = "abort_done" in e and t_out <= e["abort_done"][0]
                who = "listener" if by_listener else "worker, after the chunk in flight"
                hops[f"hop: rank, ABORT in -> ACK out ({who}) ms"].append(t_out - t_in)
                later = [t for t in ack_in.get(key, []) if t >= t_out]
                if later:
                    hops["hop: ACK sent -> decode's listener ms"].append(min(later) - t_out)
    last_ack: dict[int, float] = {}
    for (room, _), ts in ack_in.items():
        last_ack[room] = max([last_ack.get(room, 0.0), *ts])
    for room, t in release.items():
        if room in last_ack and t >= last_ack[room]:
            hops["hop: last ACK in -> release ms"].append(t - last_ack[room])
    return {k: _q(v, 0.5) * 1e3 for k, v in hops.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tree", action="append", required=True, type=Path, help="a checkout with its own .venv (twice)"
    )
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument(
        "--hops", action="store_true", help="trace each abort's hops (costs a little CPU in both)"
    )
    ap.add_argument(
        "--together",
        action="store_true",
        help="run each pair's two benches at the same time (the machine's load falls on both at "
        "once; each also loads the other), not one after the other",
    )
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    ap.add_argument("bench", nargs="*", default=DEFAULT, help="kvconn bench arguments (after --)")
    a = ap.parse_args()
    if len(a.tree) != 2:
        ap.error("give --tree twice: A (the reference) and B")
    names = [f"A {a.tree[0].name}", f"B {a.tree[1].name}"]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for i in range(a.pairs):
        order = [0, 1] if i % 2 == 0 else [1, 0]
        if a.together:
            done = dict(zip(order, run_together([a.tree[j] for j in order], a.bench, a.hops), strict=True))
        for j in order:
            f = done[j] if a.together else run(a.tree[j], a.bench, a.hops)
            runs[names[j]].append(f)
            print(
                f"pair {i + 1} {names[j]:>20s}: load {f['load (1 min)']:5.1f}  release p50 "
                f"{f['release p50 ms']:6.2f} p99 {f['release p99 ms']:7.2f} ms  CPU/req decode "
                f"{f['decode CPU us/req']:6.0f} ranks {f['ranks CPU us/req']:6.0f} us  "
                f"csw/req {f['decode csw/req'] + f['ranks csw/req']:5.1f}",
                flush=True,
            )
    keys = sorted({k for fs in runs.values() for f in fs for k in f})
    print(
        f"\n{'median over ' + str(a.pairs) + ' pairs':44s}{names[0]:>18s}{names[1]:>18s}{'B / A':>8s}  B lower"
    )
    for k in keys:
        a_vals = [f.get(k, float("nan")) for f in runs[names[0]]]
        b_vals = [f.get(k, float("nan")) for f in runs[names[1]]]
        ma, mb = statistics.median(a_vals), statistics.median(b_vals)
        lower = sum(1 for x, y in zip(a_vals, b_vals, strict=True) if y < x)
        ratio = mb / ma if ma else float("nan")
        print(f"{k:44s}{ma:18.3f}{mb:18.3f}{ratio:8.2f}  {lower}/{a.pairs}")
    if a.json is not None:
        a.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    sys.exit(main())
