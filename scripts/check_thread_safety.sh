#!/usr/bin/env bash
# The thread-safety check (.ci/run's stage threads): clang's -Wthread-safety analysis over every
# C++ translation unit of our own code (server/, common/, kernels/, client/, but the tests), so
# that the annotations of common/mutex.h's users (ABSL_GUARDED_BY on a member, a method's
# ABSL_EXCLUSIVE_LOCKS_REQUIRED or ABSL_LOCKS_EXCLUDED) are checked against the locks each
# function holds. Any finding is an error, and the script prints each with clang's diagnostic
# and exits 1. The build compiles with GCC, which ignores the annotations; this only parses
# (-fsyntax-only), with the include paths, definitions and language flags of each file's entry
# in the build's compile_commands.json.
#
# It configures a build tree of its own (build-threads, or $1) and builds only the generated
# protobuf code there (fusedps_proto, fusedps_checkpoint_proto), which the files include.
# Installs Debian's clang-14 and libomp-14-dev (clang's omp.h) first when missing.
#
# CUDA files (.cu, .cuh) are not checked: clang 14's CUDA mode supports CUDA up to 11.5 and
# fails on CUDA 13's headers (no sm_90; its wrapper includes texture_fetch_functions.h, which
# CUDA 13 dropped), so their annotations (kernels/cuda/markers.cuh, snapshots.cuh,
# adamw_kernel.cuh) are documentation only. No C++ file includes them (the server reaches the
# CUDA backend through kernels/backend.h).
#   usage: check_thread_safety.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
build=${1:-build-threads}
jobs=${JOBS:-$(nproc)}

scripts/setup.sh --only clang-14 libomp-14-dev

cmake -S . -B "$build" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
cmake --build "$build" -j"$jobs" --target fusedps_proto fusedps_checkpoint_proto >/dev/null

# One line per translation unit: its directory, the file, then the flags clang needs from its
# entry (include paths, definitions, the language standard, OpenMP), separated by \x1f. The
# warning flags are left out: some are GCC's (-Wno-tsan), and -Werror would make clang's other
# warnings fatal.
commands=$(mktemp)
trap 'rm -f "$commands"' EXIT
python3 - "$build/compile_commands.json" "$repo" >"$commands" <<'EOF'
import json, shlex, sys
entries, repo = json.load(open(sys.argv[1])), sys.argv[2]
ours = ("server/", "common/", "kernels/", "client/")
seen = set()
for e in entries:
    path = e["file"]
    rel = path[len(repo) + 1:] if path.startswith(repo + "/") else path
    if not rel.endswith(".cc") or not rel.startswith(ours) or rel.endswith("_test.cc"):
        continue
    if rel in seen:
        continue
    seen.add(rel)
    args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    keep, i = [], 1
    while i < len(args):
        a = args[i]
        if a in ("-I", "-isystem", "-iquote", "-D", "-U", "-include"):
            keep += [a, args[i + 1]]
            i += 2
            continue
        if a.startswith(("-I", "-isystem", "-iquote", "-D", "-U", "-std=")) or a == "-fopenmp":
            keep.append(a)
        i += 1
    sys.stdout.write("\x1f".join([e["directory"], path] + keep) + "\n")
EOF
count=$(wc -l <"$commands")
echo "check_thread_safety: clang++-14 -Wthread-safety over $count translation units"

# check LINE: the analysis of one translation unit; its diagnostics on stderr.
check() {
  local -a entry
  IFS=$'\x1f' read -r -a entry <<<"$1"
  (cd "${entry[0]}" && clang++-14 -fsyntax-only "${entry[@]:2}" -Wthread-safety \
    -Wthread-safety-beta -Werror=thread-safety -Werror=thread-safety-beta "${entry[1]}")
}
export -f check
# shellcheck disable=SC2016  # $1 is the inner shell's: one line of $commands
if ! xargs -d '\n' -n1 -P"$jobs" bash -c 'check "$1"' _ <"$commands"; then
  echo "check_thread_safety: FAILED: clang's thread-safety analysis found the errors above" \
       "(the annotations: common/mutex.h)" >&2
  exit 1
fi
echo "check_thread_safety: no findings"
