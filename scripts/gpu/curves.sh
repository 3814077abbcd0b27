#!/usr/bin/env bash
# Issue 35's curves on a many-core host (loopback: no GPU library needed), where
# the 2-vCPU machine measures its own saturation: rooms in flight, prefill ranks,
# an abort storm, and the per-chunk cost. Each step has its own timeout; one that
# fails never stops the next. Figures go to $OUT (default /tmp/out): curves.log,
# and one JSON per curve.
#   bash scripts/gpu/curves.sh            # about 6-8 minutes on 16 cores
#   REQUESTS=10000 bash scripts/gpu/curves.sh   # the storm at the issue's size
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
REQUESTS=${REQUESTS:-3000}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -z "${PYTHONPATH:-}" ]; then
  export PYTHONPATH=$PWD/kvconn_core/src
fi
LOG=$OUT/curves.log
: >"$LOG"
step() {  # step NAME TIMEOUT ARGS...
  local name=$1 limit=$2
  shift 2
  echo "== $name: kvconn bench $*" | tee -a "$LOG"
  timeout "$limit" "$PY" -m kvconn.cli bench --no-progress --faults off --json "$OUT/$name.json" "$@" \
    >>"$LOG" 2>&1 || echo "== $name: exit $?" | tee -a "$LOG"
}
step rooms 240 --curve rooms --curve-points 8,64,256,512 --requests 2000
step ranks 240 --curve ranks --curve-points 2,4,8 --concurrency 64 --requests 2000
step storm 420 --curve storm --curve-points 0.1,0.9 --ranks 8 --concurrency 256 --requests "$REQUESTS"
"$PY" - <<'PY' | tee -a "$LOG"
from kvconn.bench.overhead import measure
o = measure(20000, 50)
print(f"per chunk: {o.direct_us:.1f} us direct, {o.queued_us:.1f} us via Sender.send and the worker")
PY
grep -E "^(│|==|per chunk)" "$LOG" || true
