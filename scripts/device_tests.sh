#!/usr/bin/env bash
# The GPU tests, on a GPU machine from the repository root: from a normal build (--build DIR,
# default build) or from the binary pack that scripts/pack_device.sh makes (--pack DIR, e.g.
# .device-pack). The benchmarks are bench/run.py's suites; these are the tests. Each group named
# runs (default: backend cupti e2e digits), its output in $OUT/GROUP.log (default OUT
# /tmp/fusedps-out) and its tail printed; the exit status is 1 when any failed.
#
#   scripts/device_tests.sh [--build DIR | --pack DIR] [GROUP...]
#
#   backend     cuda_backend_test and cpu_backend_test; models_test on the CUDA backend
#   cupti       metrics_cupti_test: the kernel-launch metric against CUPTI's count
#   e2e         tests/e2e (the PyTorch oracle, the contract tests) against CUDA servers
#   overlap     tests/e2e/test_overlap.py, test_overlap_buckets.py, test_overlap_staging.py,
#               test_overlap_commit_pull.py,
#               test_copies.py, test_workspace.py and test_device_workspace.py (a part of e2e)
#   checkpoint  the checkpoint e2e tests, restart, interop, torch, state dtypes (a part of e2e)
#   python      the Python package's e2e tests: RemoteAdamW, transports, LoadState, parity,
#               the client (a part of e2e)
#   digits      examples/train_digits.py through a CUDA server
#   image       tests/e2e and the digits example with the CUDA image's fusedps-server and CLI,
#               which `make test-deploy` copies out to build-deploy/cuda-image ($IMAGE_DIR)
#
# Env: OUT; TEST_DEVICE (the servers' --device, cuda); PYTHON (python3: one with torch, pytest);
# PYTEST_ARGS (more pytest arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
build=build pack=
while (($#)); do
  case $1 in
    --build) build=$2; shift 2 ;;
    --pack) pack=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d' | cut -c3-; exit 0 ;;
    -*) echo "device_tests.sh: unknown option $1 (--help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
groups=("$@")
((${#groups[@]})) || groups=(backend cupti e2e digits)
for group in "${groups[@]}"; do
  case $group in
    backend|cupti|e2e|overlap|checkpoint|python|digits|image) ;;
    *) echo "device_tests.sh: no group $group (--help names them)" >&2; exit 2 ;;
  esac
done
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
export FUSEDPS_TEST_DEVICE=${TEST_DEVICE:-cuda}
python=${PYTHON:-python3}

if [[ -n $pack ]]; then
  pack=$(cd "$pack" && pwd)
  # shellcheck source=scripts/device_lib.sh disable=SC1091
  source scripts/device_lib.sh
  PY_PATH=$pack/python python_env "$pack"
else
  build=$(cd "$build" && pwd)
  export PYTHONPATH=$build/python PYTHONDONTWRITEBYTECODE=1
  export FUSEDPS_SERVER=$build/server/fusedps-server FUSEDPS_CLI=$build/client/fusedps
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    | tee "$out/gpu.txt"
fi

failed=()
# check NAME SECONDS COMMAND...: runs a test command, its output in $out/NAME.log; prints its
# tail, and remembers a failure.
check() {
  local name=$1 limit=$2 status=0
  shift 2
  echo "== $name"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1 || status=$?
  if ((status == 0)); then
    tail -3 "$out/$name.log"
  else
    tail -25 "$out/$name.log"
    echo "FAILED: $name (exit $status)"
    failed+=("$name")
  fi
}

# gtest NAME: a GoogleTest executable of the pack, or of the build.
gtest() {
  local name=$1 exe
  if [[ -n $pack ]]; then
    check "$name" 900 "$pack/run" "$name" --gtest_brief=1
  else
    exe=$(find "$build" -name "$name" -type f -perm -u+x -not -path '*/CMakeFiles/*' -print \
      -quit)
    check "$name" 900 "${exe:-$build/$name (not built)}" --gtest_brief=1
  fi
}

# pytest NAME [TESTS...]: tests/e2e (or the files named) against servers on the GPU.
pytest_e2e() {
  local name=$1
  shift
  # shellcheck disable=SC2086  # PYTEST_ARGS: one argument per word
  check "$name" 900 "$python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "${@:-tests/e2e}"
}

digits() {
  check "$1" 300 "$python" tests/e2e/server_fixture.py --device="$FUSEDPS_TEST_DEVICE" -- \
    "$python" examples/train_digits.py --target '{target}'
}

for group in "${groups[@]}"; do
  case $group in
    backend)
      gtest cuda_backend_test
      gtest cpu_backend_test
      gtest models_test ;;
    cupti) gtest metrics_cupti_test ;;
    e2e) pytest_e2e e2e ;;
    overlap) pytest_e2e overlap tests/e2e/test_overlap.py tests/e2e/test_overlap_buckets.py \
               tests/e2e/test_overlap_commit_pull.py \
               tests/e2e/test_overlap_staging.py tests/e2e/test_copies.py \
               tests/e2e/test_workspace.py tests/e2e/test_device_workspace.py ;;
    checkpoint)
      pytest_e2e checkpoint tests/e2e/test_checkpoint_restart.py \
        tests/e2e/test_checkpoint_interop.py tests/e2e/test_checkpoint_torch.py \
        tests/e2e/test_checkpoint_state_dtypes.py ;;
    python)
      pytest_e2e python tests/e2e/test_remote_adamw.py tests/e2e/test_transports.py \
        tests/e2e/test_load_state.py tests/e2e/test_parity.py tests/e2e/test_client.py ;;
    digits) digits digits ;;
    image)
      # The image's files with the image's own libraries, outside Docker.
      image=${IMAGE_DIR:-build-deploy/cuda-image}
      if [[ ! -x $image/bin/fusedps-server ]]; then
        echo "FAILED: image (no $image/bin/fusedps-server: make test-deploy copies it there)"
        failed+=(image)
        continue
      fi
      image=$(cd "$image" && pwd)
      for exe in fusedps-server fusedps; do
        printf '#!/usr/bin/env bash\nLD_LIBRARY_PATH=%s/lib exec %s/bin/%s "$@"\n' "$image" \
          "$image" "$exe" >"$image/$exe-wrapper"
        chmod +x "$image/$exe-wrapper"
      done
      echo "== the image's libraries, as the loader resolves them"
      LD_LIBRARY_PATH=$image/lib ldd "$image/bin/fusedps-server" \
        | grep -E "fusedps|not found|cuda" | head || true
      FUSEDPS_SERVER=$image/fusedps-server-wrapper FUSEDPS_CLI=$image/fusedps-wrapper \
        pytest_e2e image_e2e
      FUSEDPS_SERVER=$image/fusedps-server-wrapper digits image_digits ;;
  esac
done
if ((${#failed[@]})); then
  echo "failed: ${failed[*]} (logs in $out)"
  exit 1
fi
echo "all passed: ${groups[*]} (logs in $out)"
