#!/usr/bin/env bash
# GPU check: the NIXL and Mooncake plugins on VRAM, on a GPU host with no network.
#
# Run from anywhere (it cd's to the repo root), with the carried folder .whl/:
#   bash scripts/gpu/check.sh     # OUT=/tmp/out unless set; BUDGET_S=330, HARD_S=450
# Every step has its own timeout; a failed step never stops the next ones. Optional
# steps start only while BUDGET_S has room for them; no step runs past HARD_S, so
# the summary prints even under an outer limit of HARD_S + 30 s.
# Full log: $OUT/gpu-check.log; JSON: $OUT/smoke.jsonl, $OUT/bench-{vram,dram}-{nixl,mooncake}.json;
# compact summary at the end (and in $OUT/summary.txt).
#
# .whl/ (built on a network host by scripts/gpu/prepare.sh):
#   nixl-1.5.1 (meta), nixl_cu13-1.5.1 and mooncake_transfer_engine-0.3.13.post1 (CUDA)
#   trimmed to what a UCX agent / engine.so loads (scripts/gpu/trim_wheels.py), pyzmq,
#   nvidia_cuda_runtime_cu12 (libcudart.so.12 for Mooncake's engine.so only),
#   Debian debs for libibverbs1, ibverbs-providers (libmlx5), libnl-3/-route-3, libnuma1,
#   and libcurl-stub.so.4 (scripts/gpu/curl_stub.c), used only where no libcurl.so.4 exists.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/gpu-check.log
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-160}
PY=${PY:-python3}
SITE=${SITE:-/tmp/kvconn-site}
LIBS=/tmp/kvconn-libs
WHL=$ROOT/.whl
BUDGET_S=${BUDGET_S:-330}
HARD_S=${HARD_S:-450}
START=$(date +%s)
SUMMARY=()

elapsed() { echo $(($(date +%s) - START)); }
# have_lib SONAME: the host's loader cache knows SONAME.
have_lib() { ldconfig -p | awk '{print $1}' | grep -qxF "$1"; }

# step NAME TIMEOUT_S CMD...: run CMD under timeout, record rc and seconds.
step() {
    local name=$1 limit=$2 rc t0 ms left
    shift 2
    left=$((HARD_S - $(elapsed) - 20))
    if [ "$left" -lt 10 ]; then
        SUMMARY+=("$(printf '%-34s SKIPPED (HARD_S=%ss reached)' "$name" "$HARD_S")")
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo
    echo "=== [$name] t=$(elapsed)s timeout=${limit}s: $*"
    t0=$(date +%s%N)
    timeout -k 10 "$limit" "$@"
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    SUMMARY+=("$(printf '%-34s rc=%-4s %4d.%01ds' "$name" "$rc" $((ms / 1000)) $((ms % 1000 / 100)))")
    [ "$rc" = 124 ] && echo "!!! [$name] timed out after ${limit}s"
    return 0
}

# Optional step: skipped when fewer than NEED_S seconds of BUDGET_S are left.
maybe() {
    local need=$1
    shift
    if [ $(($(elapsed) + need)) -gt "$BUDGET_S" ]; then
        SUMMARY+=("$(printf '%-34s SKIPPED (budget: %ss used of %ss)' "$1" "$(elapsed)" "$BUDGET_S")")
        return 0
    fi
    step "$@"
}

KV=("$PY" -m kvconn.cli)
export PY WHL SITE LIBS

# ---------------------------------------------------------------------------
# (a) the machine
info() {
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PY" -V
    command -v "$PY"
    nproc
    "$PY" - <<'EOF'
import importlib
for mod in ("torch", "cupy", "numpy", "zmq", "nixl", "mooncake"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:9} {getattr(m, '__version__', '?')} {getattr(m, '__file__', '')}")
    except Exception as exc:
        print(f"{mod:9} -- {type(exc).__name__}: {exc}")
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available())
import cupy
print("cupy runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
EOF
    ldconfig -p | grep -E 'libibverbs\.so\.1|libmlx5\.so\.1|libnl-(route-)?3\.so|libnuma\.so\.1|libcurl\.so\.4|libcudart\.so\.1[23]|libcuda\.so\.1|libnvidia-ml\.so\.1' || true
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    ls "$WHL"
    return 0
}
export -f info
step info 60 bash -c info

# ---------------------------------------------------------------------------
# (b)+(c) Python packages: the carried wheels and our three packages, into $SITE
rm -rf "$SITE" /tmp/kvconn-cu12
mapfile -t WHEELS < <(ls "$WHL"/*.whl | grep -v '/nvidia_')
step pip-install 240 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --no-build-isolation --disable-pip-version-check --upgrade --target "$SITE" \
    "${WHEELS[@]}" ./kvconn_core ./kvconn_nixl ./kvconn_mooncake
# libcudart.so.12 for Mooncake: unpacked aside, never on sys.path (its nvidia/ would shadow torch's).
step cudart12-unpack 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target /tmp/kvconn-cu12 "$WHL"/nvidia_cuda_runtime_cu12-*.whl
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH

# System libraries that Mooncake's engine.so needs, only where the host lacks them.
syslibs() {
    rm -rf "$LIBS" /tmp/kvconn-debs
    mkdir -p "$LIBS" /tmp/kvconn-debs
    local deb f base
    for deb in "$WHL"/*.deb; do
        if command -v dpkg >/dev/null; then
            dpkg -x "$deb" /tmp/kvconn-debs
        else
            (cd /tmp/kvconn-debs && ar p "$deb" "$(ar t "$deb" | grep '^data.tar')" | tar -x -J 2>/dev/null ||
                ar p "$deb" "$(ar t "$deb" | grep '^data.tar')" | tar -x --zstd)
        fi
    done
    for f in /tmp/kvconn-debs/usr/lib/x86_64-linux-gnu/lib*.so.[0-9]* /tmp/kvconn-debs/lib/x86_64-linux-gnu/lib*.so.[0-9]*; do
        [ -e "$f" ] || continue
        base=$(basename "$f")
        [[ $base =~ ^lib.*\.so\.[0-9]+$ ]] || continue # soname links only
        if have_lib "$base"; then
            echo "host has $base"
        else
            ln -sf "$f" "$LIBS/$base" && echo "carried  $base"
        fi
    done
    if ! have_lib libcurl.so.4; then
        cp "$WHL/libcurl-stub.so.4" "$LIBS/libcurl.so.4" && echo "stub     libcurl.so.4 (no HTTP metadata; P2PHANDSHAKE only)"
    fi
    if ! have_lib libcudart.so.12; then
        f=$(find /tmp/kvconn-cu12 -name 'libcudart.so.12' | head -1)
        [ -n "$f" ] && ln -sf "$f" "$LIBS/libcudart.so.12" && echo "carried  libcudart.so.12 ($f)"
    fi
    return 0
}
export -f syslibs have_lib
step syslibs 60 bash -c syslibs
# libcudart.so.13 for UCX's cuda memory hooks (ucm_cuda): the host's own, wherever pip put it.
CUDART13=""
if ! have_lib libcudart.so.13; then
    CUDART13=$("$PY" - <<'EOF'
import glob, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
for root in roots:
    for pat in ("nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.13", "libcudart.so.13"):
        hits = glob.glob(f"{root}/{pat}")
        if hits:
            print(hits[0].rsplit("/", 1)[0]); sys.exit()
EOF
)
fi
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}${CUDART13:+:$CUDART13}
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# ---------------------------------------------------------------------------
# (d) what loads
libcheck() {
    local f
    for f in "$SITE"/mooncake/engine.so "$SITE"/nixl_cu13.libs/ucx/libuct_cuda.so.* \
        "$SITE"/nixl_cu13.libs/ucx/libucm_cuda.so.* "$SITE"/.nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so; do
        echo "-- $f"
        ldd "$f" | grep -E 'not found|cudart|libcuda\.|ibverbs|curl|numa|mlx5' || true
    done
    "$PY" -c 'import mooncake.engine as e; print("mooncake.engine", e.__file__)'
    "$PY" -c 'import nixl._api as a, nixl_cu13; print("nixl", a.__name__, nixl_cu13.__file__)'
    "$PY" -c 'import zmq; print("pyzmq", zmq.__version__)'
}
export -f libcheck
step libcheck 90 bash -c libcheck
step kvconn-backends 90 "${KV[@]}" backends

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
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "smoke.jsonl"), "a") as f:
    f.write(line + "\n")
sys.stdout.flush()
os._exit(0 if rec["ok"] else 1)  # skip UCX/engine teardown at exit
EOF
rm -f "$OUT/smoke.jsonl"
export OUT
step smoke-nixl-dram 60 "$PY" /tmp/kvconn_smoke.py nixl
step smoke-nixl-vram 60 "$PY" /tmp/kvconn_smoke.py nixl memory=vram
step smoke-mooncake-dram 60 "$PY" /tmp/kvconn_smoke.py mooncake
step smoke-mooncake-vram 90 "$PY" /tmp/kvconn_smoke.py mooncake memory=vram

# ---------------------------------------------------------------------------
# (e) the whole conformance suite with every region and source in VRAM (nixl's
# default UCX_TLS on a GPU host is tcp,cuda_copy: its fence is checked here too)
step conf-nixl-all-vram 200 "${KV[@]}" conformance nixl -q -o memory=vram
step conf-mooncake-all-vram 200 "${KV[@]}" conformance mooncake -q -o memory=vram
# (e2) untried so far (docs/gpu.md, "Why NIXL claims no fence for VRAM"): with cuda_ipc,
# same-host VRAM should be copied by the writer alone, so a frozen owner whose writer
# was killed mid-write has no fragment of its own to ack, and should survive.
maybe 60 conf-nixl-vram-cuda-ipc 200 "${KV[@]}" conformance nixl -q -o memory=vram \
    -o ucx_tls=tcp,cuda_copy,cuda_ipc

# ---------------------------------------------------------------------------
# (f) transport bench (kvconn vs raw API), one backend per command
BENCH=(bench --transport --repeat 3 --bytes-per-run $((128 << 20)) --no-progress)
maybe 40 bench-vram-mooncake 100 "${KV[@]}" "${BENCH[@]}" --backend mooncake --backend-option memory=vram \
    --json "$OUT/bench-vram-mooncake.json"
maybe 40 bench-dram-mooncake 100 "${KV[@]}" "${BENCH[@]}" --backend mooncake --json "$OUT/bench-dram-mooncake.json"
maybe 40 bench-vram-nixl 100 "${KV[@]}" "${BENCH[@]}" --backend nixl --backend-option memory=vram \
    --json "$OUT/bench-vram-nixl.json"
maybe 40 bench-dram-nixl 100 "${KV[@]}" "${BENCH[@]}" --backend nixl --json "$OUT/bench-dram-nixl.json"

# ---------------------------------------------------------------------------
{
    echo
    echo "================ gpu-check summary ($(elapsed)s) ================"
    printf '%s\n' "${SUMMARY[@]}"
    echo "---- smoke (GB/s per round; bad = segments with wrong bytes)"
    "$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
path = os.path.join(out, "smoke.jsonl")
for line in open(path) if os.path.exists(path) else []:
    r = json.loads(line)
    opts = ",".join(f"{k}={v}" for k, v in r["options"].items()) or "defaults"
    head = f"{'OK ' if r['ok'] else 'BAD'} {r['backend']:8} {opts:38}"
    if "error" in r and not r.get("rounds"):
        print(head, "ERROR", r["error"][:300])
        continue
    rounds = " ".join(f"{x['round']}={x['GBps']}{'' if x['settled'] == 'landed' else '/' + x['settled']}"
                      f"{'' if not x['bad_segments'] else '/bad' + str(x['bad_segments'])}" for x in r.get("rounds", []))
    print(head, rounds, ("ERROR " + r["error"][:200]) if "error" in r else "")
print("---- bench --transport (median GB/s kvconn / raw, ratio, verified)")
for mem, name in [(m, b) for m in ("vram", "dram") for b in ("nixl", "mooncake")]:
    path = os.path.join(out, f"bench-{mem}-{name}.json")
    if not os.path.exists(path):
        print(mem, name, "no JSON")
        continue
    for rep in json.load(open(path))["transport"]:
        for s in rep["shapes"]:
            print(f"{mem} {rep['backend']:8} {s['shape']:22} kvconn {s['kvconn_gbps']:7.3f}  raw {s['raw_gbps']:7.3f}"
                  f"  {s['ratio']:6.1%}  bad_pages={s['verify_bad_pages']}")
EOF
    echo "---- conformance (PASSED lines omitted)"
    grep -E '^=== \[conf-|^(FAILED|SKIPPED) +test_|^[a-z]+: [0-9]+ passed' "$LOG" | sed 's/^=== //;s/ t=[0-9]*s timeout=.*//' | cut -c1-240 | tail -60
} | tee "$OUT/summary.txt"
exit 0
