#!/usr/bin/env bash
# The questions the 2026-11-30 H200 run left open (docs/gpu.md), in about 3 minutes:
#   bash scripts/gpu/focus.sh     # OUT=/tmp/out unless set; BUDGET_S=220, HARD_S=250
# 1. Does a frozen VRAM page owner survive its writer's death with cuda_ipc, run after
#    run (once there: 1 of 1), where the default tcp,cuda_copy aborts it (2 of 2)?
# 2. Does cuda_ipc carry the bytes (GB/s far above the ~0.5 of tcp staging)?
# 3. Why does the main job's release p99 on VRAM miss its target (nixl 17.7 ms,
#    mooncake 82 ms, against ~7 ms) when DRAM meets it with 2 ms? One request in flight
#    against eight tells queueing behind other rooms' chunks from a slow chunk.
# 4. Where kvconn's time goes with 1 MiB chunks on DRAM, the shape where it fell short
#    of raw (Mooncake 82%, loopback 79% of raw's bytes/s): --profile splits each chunk
#    into transport, gaps inside and between rooms, request and status.
# Needs .whl/ as check.sh does; writes $OUT/focus.log and $OUT/results.tgz.
BUDGET_S=${BUDGET_S:-220}
HARD_S=${HARD_S:-250}
LOG_NAME=focus.log
# shellcheck source=setup.sh
source "$(dirname "$0")/setup.sh"

IPC=(-o memory=vram -o ucx_tls=tcp,cuda_copy,cuda_ipc)
for i in 1 2 3; do
    side_by_side \
        "killed-default-$i 60 \"\${KV[@]}\" conformance nixl -q -o memory=vram -k frozen_owner_killed" \
        "killed-ipc-$i 60 \"\${KV[@]}\" conformance nixl -q \"\${IPC[@]}\" -k frozen_owner_killed"
done
step bench-vram-nixl-ipc 60 "${KV[@]}" bench --transport --repeat 3 --bytes-per-run $((128 << 20)) --no-progress \
    --backend nixl --backend-option memory=vram --backend-option ucx_tls=tcp,cuda_copy,cuda_ipc \
    --shape 1048576x1 --shape 67108864x1 --json "$RES/bench-vram-nixl-ipc.json"
step e2e-vram-nixl-ipc 45 "${KV[@]}" bench --requests 1000 --modes kvconn --no-progress --backend nixl \
    --backend-option memory=vram --backend-option ucx_tls=tcp,cuda_copy,cuda_ipc --json "$RES/e2e-vram-nixl-ipc.json"
for b in mooncake nixl; do
    for c in 1 8; do
        maybe 20 "e2e-vram-$b-c$c" 45 "${KV[@]}" bench --requests 1000 --modes kvconn --no-progress --concurrency "$c" \
            --backend "$b" --backend-option memory=vram --json "$RES/e2e-vram-$b-c$c.json"
    done
done

for b in mooncake loopback; do
    maybe 20 "profile-1mib-$b" 40 "${KV[@]}" bench --transport --repeat 5 --bytes-per-run $((128 << 20)) --no-progress \
        --profile --shape 1048576x1 --backend "$b" --json "$RES/profile-1mib-$b.json"
done

{
    echo
    echo "================ focus summary ($(elapsed)s) ================"
    cat "$STEPS"
    grep -E '^=== \[killed-|^(FAILED|PASSED) +test_frozen|^nixl: [0-9]+ passed' "$LOG" | sed 's/ t=[0-9]*s timeout=.*//'
    "$PY" scripts/gpu/summary.py "$RES"
} | tee "$OUT/summary.txt"
pack
exit 0
