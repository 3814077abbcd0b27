#!/usr/bin/env bash
# Mutation testing of kvconn's protocol core with mutmut 3 (docs/testing.md).
#
#   scripts/mutation.sh              # fresh run, then a score per module
#   scripts/mutation.sh --keep       # reuse the last run's results (after a test change)
#   scripts/mutation.sh --keep 'kvconn.protocol.ledger.xǁRoomLedgerǁexpire*'   # re-run some
#
# PYTHON (default: python) must have mutmut 3 and kvconn's test dependencies;
# JOBS (default 2) mutants run at a time.
#
# mutmut 3 derives a module's name from its path relative to where it runs and
# only knows ./, src/ and source/ as source roots; kvconn's code lives in
# kvconn_core/src/, its tests in tests/. So the run happens in a staged tree,
# build/mutation/, laid out as mutmut expects: src/kvconn (copied), tests/
# (the fast tests that carry the kills) and pyproject.toml ([tool.mutmut]).
# mutmut copies that into build/mutation/mutants/ and imports the mutated
# code from there ahead of any installed (editable) kvconn.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
stage=$root/build/mutation
python=${PYTHON:-python}
# The run happens in the staged tree: a relative PYTHON (.venv/bin/python, as
# docs/testing.md has it) is made absolute first, without resolving the venv's
# symlink (that would leave the venv).
if [[ $python == */* ]]; then python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python"); fi
jobs=${JOBS:-2}

keep=0
if [[ ${1:-} == --keep ]]; then keep=1; shift; fi

if ! "$python" -c 'import mutmut' 2>/dev/null; then
    echo "mutmut is not installed for $python: pip install 'mutmut>=3.8,<4'" >&2
    exit 2
fi

if [[ $keep == 0 ]]; then rm -rf "$stage"; fi
mkdir -p "$stage/tests"
rm -rf "$stage/src" "$stage/tests/core" "$stage/tests/fuzz"
cp -r "$root/kvconn_core/src" "$stage/src"
cp -r "$root/tests/core" "$root/tests/fuzz" "$stage/tests/"
cp "$root/pyproject.toml" "$stage/pyproject.toml"
find "$stage" -name __pycache__ -prune -exec rm -rf {} +
if [[ $keep == 1 && -d $stage/mutants ]]; then
    # fresh copies of the tests; the stats (which tests reach which function)
    # are collected again, so that new tests are run against old survivors
    rm -rf "$stage/mutants/tests" "$stage/mutants/mutmut-stats.json"
fi

# What is mutated: all of the protocol core (decode's decisions included:
# endpoint.py, bootstrap.py, liveness.py, drain.py, owner_fence.py) and
# prefill's (rank.py, rank_bootstrap.py, rank_events.py), and of the runtime
# only prefill's FenceGate (runtime/transfer.py; the rest of the runtime is
# plumbing that only the process-level tests exercise, minutes per mutant).
# Names are mutmut's, globs allowed; arguments replace this list.
targets=(
    "kvconn.protocol.*"
    "kvconn.runtime.transfer.xǁFenceGateǁ*"
)
if [[ $# -gt 0 ]]; then targets=("$@"); fi

cd "$stage"
start=$(date +%s)
# The staged copy is the only kvconn on the path: a PYTHONPATH into a checkout
# would shadow nothing (mutmut puts mutants/src first) but confuses readers.
env -u PYTHONPATH "$python" -m mutmut run --max-children "$jobs" "${targets[@]}" || true
end=$(date +%s)
"$python" "$root/scripts/mutation_score.py" mutants
echo "wall time: $((end - start)) s on $jobs workers"
