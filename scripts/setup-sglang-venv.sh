#!/usr/bin/env bash
# A separate venv for the SGLang adapter's tests (tests/sglang): SGLang pins a
# CUDA torch and CUDA-only kernels, so it never goes into .venv. Here: a CPU
# torch, sglang itself without its dependencies, and only the pure-Python
# packages its disaggregation modules import. GPU-only modules (triton,
# tvm_ffi, torchvision, sgl_kernel) are stood in for by the test harness.
# Usage: bash scripts/setup-sglang-venv.sh [VENV_DIR]   (default .venv-sglang)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-sglang}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0+cpu

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# The CPU wheel, from pip's configured indexes or wheel folders (where pip
# finds none, pass an index that has it in SGLANG_PIP_ARGS). Never torchvision
# from an index: it pulls a CUDA torch.
# shellcheck disable=SC2086
"${PIP[@]}" ${SGLANG_PIP_ARGS:-} "torch==$TORCH_VERSION"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==$TORCH_VERSION" >"$CONSTRAINT"
"${PIP[@]}" -c "$CONSTRAINT" \
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq \
    tqdm ipython aiohttp "transformers==5.19.0" dill sentencepiece compressed-tensors gguf openai \
    partial_json_parser einops pytest pytest-timeout
"${PIP[@]}" -c "$CONSTRAINT" -e ./kvconn_core -e ./kvconn_sglang
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
torch = md.version("torch")
assert torch.endswith("+cpu"), f"expected a CPU torch, got {torch}"
for gpu_only in ("triton", "torchvision"):
    try:
        md.version(gpu_only)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{gpu_only} got installed: the SGLang venv must not pull it")
print("sglang venv ready: torch", torch, "sglang", md.version("sglang"))
PY
