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
# What a real server needs on top (tests/sglang/test_sglang_servers.py starts
# prefill, decode and SGLang's router): its HTTP stack, SGLang's router (its
# mini load balancer and the Rust router), and what launch_server's imports
# reach that the disaggregation modules do not. apache-tvm-ffi is a CPU
# library (xgrammar's bindings need the real one); xgrammar goes in without
# its dependencies, which name triton.
"${PIP[@]}" -c "$CONSTRAINT" \
    "fastapi==0.165.0" "uvicorn==0.55.0" "uvloop==0.23.0" "setproctitle==1.3.8" \
    "python-multipart==0.0.34" "interegular==0.3.3" "watchfiles==1.3.0" "tiktoken==0.14.0" \
    "blobfile==3.3.0" "xxhash==4.1.0" "zstandard==0.25.0" "scipy==1.17.1" "jsonschema==4.26.0" \
    "soundfile==0.13.1" "apache-tvm-ffi==0.1.11" "sglang-router==0.3.2"
"${PIP[@]}" --no-deps "xgrammar==0.2.7"
"${PIP[@]}" -c "$CONSTRAINT" -e "./kvconn_core[trace]" -e ./kvconn_sglang -e ./kvconn_nixl -e ./kvconn_mooncake
# nixl's metadata asks for a CUDA torch it does not need on DRAM (kvconn_nixl/README.md).
"${PIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
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
