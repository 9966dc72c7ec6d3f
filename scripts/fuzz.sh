#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang-14, ASan + UBSan, the CPU backend) in
# ${FUZZ_BUILD_DIR:-build-fuzz}, only them, and runs each for FUZZ_SECONDS (60 by default) on its
# corpus, tests/fuzz/corpus/<target>/. Fails on any crash, sanitizer report, leak, timeout or
# broken invariant: the input is left in <build>/fuzz/crashes/<target>/ and the command that
# replays it is printed. Prints each target's executions, exec/s, coverage and corpus.
#   FUZZ_SECONDS=600 scripts/fuzz.sh     longer runs (`make fuzz`)
#   FUZZ_TARGETS="push_message_fuzz"     some targets only
#   FUZZ_JOBS=1                          how many targets run at once (the number of cores by
#                                        default); each still runs for its full FUZZ_SECONDS
#   FUZZ_MERGE=1                         adds to tests/fuzz/corpus/<target>/ the inputs of this
#                                        run that reach new coverage (libFuzzer's -merge=1)
# New inputs go to <build>/fuzz/work/<target>/ (kept between runs), never to the corpus itself
# unless FUZZ_MERGE=1. tests/fuzz/README.md says what each target feeds.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --fuzz
build=${FUZZ_BUILD_DIR:-build-fuzz}
seconds=${FUZZ_SECONDS:-60}
targets=${FUZZ_TARGETS:-push_message_fuzz push_checks_fuzz registration_fuzz state_loader_fuzz}

CC=clang-14 CXX=clang++-14 cmake -S . -B "$build" -DFUSEDPS_FUZZ=ON -DFUSEDPS_CUDA=OFF >/dev/null
cmake --build "$build" -j"${JOBS:-$(nproc)}" --target fusedps_fuzz

# The first report fails the run; leaks too (tests/sanitizers/lsan.supp: none are suppressed).
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1
export LSAN_OPTIONS=suppressions=$PWD/tests/sanitizers/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export OMP_NUM_THREADS=1

# run_target TARGET: one target's run, its exit status left in <build>/fuzz/TARGET.status.
run_target() {
  local target=$1 status=0
  local binary=$build/tests/fuzz/$target corpus=tests/fuzz/corpus/$target
  local work=$build/fuzz/work/$target crashes=$build/fuzz/crashes/$target
  # New inputs land in the first folder ($work); the corpus is only read.
  "$binary" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$crashes/" "$work" "$corpus" >"$build/fuzz/$target.log" 2>&1 || status=$?
  echo "$status" >"$build/fuzz/$target.status"
}

# The targets run FUZZ_JOBS at a time (the number of cores by default), each one process with one
# thread for its full FUZZ_SECONDS: on 2 cores the 4 targets take 2 x FUZZ_SECONDS, not 4 x.
# (Not plain nproc: it counts OMP_NUM_THREADS, set to 1 above.)
fuzz_jobs=${FUZZ_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
((fuzz_jobs >= 1)) || fuzz_jobs=1
for target in $targets; do
  mkdir -p "tests/fuzz/corpus/$target" "$build/fuzz/work/$target" "$build/fuzz/crashes/$target"
  rm -f "$build/fuzz/$target.status"
  while (($(jobs -rp | wc -l) >= fuzz_jobs)); do wait -n || true; done
  echo "fuzz: $target for ${seconds}s on tests/fuzz/corpus/$target"
  run_target "$target" &
done
wait

failed=()
summary=()
for target in $targets; do
  binary=$build/tests/fuzz/$target
  corpus=tests/fuzz/corpus/$target
  crashes=$build/fuzz/crashes/$target
  log=$build/fuzz/$target.log
  work=$build/fuzz/work/$target
  status=$(cat "$build/fuzz/$target.status" 2>/dev/null || echo "no status")
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$done_line")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$done_line")
  if [[ $status != 0 ]]; then
    tail -n 60 "$log"
    echo "fuzz: $target FAILED (exit $status); log $log; inputs in $crashes:"
    ls -l "$crashes"
    echo "fuzz: replay with: $binary $crashes/<file>"
    failed+=("$target")
    summary+=("$(printf '%-18s FAILED (exit %s)' "$target" "$status")")
    continue
  fi
  if [[ ${FUZZ_MERGE:-0} == 1 ]]; then
    "$binary" -merge=1 "$corpus" "$work" >>"$log" 2>&1
  fi
  files=$(find "$corpus" -type f | wc -l)
  kib=$(($(du -sb "$corpus" | cut -f1) / 1024))
  summary+=("$(printf '%-18s %9s execs %6s exec/s  cov %5s  ft %6s  corpus %4s files %5s KiB' \
    "$target" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "$files" "$kib")")
done

echo "fuzz: ${seconds}s per target, $fuzz_jobs at a time:"
printf '  %s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo "fuzz: FAILED: ${failed[*]}"
  exit 1
fi
