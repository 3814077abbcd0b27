#!/usr/bin/env bash
# docs/sglang.md's two-server recipe on one GPU host, run by the same test
# that runs it on CPU (tests/sglang/test_sglang_servers.py): a prefill and a
# decode `python -m sglang.launch_server` with --disaggregation-transfer-backend
# kvconn and SGLang's router, on a random-weight Llama made by the test;
# greedy tokens against one plain server, kvconn's figures on SGLang's
# /metrics, an abort with the prefill frozen (pages held past SGLang's
# deadline until kvconn's proof), a SIGKILLed prefill (pages back by its
# exit), over nixl and mooncake (loopback writes host memory only).
#
# NOT RUN YET: written on a CPU-only machine; no GPU host with SGLang was lent.
# The host needs sglang (CUDA build, with sgl_kernel) installed; this script
# installs kvconn's packages (editable, no dependencies), SGLang's router
# and the nixl wheels next to it.
#   bash scripts/gpu/sglang_pd.sh      # OUT=/tmp/out; PY=python3
# $OUT gets pytest.log (with the figures the test prints) and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
mkdir -p "$OUT"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

if ! "$PY" -c "import sglang, sgl_kernel" 2>/dev/null; then
    summary "SKIP: sglang with its CUDA kernels is not installed for $PY"
    exit 2
fi
PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --no-deps -e ./kvconn_core -e ./kvconn_sglang -e ./kvconn_nixl -e ./kvconn_mooncake
"$PY" -c "import sglang_router" 2>/dev/null || "${PIP[@]}" "sglang-router==0.3.2"
"$PY" -c "import nixl" 2>/dev/null || "${PIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
"$PY" -c "import mooncake.engine" 2>/dev/null || "${PIP[@]}" "mooncake-transfer-engine==0.3.13.post1"
"${PIP[@]}" pytest pytest-timeout psutil attrs
"$PY" -c "from sglang.srt.plugins import load_plugins; load_plugins()
from sglang.srt.disaggregation.utils import TransferBackend; TransferBackend('kvconn')" ||
    { summary "FAIL: the kvconn plugin did not register with SGLang"; exit 1; }

GPUS=$(nvidia-smi -L | wc -l)
# Prefill on GPU 0; decode on GPU 1 where there is one (else both share GPU 0).
export KVCONN_SGLANG_TEST_DEVICE=cuda KVCONN_SGLANG_TEST_DECODE_GPU=$(( GPUS > 1 ? 1 : 0 ))
"$PY" -m pytest tests/sglang/test_sglang_servers.py -m slow -s -v -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
RC=${PIPESTATUS[0]}
summary "tests/sglang/test_sglang_servers.py on $GPUS GPU(s): rc=$RC"
summary "$(grep -E 'passed|failed|skipped' "$OUT/pytest.log" | tail -1)"
exit "$RC"
