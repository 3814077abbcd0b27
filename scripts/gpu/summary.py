"""python summary.py RESULTS_DIR: what the GPU scripts' result files say, a
line per measurement (check.sh and focus.sh print it at the end).

* ``smoke.jsonl``: in-process writes, GB/s per round, segments with wrong bytes;
* every ``kvconn bench`` JSON (the file's name labels it): the main job's
  release latency, its target and each rank's ack wait, or the transport
  bench's kvconn / raw ratio with the pairs' interval and verdict.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def smoke(path: Path) -> None:
    print("---- smoke (GB/s per round; bad = segments with wrong bytes)")
    for line in path.read_text().splitlines():
        r = json.loads(line)
        opts = ",".join(f"{k}={v}" for k, v in r["options"].items()) or "defaults"
        rounds = " ".join(
            f"{x['round']}={x['GBps']}"
            + ("" if x["settled"] == "landed" else "/" + x["settled"])
            + (f"/bad{x['bad_segments']}" if x["bad_segments"] else "")
            for x in r.get("rounds", [])
        )
        error = ("ERROR " + r["error"][:300]) if "error" in r else ""
        print(f"{'OK ' if r['ok'] else 'BAD'} {r['backend']:8} {opts:46}", rounds, error)


def main_job(name: str, d: dict[str, Any]) -> None:
    m, w = d["modes"]["kvconn"], d["workload"]
    lat = m["release_latency_ms"]
    fast = {x["target"]: x for x in d["targets"]}.get("fast release p99", {})
    print(
        f"{name:24} ok={d['ok']} reqs={m['requests']} in flight={w['concurrency']}"
        f" done/aborted/failed={m['completed']}/{m['aborted_mid_transfer']}/{m['prefill_failed']}"
        f" release p50/p99/max={lat.get('p50', 0):.2f}/{lat.get('p99', 0):.2f}/{lat.get('max', 0):.2f} ms"
        f" goal {fast.get('goal')} -> {fast.get('ok')} busy={m['cpu'].get('busy', 0):.0f}%"
        f" {m['throughput_gbps']:.3f} GB/s overhead={d['overhead'].get('direct_us', 0):.1f} us"
        f" releases={m['releases_by_proof']} violations={len(m['violations'])}"
    )
    for rank, a in sorted(m.get("ack_wait_ms_by_rank", {}).items()):
        print(
            f"{'':24} rank {rank}: {a['n']:.0f} acks, p50 <= {a['p50_at_most']:g} ms, p99 <= {a['p99_at_most']:g} ms"
        )


def transport(name: str, d: dict[str, Any]) -> None:
    for rep in d["transport"]:
        for s in rep["shapes"]:
            lo, hi = s["ratio_interval"]
            print(
                f"{name:24} {s['shape']:22} kvconn {s['kvconn_gbps']:7.3f}  raw {s['raw_gbps']:7.3f}"
                f"  {s['ratio']:6.1%}  pairs({s['repeats']:2}) {s['ratio_pairwise_median']:6.1%}"
                f" [{lo:6.1%}, {hi:6.1%}] {s['verdict']:8} bad_pages={s['verify_bad_pages']}"
            )


def main() -> None:
    res = Path(sys.argv[1])
    if (res / "smoke.jsonl").exists():
        smoke(res / "smoke.jsonl")
    print("---- kvconn bench: main job (kvconn mode) and --transport (kvconn / raw)")
    for path in sorted(res.glob("*.json")):
        try:
            d = json.loads(path.read_text())
            (transport if "transport" in d else main_job)(path.stem, d)
        except Exception as exc:  # one unreadable file must not hide the others
            print(f"{path.stem:24} unreadable: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
