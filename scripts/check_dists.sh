#!/usr/bin/env bash
# Would the five distributions install from an index? Build each one's sdist,
# then its wheel from that sdist (python -m build), check them (twine check
# --strict), install the wheels alone into a fresh venv (their dependencies
# from the index, nixl's two wheels as kvconn_nixl/README.md says) and run
# `kvconn backends` there; every version reported is its package's __version__.
# Works in build/dists/ (ignored): the artifacts and logs stay, its two venvs
# go once it passed. Usage: bash scripts/check_dists.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3}
DISTS=(kvconn_core kvconn_nixl kvconn_mooncake kvconn_vllm kvconn_sglang)
WORK=build/dists
rm -rf "$WORK"
mkdir -p "$WORK/out"

# One build environment for the five (an isolated one each is two venvs per
# distribution: 30 s each here) with the setuptools the isolated build would
# fetch (pyproject: setuptools>=77): .venv's, where scripts/test.sh put
# build, twine and that setuptools, else one made here.
BUILDER=.venv/bin/python
if ! { [ -x "$BUILDER" ] && "$BUILDER" -c "import build, twine, setuptools, sys
sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; }; then
    "$PYTHON" -m venv "$WORK/build-venv"
    BUILDER=$WORK/build-venv/bin/python
    "$BUILDER" -m pip install -q --disable-pip-version-check "setuptools>=77" build twine
fi
for dist in "${DISTS[@]}"; do
    "$BUILDER" -m build --no-isolation -q -o "$WORK/out" "$dist" >"$WORK/build-$dist.log" 2>&1 || {
        cat "$WORK/build-$dist.log"
        echo "check_dists: $dist did not build" >&2
        exit 1
    }
done
echo "check_dists: built in ${SECONDS} s: $(cd "$WORK/out" && echo *)"
"$BUILDER" -m twine check --strict "$WORK"/out/*

# What each wheel and sdist holds: its metadata, license, the version its
# package states (scripts/check_dists.py).
"$BUILDER" scripts/check_dists.py "$WORK/out" "${DISTS[@]}"

# A fresh venv with nothing of this checkout: the wheels, and what they pull.
"$PYTHON" -m venv "$WORK/venv"
VPIP=("$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check)
"${VPIP[@]}" "$WORK"/out/*.whl
"${VPIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
echo "check_dists: installed into a fresh venv by ${SECONDS} s"
CHECK=$PWD/scripts/check_dists.py
cd "$WORK"  # not the checkout: nothing of it importable from the working folder
venv/bin/kvconn backends
venv/bin/python "$CHECK" --installed "${DISTS[@]}"
rm -rf venv build-venv
echo "check_dists: ok in ${SECONDS} s"
