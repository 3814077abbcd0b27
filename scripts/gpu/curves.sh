#!/usr/bin/env bash
# Issue 35's curves on a many-core host, where the 2-vCPU machine measures its
# own saturation (docs/performance.md): rooms in flight, prefill ranks, the abort
# storm at the issue's size (10,000 requests, 90% aborted, 256 in flight, 8 ranks)
# beside the same run without it, scattered KV (kvconn's lowering and post against
# the raw library's, loopback, NIXL and Mooncake), tombstones, the fleet, the
# per-chunk cost, and a py-spy profile of the rooms curve at 512 in flight.
#
#   bash scripts/gpu/curves.sh        # OUT=/tmp/out unless set; BUDGET_S=480, HARD_S=560
#   SMOKE=1 bash scripts/gpu/curves.sh   # every step at a tiny size (seconds): the script itself
#
# Like check.sh it sources setup.sh, which installs kvconn-core (its entry points:
# the loopback backend), kvconn-nixl, kvconn-mooncake and the carried wheels of
# .whl/ (scripts/gpu/prepare.sh; py-spy among them) into a temporary folder; on a
# host without .whl/ it installs our three packages alone (the host's Python has
# their dependencies), and the NIXL and Mooncake points say why they did not run.
# KVCONN_PREINSTALLED=1 skips the install (a Python that has kvconn already).
# Steps run one at a time (each is a measurement); each has its own timeout, and a
# failed one never stops the next. $OUT gets curves.log and results.tgz (one JSON
# per curve, the profile).
BUDGET_S=${BUDGET_S:-480}
HARD_S=${HARD_S:-560}
LOG_NAME=curves.log
# shellcheck source=setup.sh
source "$(dirname "$0")/setup.sh"

if [ -n "${SMOKE:-}" ]; then
    R=40 STORM=40 REPEAT=2 SEGMENTS=118,300 TOMB=500,1000 FLEET=0.01,0.02 SPY=40 ROOMS=2,8 RANKS=1,2 INFLIGHT=8
else
    R=1000 STORM=${STORM_REQUESTS:-10000} REPEAT=9 SEGMENTS=118,1000,5000,20000 TOMB=10000,100000 FLEET=0.1,1,10
    SPY=600 ROOMS=8,64,256,512 RANKS=2,4,8 INFLIGHT=256
fi
B=("${KV[@]}" bench --no-progress)
NOFAULTS=(--faults off)

step rooms 150 "${B[@]}" "${NOFAULTS[@]}" --curve rooms --curve-points "$ROOMS" --requests "$R" \
    --json "$RES/rooms.json"
step ranks 150 "${B[@]}" "${NOFAULTS[@]}" --curve ranks --curve-points "$RANKS" --concurrency 64 \
    --requests "$R" --json "$RES/ranks.json"
# The storm beside the same run without aborts (0) and with the usual share (0.1).
step storm 240 "${B[@]}" "${NOFAULTS[@]}" --curve storm --curve-points 0,0.1,0.9 --ranks 8 \
    --concurrency "$INFLIGHT" --requests "$STORM" --json "$RES/storm.json"
step segments 120 "${B[@]}" --curve segments --backend loopback,nixl,mooncake --curve-points "$SEGMENTS" \
    --repeat "$REPEAT" --json "$RES/segments.json"
step tombstones 60 "${B[@]}" --curve tombstones --curve-points "$TOMB" --json "$RES/tombstones.json"
step fleet 60 "${B[@]}" --curve fleet --curve-points "$FLEET" --json "$RES/fleet.json"
step per-chunk 60 "$PY" -c '
from kvconn.bench.overhead import measure
o = measure(20000, 50)
print(f"per chunk: {o.direct_us:.1f} us direct, {o.queued_us:.1f} us via Sender.send and the worker")'

# Where the time goes at 512 rooms in flight: py-spy over the bench and its rank
# processes, then the functions most often on a CPU (their own samples).
SPY_BIN=$(command -v py-spy || true)
if [ -n "$SPY_BIN" ]; then
    maybe 90 profile-rooms-512 90 "$SPY_BIN" record --subprocesses --nonblocking --rate 100 --format raw \
        -o "$RES/rooms-512.folded" -- "${B[@]}" "${NOFAULTS[@]}" --modes kvconn --concurrency "${ROOMS##*,}" \
        --requests "$SPY" --json "$RES/rooms-512.json"
    if [ -s "$RES/rooms-512.folded" ]; then
        "$PY" - "$RES/rooms-512.folded" <<'EOF'
import collections, sys
own, where = collections.Counter(), collections.Counter()
total = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    frames = stack.split(";")
    own[frames[-1]] += int(n)
    where["prefill ranks" if "prefill_worker" in stack else "the bench (decode, its engine loop)"] += int(n)
    total += int(n)
print(f"py-spy, rooms at 512 in flight: {total} samples on a CPU: " +
      ", ".join(f"{k} {v / total:.0%}" for k, v in where.items()))
print("the 25 functions most often on a CPU (own samples):")
for frame, n in own.most_common(25):
    print(f"{n / total:6.1%}  {frame[:160]}")
EOF
    fi
else
    printf '%-34s SKIPPED (no py-spy: add it to .whl/, scripts/gpu/prepare.sh)\n' profile-rooms-512 >>"$STEPS"
fi

pack
echo
echo "=== steps"
cat "$STEPS"
grep -E "^(│|per chunk|violation|py-spy|goal|raw:|tombstones:|fleet:| +[0-9]+ x )" "$LOG" || true
