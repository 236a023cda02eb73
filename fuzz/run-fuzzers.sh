#!/bin/sh
# run-fuzzers.sh - run the libFuzzer harnesses of a `--enable-fuzz` build and
# summarise each run's final libFuzzer line (executions, cov:, ft:) - the
# figures bench/results/fuzzing.md records.
#
#   fuzz/run-fuzzers.sh BUILD_DIR WORK_DIR [RUNS [SECONDS [JOBS [NAME...]]]]
#
# Each NAME (default: all seven) runs until RUNS executions (default 1000000)
# or SECONDS of wall time (default 1800), whichever comes first, JOBS at a
# time (default 2: the CI machine has two cores; put the slowest first).  New inputs go to
# WORK_DIR/corpus/NAME (seeded from fuzz/corpus/NAME, which is only read),
# logs to WORK_DIR/NAME.log, crashes/leaks/timeouts to WORK_DIR/NAME-*.
# Leak detection is on (libFuzzer's default under ASan), a single input
# running past 10 s counts as a hang, and UBSan findings abort.
# Exit status 1 if any harness found something.
set -eu
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR WORK_DIR [RUNS [SECONDS [JOBS [NAME...]]]]" >&2; exit 2; }
B=$(cd "$1" && pwd)
W=$2
RUNS=${3:-1000000}
SECS=${4:-1800}
JOBS=${5:-2}
shift $(( $# < 5 ? $# : 5 ))
NAMES=${*:-safetensors st_index config tunedb cubin variant code_hash}
SRC=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$W/corpus"
W=$(cd "$W" && pwd)
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1

run_one() {
  n=$1
  mkdir -p "$W/corpus/$n"
  echo "$B/fuzz/fuzz_$n -runs=$RUNS -max_total_time=$SECS -timeout=10 -rss_limit_mb=2048 -print_final_stats=1" \
       "-artifact_prefix=$W/$n- $W/corpus/$n $SRC/fuzz/corpus/$n" > "$W/$n.cmd"
  start=$(date +%s)
  if "$B/fuzz/fuzz_$n" -runs="$RUNS" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 \
       -print_final_stats=1 -artifact_prefix="$W/$n-" "$W/corpus/$n" "$SRC/fuzz/corpus/$n" \
       > "$W/$n.log" 2>&1; then rc=0; else rc=$?; fi
  end=$(date +%s)
  echo "$rc $((end - start))" > "$W/$n.rc"
}

# JOBS lanes, names dealt round-robin, each lane running its names one after
# another (so a long harness never leaves a core idle waiting for a batch).
lane=0
pids=
while [ "$lane" -lt "$JOBS" ]; do
  (
    i=0
    for n in $NAMES; do
      [ $((i % JOBS)) -eq "$lane" ] && run_one "$n"
      i=$((i + 1))
    done
  ) &
  pids="$pids $!"
  lane=$((lane + 1))
done
for p in $pids; do wait "$p"; done

bad=0
printf '%-12s %-4s %9s %7s %10s  %s\n' harness rc wall_s execs "exec/s" "final libFuzzer line"
for n in $NAMES; do
  read -r rc secs < "$W/$n.rc"
  # The last "#N ... cov: ... ft: ..." status line, and the run count.
  last=$(grep -E '^#[0-9]+' "$W/$n.log" | tail -1)
  execs=$(grep -E '^stat::number_of_executed_units:' "$W/$n.log" | awk '{print $2}')
  eps=$(grep -E '^stat::average_exec_per_sec:' "$W/$n.log" | awk '{print $2}')
  printf '%-12s %-4s %9s %7s %10s  %s\n' "$n" "$rc" "$secs" "${execs:-?}" "${eps:-?}" "$last"
  if [ "$rc" != 0 ] || ls "$W/$n-"* >/dev/null 2>&1; then bad=1; fi
done
exit $bad
