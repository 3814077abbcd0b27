# Sourced by the GPU scripts (check.sh, focus.sh): the step helpers, and the
# carried wheels and libraries installed into temporary folders (see check.sh).
# The caller sets BUDGET_S and HARD_S (seconds) first; LOG_NAME names the log.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
ROOT=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/${LOG_NAME:-gpu-check.log}
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-160}
PY=${PY:-python3}
SITE=${SITE:-/tmp/kvconn-site}
LIBS=/tmp/kvconn-libs
WHL=$ROOT/.whl
START=$(date +%s)
RES=/tmp/kvconn-results # what results.tgz holds
rm -rf "$RES"
mkdir -p "$RES"
STEPS=$RES/steps.txt # one line per step; a file, so that steps run in the background count too
: >"$STEPS"

elapsed() { echo $(($(date +%s) - START)); }
# have_lib SONAME: the host's loader cache knows SONAME.
have_lib() { ldconfig -p | awk '{print $1}' | grep -qxF "$1"; }
pack() { tar -C "$RES" -czf "$OUT/results.tgz.part" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }

# step NAME TIMEOUT_S CMD...: run CMD under timeout, record rc and seconds.
step() {
    local name=$1 limit=$2 rc t0 ms left
    shift 2
    left=$((HARD_S - $(elapsed) - 20))
    if [ "$left" -lt 10 ]; then
        printf '%-34s SKIPPED (HARD_S=%ss reached)\n' "$name" "$HARD_S" >>"$STEPS"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo
    echo "=== [$name] t=$(elapsed)s timeout=${limit}s: $*"
    t0=$(date +%s%N)
    timeout -k 10 "$limit" "$@"
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    printf '%-34s rc=%-4s %4d.%01ds\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000 / 100)) >>"$STEPS"
    [ "$rc" = 124 ] && echo "!!! [$name] timed out after ${limit}s"
    [ -n "${NOPACK:-}" ] || pack # side_by_side packs once all have ended
    return 0
}

# Optional step: skipped when fewer than NEED_S seconds of BUDGET_S are left.
maybe() {
    local need=$1
    shift
    if [ $(($(elapsed) + need)) -gt "$BUDGET_S" ]; then
        printf '%-34s SKIPPED (budget: %ss used of %ss)\n' "$1" "$(elapsed)" "$BUDGET_S" >>"$STEPS"
        return 0
    fi
    step "$@"
}

# side_by_side "NAME TIMEOUT_S CMD..." ...: the steps at once, each logging to
# $RES/NAME.log; the logs join the main log, in order, once all have ended.
side_by_side() {
    local spec name pids=()
    for spec in "$@"; do
        name=${spec%% *}
        (NOPACK=1 && eval "step $spec") >"$RES/$name.log" 2>&1 &
        pids+=($!)
    done
    wait "${pids[@]}" # not a bare wait: that would also wait for the log's tee
    for spec in "$@"; do
        cat "$RES/${spec%% *}.log"
    done
    pack
}

KV=("$PY" -m kvconn.cli)
export PY WHL SITE LIBS

# ---------------------------------------------------------------------------
# (a) the machine
info() {
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PY" -V
    command -v "$PY"
    nproc
    "$PY" - <<'EOF'
import importlib
for mod in ("torch", "cupy", "numpy", "zmq", "nixl", "mooncake"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:9} {getattr(m, '__version__', '?')} {getattr(m, '__file__', '')}")
    except Exception as exc:
        print(f"{mod:9} -- {type(exc).__name__}: {exc}")
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available())
import cupy
print("cupy runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
EOF
    ldconfig -p | grep -E 'libibverbs\.so\.1|libmlx5\.so\.1|libnl-(route-)?3\.so|libnuma\.so\.1|libcurl\.so\.4|libcudart\.so\.1[23]|libcuda\.so\.1|libnvidia-ml\.so\.1' || true
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    ls "$WHL"
    return 0
}
export -f info
step info 60 bash -c info

# ---------------------------------------------------------------------------
# (b)+(c) Python packages: the carried wheels and our three packages, into $SITE.
# KVCONN_PREINSTALLED=1 skips this (a dry run of the scripts where $PY has them).
if [ -z "${KVCONN_PREINSTALLED:-}" ]; then
rm -rf "$SITE" /tmp/kvconn-cu12
mapfile -t WHEELS < <(ls "$WHL"/*.whl | grep -v '/nvidia_')
step pip-install 240 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --no-build-isolation --disable-pip-version-check --upgrade --target "$SITE" \
    "${WHEELS[@]}" ./kvconn_core ./kvconn_nixl ./kvconn_mooncake
# libcudart.so.12 for Mooncake: unpacked aside, never on sys.path (its nvidia/ would shadow torch's).
step cudart12-unpack 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target /tmp/kvconn-cu12 "$WHL"/nvidia_cuda_runtime_cu12-*.whl
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH

# System libraries that Mooncake's engine.so needs, only where the host lacks them.
syslibs() {
    rm -rf "$LIBS" /tmp/kvconn-debs
    mkdir -p "$LIBS" /tmp/kvconn-debs
    local deb f base
    for deb in "$WHL"/*.deb; do
        if command -v dpkg >/dev/null; then
            dpkg -x "$deb" /tmp/kvconn-debs
        else
            (cd /tmp/kvconn-debs && ar p "$deb" "$(ar t "$deb" | grep '^data.tar')" | tar -x -J 2>/dev/null ||
                ar p "$deb" "$(ar t "$deb" | grep '^data.tar')" | tar -x --zstd)
        fi
    done
    for f in /tmp/kvconn-debs/usr/lib/x86_64-linux-gnu/lib*.so.[0-9]* /tmp/kvconn-debs/lib/x86_64-linux-gnu/lib*.so.[0-9]*; do
        [ -e "$f" ] || continue
        base=$(basename "$f")
        [[ $base =~ ^lib.*\.so\.[0-9]+$ ]] || continue # soname links only
        if have_lib "$base"; then
            echo "host has $base"
        else
            ln -sf "$f" "$LIBS/$base" && echo "carried  $base"
        fi
    done
    if ! have_lib libcurl.so.4; then
        cp "$WHL/libcurl-stub.so.4" "$LIBS/libcurl.so.4" && echo "stub     libcurl.so.4 (no HTTP metadata; P2PHANDSHAKE only)"
    fi
    if ! have_lib libcudart.so.12; then
        f=$(find /tmp/kvconn-cu12 -name 'libcudart.so.12' | head -1)
        [ -n "$f" ] && ln -sf "$f" "$LIBS/libcudart.so.12" && echo "carried  libcudart.so.12 ($f)"
    fi
    return 0
}
export -f syslibs have_lib
step syslibs 60 bash -c syslibs
# libcudart.so.13 for UCX's cuda memory hooks (ucm_cuda): the host's own, wherever pip put it.
CUDART13=""
if ! have_lib libcudart.so.13; then
    CUDART13=$("$PY" - <<'EOF'
import glob, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
for root in roots:
    for pat in ("nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.13", "libcudart.so.13"):
        hits = glob.glob(f"{root}/{pat}")
        if hits:
            print(hits[0].rsplit("/", 1)[0]); sys.exit()
EOF
)
fi
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}${CUDART13:+:$CUDART13}
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
fi

# ---------------------------------------------------------------------------
# (d) what loads
libcheck() {
    local f
    for f in "$SITE"/mooncake/engine.so "$SITE"/nixl_cu13.libs/ucx/libuct_cuda.so.* \
        "$SITE"/nixl_cu13.libs/ucx/libucm_cuda.so.* "$SITE"/.nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so; do
        echo "-- $f"
        ldd "$f" | grep -E 'not found|cudart|libcuda\.|ibverbs|curl|numa|mlx5' || true
    done
    "$PY" -c 'import mooncake.engine as e; print("mooncake.engine", e.__file__)'
    "$PY" -c 'import nixl._api as a, nixl_cu13; print("nixl", a.__name__, nixl_cu13.__file__)'
    "$PY" -c 'import zmq; print("pyzmq", zmq.__version__)'
}
export -f libcheck
step libcheck 90 bash -c libcheck
step kvconn-backends 90 "${KV[@]}" backends
