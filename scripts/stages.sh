# Stages of scripts/test.sh, sourced by it (and by tests/core/test_test_sh.py):
# each stage runs whatever an earlier one did, its result and time are
# recorded, and the summary at the end lists them all and fails if one did.

STAGES_STARTED=$SECONDS
STAGES_LOAD_AT_START=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
STAGES_SUMMARY=()
STAGES_FAILED=0

# record NAME RC SECONDS [WHY]: one line of the summary.
record() {
    local result="ok"
    if [ "$2" -ne 0 ]; then
        result="FAILED (exit $2${4:+; $4})"
        STAGES_FAILED=$((STAGES_FAILED + 1))
    fi
    STAGES_SUMMARY+=("$(printf '%6d s  %-38s %s' "$3" "$1" "$result")")
}

# skipped NAME WHY: a stage left out on purpose (not a failure).
skipped() {
    STAGES_SUMMARY+=("$(printf '%6s s  %-38s %s' - "$1" "skipped: $2")")
}

# stage NAME COMMAND...: run it in the foreground, record its result and time.
stage() {
    local name=$1 t0=$SECONDS rc
    shift
    echo "=== test.sh: $name" >&2
    "$@"
    rc=$?
    record "$name" "$rc" $((SECONDS - t0))
    return "$rc"
}

# finish_background NAME PID LOG T0: wait for a stage started with `&`;
# print its log's last lines, or all of it if it failed.
finish_background() {
    local name=$1 pid=$2 log=$3 t0=$4 rc
    echo "=== test.sh: $name (waiting for it; log: $log)" >&2
    wait "$pid"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        cat "$log" >&2
    else
        tail -n 3 "$log" >&2
    fi
    record "$name" "$rc" $((SECONDS - t0)) "log: $log"
    return "$rc"
}

# unlower PID...: give each process and every descendant of it back the
# normal priority (nice 0, best-effort I/O). test.sh builds the engine venvs
# at a low priority while the main suite runs; once the suite is done they
# are all that is left to wait for, and beside busy neighbours at nice 0 a
# niced build starves (a vLLM venv still installing after 26 min). Raising a
# priority needs root (CAP_SYS_NICE): without it they finish at the low one.
unlower() {
    local pids=() queue=("$@") pid
    while [ ${#queue[@]} -gt 0 ]; do
        pid=${queue[0]}
        queue=("${queue[@]:1}")
        kill -0 "$pid" 2>/dev/null || continue
        pids+=("$pid")
        # shellcheck disable=SC2207
        queue+=($(pgrep -P "$pid" 2>/dev/null))
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    if renice -n 0 -p "${pids[@]}" >/dev/null 2>&1; then
        ionice -c 2 -n 4 -p "${pids[@]}" >/dev/null 2>&1
        echo "test.sh: background builds back at normal priority (${#pids[@]} processes)" >&2
    else
        echo "test.sh: background builds stay at low priority (raising it needs root)" >&2
    fi
    return 0
}

# summary: every stage's line, the total time and the load; fails if a stage did.
summary() {
    local took=$((SECONDS - STAGES_STARTED))
    echo "=== test.sh: stages" >&2
    printf '%s\n' "${STAGES_SUMMARY[@]}" >&2
    echo "test.sh: ${STAGES_FAILED} of ${#STAGES_SUMMARY[@]} stages failed; $((took / 60)) min $((took % 60)) s;" \
        "load average (1, 5, 15 min) at the start ${STAGES_LOAD_AT_START}," \
        "at the end $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")" >&2
    [ "$STAGES_FAILED" -eq 0 ]
}
