#!/usr/bin/env bash
# Build .whl/ for scripts/gpu/check.sh on a host with network (the GPU host has none).
# The CUDA wheels are trimmed to what a UCX agent / Mooncake engine loads, so the
# whole carry stays well under the device tool's 64 MiB (about 27 MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
FULL=${FULL:-/tmp/kvconn-full-wheels}
mkdir -p .whl "$FULL"
dl() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "$2"
}
dl .whl pyzmq==27.3.0
dl .whl py-spy==0.4.3 # curves.sh's profile
dl .whl nixl==1.5.1
dl "$FULL" nixl-cu13==1.5.1
dl "$FULL" mooncake-transfer-engine==0.3.13.post1
dl "$FULL" nvidia-cuda-runtime-cu12==12.9.79
T=scripts/gpu/trim_wheels.py
python3 $T "$FULL"/nixl_cu13-*.whl .whl '_bindings\.' '_utils\.' 'libplugin_UCX\.so' \
    'ucx/libuct_cma' 'ucx/libuct_cuda\.' 'ucx/libucm_cuda' \
    'ucx/libuct_ib\.' 'ucx/libuct_ib_mlx5\.'  # UCX's verbs transports (rc, ud): scripts/gpu/rdma_fence.sh
python3 $T "$FULL"/mooncake_transfer_engine-*.whl .whl 'mooncake/engine\.so'
python3 $T "$FULL"/nvidia_cuda_runtime_cu12-*.whl .whl 'libcudart\.so\.12$'
(cd .whl && apt-get download libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1)
gcc -shared -fPIC -O2 -Wl,-soname,libcurl.so.4 -o .whl/libcurl-stub.so.4 scripts/gpu/curl_stub.c
du -sh .whl
