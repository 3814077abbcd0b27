#!/usr/bin/env bash
# GPU check: the NIXL and Mooncake plugins on VRAM, on a GPU host with no network.
#
# Run from anywhere (it cd's to the repo root), with the carried folder .whl/:
#   bash scripts/gpu/check.sh     # OUT=/tmp/out unless set; BUDGET_S=420, HARD_S=490
# Every step has its own timeout; a failed step never stops the next ones. Optional
# steps start only while BUDGET_S has room for them; no step runs past HARD_S, so
# the summary prints even under an outer limit of HARD_S + 30 s. The conformance
# suites run side by side (one process tree each, on a many-core host); benches run
# one at a time, so their figures are not shared with another job.
# $OUT gets three files: gpu-check.log (everything), summary.txt, and results.tgz
# (smoke.jsonl, the bench JSONs, one log per parallel step), refreshed after each step.
#
# .whl/ (built on a network host by scripts/gpu/prepare.sh):
#   nixl-1.5.1 (meta), nixl_cu13-1.5.1 and mooncake_transfer_engine-0.3.13.post1 (CUDA)
#   trimmed to what a UCX agent / engine.so loads (scripts/gpu/trim_wheels.py), pyzmq,
#   nvidia_cuda_runtime_cu12 (libcudart.so.12 for Mooncake's engine.so only),
#   Debian debs for libibverbs1, ibverbs-providers (libmlx5), libnl-3/-route-3, libnuma1,
#   and libcurl-stub.so.4 (scripts/gpu/curl_stub.c), used only where no libcurl.so.4 exists.
BUDGET_S=${BUDGET_S:-420}
HARD_S=${HARD_S:-490}
# shellcheck source=setup.sh
source "$(dirname "$0")/setup.sh"

# ---------------------------------------------------------------------------
# (e) smoke: one region + one writer in one process, VRAM -> VRAM, byte for byte
cat >/tmp/kvconn_smoke.py <<'EOF'
"""python kvconn_smoke.py BACKEND [KEY=VALUE ...]: open a region and a writer
(64 MiB each) in this process, post 4 rounds of segments through the writer's
hooks, check every segment byte for byte; one JSON line to stdout and OUT."""
import json, os, random, sys, time
from kvconn.chunk import Chunk, Segment
from kvconn.plugins import get_backend

MiB = 1 << 20
name, *items = sys.argv[1:]
opts = dict(i.split("=", 1) for i in items)
rec = {"backend": name, "options": opts, "ok": False}
t0 = time.perf_counter()
try:
    be = get_backend(name)
    size = 64 * MiB
    region = be.open_region(size, opts)
    writer = be.open_writer(size, opts)
    rec["open_s"] = round(time.perf_counter() - t0, 3)
    data = random.Random(7).randbytes(size)
    writer.write(0, data)
    writer.connect("peer", region.metadata)
    rng = random.Random(3)
    pages = rng.sample(range(size // 4096), 1024)
    rounds = {
        "1x4KiB": [Segment(0, 0, 4096)],
        "24x64KiB": [Segment(i * 65536, (37 * i % 61) * 262144 + 4096, 65536) for i in range(24)],
        "1x48MiB": [Segment(0, 8 * MiB, 48 * MiB)],
        "1024x4KiB-scattered": [Segment(i * 4096, p * 4096, 4096) for i, p in enumerate(pages)],
    }
    rec["rounds"] = []
    for i, (label, segs) in enumerate(rounds.items()):
        region.write(0, bytes(size))
        chunk = Chunk(i, 0, True, 0, "peer", (), ())
        t = time.perf_counter()
        posted = writer.on_post(chunk=chunk, segments=segs)
        settled = writer.on_done_barrier(chunk=chunk, posted=posted, deadline=time.monotonic() + 15)
        dt = time.perf_counter() - t
        bad = [j for j, s in enumerate(segs) if region.read(s.dst, s.nbytes) != data[s.src : s.src + s.nbytes]]
        n = sum(s.nbytes for s in segs)
        rec["rounds"].append({"round": label, "settled": getattr(settled, "value", str(settled)),
                              "bytes": n, "s": round(dt, 4), "GBps": round(n / dt / 1e9, 3), "bad_segments": len(bad)})
        if bad or getattr(settled, "value", None) != "landed":
            break
    rec["ok"] = all(r["settled"] == "landed" and r["bad_segments"] == 0 for r in rec["rounds"])
    writer.close()
    region.close()
except BaseException as exc:
    rec["error"] = f"{type(exc).__name__}: {exc}"[:600]
rec["total_s"] = round(time.perf_counter() - t0, 3)
line = json.dumps(rec)
print("SMOKE " + line)
with open(os.path.join(os.environ["RES"], "smoke.jsonl"), "a") as f:
    f.write(line + "\n")
sys.stdout.flush()
os._exit(0 if rec["ok"] else 1)  # skip UCX/engine teardown at exit
EOF
export RES
step smoke-nixl-dram 60 "$PY" /tmp/kvconn_smoke.py nixl
step smoke-nixl-vram 60 "$PY" /tmp/kvconn_smoke.py nixl memory=vram
# net_devices=lo (the default since 2026-11-30) against UCX's own choice, and cuda_ipc:
step smoke-nixl-vram-any-net 60 "$PY" /tmp/kvconn_smoke.py nixl memory=vram net_devices=
step smoke-nixl-vram-cuda-ipc 60 "$PY" /tmp/kvconn_smoke.py nixl memory=vram ucx_tls=tcp,cuda_copy,cuda_ipc
step smoke-mooncake-dram 60 "$PY" /tmp/kvconn_smoke.py mooncake
step smoke-mooncake-vram 90 "$PY" /tmp/kvconn_smoke.py mooncake memory=vram

# ---------------------------------------------------------------------------
# (e) the whole conformance suite with every region and source in VRAM, side by side
# (nixl's default UCX_TLS on a GPU host is tcp,cuda_copy: its fence is checked on DRAM).
# conf-nixl-vram-cuda-ipc: untried so far (docs/gpu.md, "Why NIXL claims no fence for
# VRAM"): with cuda_ipc the writer alone should copy same-host VRAM, so a frozen owner
# whose writer was killed mid-write has no fragment of its own to ack, and should survive.
side_by_side \
    'conf-nixl-vram 240 "${KV[@]}" conformance nixl -q -o memory=vram' \
    'conf-nixl-vram-cuda-ipc 240 "${KV[@]}" conformance nixl -q -o memory=vram -o ucx_tls=tcp,cuda_copy,cuda_ipc' \
    'conf-mooncake-vram 240 "${KV[@]}" conformance mooncake -q -o memory=vram' \
    'conf-nixl-dram 240 "${KV[@]}" conformance nixl -q'

# ---------------------------------------------------------------------------
# (f) the main job on a host with cores to spare: 10,000 requests, 30% aborts, kvconn's
# mode only (the timeout-only mode waits out its deadlines; 2-core figures: docs/bench.md)
E2E=(bench --requests 10000 --modes kvconn --no-progress)
for b in loopback nixl mooncake; do
    maybe 40 "e2e-$b" 90 "${KV[@]}" "${E2E[@]}" --backend "$b" --json "$RES/e2e-$b.json"
done

# (g) the main job with decode's pages and the ranks' sources in VRAM
for b in nixl mooncake; do
    maybe 30 "e2e-vram-$b" 60 "${KV[@]}" bench --requests 2000 --modes kvconn --no-progress \
        --backend "$b" --backend-option memory=vram --json "$RES/e2e-vram-$b.json"
done

# (h) transport bench (kvconn vs raw API), one backend per command. DRAM at the default
# 256 MiB a measurement, as on CPU hosts (every run pays a request and a status once, so
# smaller runs understate kvconn). The 1 MiB and 64 MiB shapes, whose 9-pair intervals
# on the 2026-11-30 host (runs of 128 MiB, 30-60 ms) were too wide for a verdict: 15
# pairs of 1 GiB runs (on the 2-core VM, loopback 64 MiB: [82, 100]% with 256 MiB runs,
# [93, 98]% with 1 GiB). VRAM moves ~0.5 GB/s: 128 MiB and 9 pairs.
BENCH=(bench --transport --no-progress)
for b in nixl mooncake loopback; do
    maybe 30 "bench-dram-$b-scattered" 60 "${KV[@]}" "${BENCH[@]}" --repeat 9 --shape 4096x1024:scattered \
        --backend "$b" --json "$RES/bench-dram-$b-scattered.json"
    maybe 40 "bench-dram-$b-large" 90 "${KV[@]}" "${BENCH[@]}" --repeat 15 --bytes-per-run $((1 << 30)) --shape 1048576x1 --shape 67108864x1 \
        --backend "$b" --json "$RES/bench-dram-$b-large.json"
done
for b in nixl mooncake; do
    maybe 45 "bench-vram-$b" 100 "${KV[@]}" "${BENCH[@]}" --repeat 9 --bytes-per-run $((128 << 20)) \
        --backend "$b" --backend-option memory=vram --json "$RES/bench-vram-$b.json"
done

{
    echo
    echo "================ gpu-check summary ($(elapsed)s) ================"
    cat "$STEPS"
    "$PY" scripts/gpu/summary.py "$RES"
    echo "---- conformance (PASSED lines omitted)"
    grep -E '^=== \[conf-|^(FAILED|SKIPPED) +test_|^[a-z]+: [0-9]+ passed' "$LOG" | sed 's/^=== //;s/ t=[0-9]*s timeout=.*//' | cut -c1-240 | tail -60
} | tee "$OUT/summary.txt"
pack
exit 0
