#!/usr/bin/env bash
# Builds everything and runs every test: unit, integration (gRPC on loopback), end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j"${JOBS:-$(nproc)}" "$@"
