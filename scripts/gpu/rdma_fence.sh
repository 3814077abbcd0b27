#!/usr/bin/env bash
# Does the page owner's teardown stop a late RDMA write? (docs/multi-host.md, "What RDMA will change")
#
#   bash scripts/gpu/rdma_fence.sh                 # the host's RDMA NIC (first in /sys/class/infiniband)
#   bash scripts/gpu/rdma_fence.sh --rxe eth0      # soft-RoCE over eth0 first (needs the rdma_rxe module)
#   bash scripts/gpu/rdma_fence.sh --device mlx5_0 # a given device
# OUT=/tmp/out unless set; LIMIT_S=240 bounds the whole run. Python: $PY (python3) with
# kvconn_core, kvconn_nixl and kvconn_mooncake importable (scripts/gpu/setup.sh installs
# them from .whl/; KVCONN_PREINSTALLED=1 where $PY already has them). The carried nixl wheel
# must keep UCX's verbs module (prepare.sh keeps ucx/libuct_ib).
#
# Per backend (nixl with UCX rc/ud, mooncake with protocol=rdma), owner and writer in two
# processes, the owner's buffer kept allocated throughout:
#   baseline       a 1 MiB write lands;
#   deregister     the owner deregisters its memory, the writer writes with the old keys;
#   destroy        the owner destroys its agent / engine, the writer writes again;
#   frozen_fence   a 64 MiB write frozen 5 ms in, the owner's teardown, the writer resumed.
# Each prints a verdict (fenced / NOT FENCED / no verdict) and a JSON record; all go to
# $OUT/rdma_fence.json and $OUT/rdma_fence.log. The same run over tcp ("--transport tcp",
# passed through) is the comparison and works on any host.
# Exit codes: 0 measured (whatever the verdicts), 3 no RDMA device here, 2 bad usage.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT=${OUT:-/tmp/out}
LIMIT_S=${LIMIT_S:-240}
PY=${PY:-python3}
mkdir -p "$OUT"
RXE=""
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
    --rxe)
        [ $# -ge 2 ] || { echo "rdma_fence.sh: --rxe needs an interface" >&2; exit 2; }
        RXE=$2
        shift 2
        ;;
    *)
        ARGS+=("$1")
        shift
        ;;
    esac
done

have_rdma() { [ -d /sys/class/infiniband ] && [ -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; }
tcp_only() { [[ " ${ARGS[*]-} " == *" --transport tcp "* ]]; }

if [ -n "$RXE" ] && ! have_rdma; then
    if ! modprobe rdma_rxe 2>/dev/null; then
        echo "rdma_fence.sh: cannot load the soft-RoCE module (modprobe rdma_rxe failed: no module or no privilege)" >&2
    elif ! rdma link add "rxe_$RXE" type rxe netdev "$RXE"; then
        echo "rdma_fence.sh: rdma link add rxe_$RXE type rxe netdev $RXE failed" >&2
    fi
fi
if ! tcp_only && ! have_rdma; then
    echo "rdma_fence.sh: no RDMA device here (/sys/class/infiniband is empty or missing): nothing measured." >&2
    echo "  On a host with an RDMA NIC load its driver; for soft-RoCE: bash scripts/gpu/rdma_fence.sh --rxe IFACE" >&2
    exit 3
fi
if ! "$PY" -c 'import kvconn, kvconn_nixl, kvconn_mooncake' 2>/dev/null; then
    echo "rdma_fence.sh: $PY cannot import kvconn, kvconn_nixl and kvconn_mooncake (scripts/gpu/setup.sh installs them)" >&2
    exit 2
fi
timeout -k 10 "$LIMIT_S" "$PY" scripts/gpu/rdma_fence.py --json "$OUT/rdma_fence.json" "${ARGS[@]}" 2>&1 |
    tee "$OUT/rdma_fence.log"
exit "${PIPESTATUS[0]}"
