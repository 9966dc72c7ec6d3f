#!/usr/bin/env bash
# Configures and builds into ${BUILD_DIR:-build} (CUDA code too where nvcc exists): everything, or
# the targets named. $SETUP_ARGS go to scripts/setup.sh (deploy/docker's build stages:
# SETUP_ARGS=--server scripts/build.sh fusedps-server fusedps). FUSEDPS_CUDA and
# FUSEDPS_DEBUG_INFO (ON, or OFF: no -g) go to CMake.
#   usage: build.sh [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC2086  # one option per word
scripts/setup.sh ${SETUP_ARGS:-}
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -DFUSEDPS_CUDA="${FUSEDPS_CUDA:-AUTO}" \
  -DFUSEDPS_DEBUG_INFO="${FUSEDPS_DEBUG_INFO:-ON}" >/dev/null
targets=()
(($#)) && targets=(--target "$@")
cmake --build "$build" -j"${JOBS:-$(nproc)}" "${targets[@]}"
