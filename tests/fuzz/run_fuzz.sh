#!/usr/bin/env bash
# Runs the fuzz target of mha's binding (tests/fuzz/fuzz_binding.py) for a while, at low
# priority, optionally against an AddressSanitizer + UBSan build of the extension.
#
#   bash tests/fuzz/run_fuzz.sh                      # 10 minutes, random engine, installed mha
#   bash tests/fuzz/run_fuzz.sh --minutes 2 --asan   # against the sanitizer build (needs gcc)
#   bash tests/fuzz/run_fuzz.sh --engine atheris     # coverage-guided (pip install atheris)
#   bash tests/fuzz/run_fuzz.sh --include-known      # also hit the open findings (after fixes)
#
# Exit status 0 when no input crashed, hung or broke an oracle; otherwise 1, with each failing
# input saved under --out (default $TMPDIR/mha-fuzz) and the command that replays it.
# PYTHON selects the interpreter (default python3); --jobs runs several seeds side by side.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
MINUTES=10
ENGINE=random
ASAN=0
JOBS=1
KEEP_GOING=0
EXTRA=()
OUT="${TMPDIR:-/tmp}/mha-fuzz"
while [ $# -gt 0 ]; do
    case "$1" in
        --minutes) MINUTES="$2"; shift ;;
        --engine) ENGINE="$2"; shift ;;
        --asan) ASAN=1 ;;
        --jobs) JOBS="$2"; shift ;;
        --out) OUT="$2"; shift ;;
        --keep-going) KEEP_GOING=1 ;;
        --include-known) EXTRA+=(--include-known) ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
RUN=("$PY")
if [ "$ASAN" = 1 ]; then
    eval "$(PYTHON="$PY" bash "$HERE/build_asan.sh" "$OUT/asan-build")" || exit 2
    # shellcheck disable=SC2206
    RUN=($MHA_ASAN_PYTHON)
fi
# a directory where ./mha is not importable: the installed (or the ASan) package is fuzzed
cd "$OUT"
SECONDS_TOTAL=$(awk "BEGIN { print int($MINUTES * 60) }")
echo "mha fuzz: $ENGINE engine, $MINUTES min x $JOBS job(s), asan=$ASAN, out=$OUT"

job() {  # job INDEX: runs until the time is up; restarts after a finding with --keep-going
    local i=$1 start=$SECONDS status=0 seed log
    while [ $((SECONDS - start)) -lt "$SECONDS_TOTAL" ]; do
        seed=$(( (RANDOM << 15 | RANDOM) + i ))
        log="$OUT/job$i-seed$seed.log"
        local left=$((SECONDS_TOTAL - (SECONDS - start)))
        if [ "$ENGINE" = atheris ]; then
            mkdir -p "$OUT/corpus"
            nice -n 10 "${RUN[@]}" "$HERE/fuzz_binding.py" --engine atheris "${EXTRA[@]}" \
                -max_total_time="$left" -artifact_prefix="$OUT/" -seed="$seed" "$OUT/corpus" \
                >"$log" 2>&1
        else
            nice -n 10 "${RUN[@]}" "$HERE/fuzz_binding.py" --engine random --seconds "$left" \
                --seed "$seed" --out "$OUT/job$i" "${EXTRA[@]}" >"$log" 2>&1
        fi
        local rc=$?
        tail -n 1 "$log"
        if [ $rc -ne 0 ]; then
            status=1
            local saved="$OUT/crash-job$i-seed$seed.bin"
            [ -f "$OUT/job$i/current.bin" ] && mv "$OUT/job$i/current.bin" "$saved"
            echo "job $i: FAILED (exit $rc), log $log" >&2
            grep -E "FINDING|Error|ERROR|SUMMARY|Fatal|runtime error" "$log" | head -n 5 >&2
            [ -f "$saved" ] && echo "  replay: ${RUN[*]} $HERE/fuzz_binding.py --replay $saved" >&2
            [ "$KEEP_GOING" = 1 ] || return 1
        fi
    done
    return $status
}

pids=()
for i in $(seq 1 "$JOBS"); do
    job "$i" &
    pids+=($!)
done
fail=0
for p in "${pids[@]}"; do
    wait "$p" || fail=1
done
if [ $fail = 0 ]; then echo "mha fuzz: no finding"; else echo "mha fuzz: FINDINGS (see above)"; fi
exit $fail
