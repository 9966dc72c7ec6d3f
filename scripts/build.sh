#!/usr/bin/env bash
# Configures and builds everything into ${BUILD_DIR:-build} (CUDA code too where nvcc exists).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -DFUSEDPS_CUDA="${FUSEDPS_CUDA:-AUTO}" >/dev/null
cmake --build "$build" -j"${JOBS:-$(nproc)}"
