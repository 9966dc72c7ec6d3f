#!/usr/bin/env bash
# Builds what a GPU machine without the build's libraries needs and packs it into .device-pack
# with the workplace's device-pack tool (DEVICE_PACK, default ../shared/tools/device-pack): the
# CUDA fusedps-server, the fusedps CLI, the benchmarks (fusedps-bench, fusedps-kernel-bench,
# fusedps-gpt-fit, fusedps-transport-bench, fusedps-grpc-sink), the GPU tests
# (cuda_backend_test, cpu_backend_test, models_test, metrics_cupti_test), the native transport
# (libfusedps_c.so), each stripped, with the shared libraries a bare GPU machine lacks; the
# Python package in .device-pack/python; the TLS test certificates in .device-pack/certs; the
# GPT examples' corpus (Debian's jargon-text) as .device-pack/jargon.txt.gz. Then carry
# .device-pack to the device and, from the repository root there, run
# `bench/run.py SUITE --pack .device-pack --out results.json` (the benchmarks) or
# `scripts/device_tests.sh --pack .device-pack` (the GPU tests).
set -euo pipefail
cd "$(dirname "$0")/.."
tests=(cuda_backend_test cpu_backend_test models_test metrics_cupti_test)
scripts/build.sh fusedps-server fusedps fusedps-bench fusedps-kernel-bench fusedps-gpt-fit \
  fusedps-transport-bench fusedps-grpc-sink fusedps-table-bench fusedps_c fusedps_python \
  "${tests[@]}"
build=${BUILD_DIR:-build}
rm -rf .device-pack
"${DEVICE_PACK:-../shared/tools/device-pack}" .device-pack "$build/server/fusedps-server" \
  "$build/client/fusedps" "$build/bench/fusedps-bench" "$build/bench/fusedps-kernel-bench" \
  "$build/bench/fusedps-gpt-fit" "$build/bench/fusedps-transport-bench" \
  "$build/bench/peers/fusedps-grpc-sink" "$build/bench/fusedps-table-bench" \
  "$build/python/fusedps/libfusedps_c.so" \
  "$build/kernels/cuda_backend_test" "$build/kernels/cpu_backend_test" \
  "$build/tests/models_test" "$build/tests/metrics_cupti_test"
strip .device-pack/bin/*
strip --strip-unneeded .device-pack/lib/* 2>/dev/null || true
mkdir -p .device-pack/python
cp -r "$build/python/fusedps" .device-pack/python/
rm -f .device-pack/python/fusedps/libfusedps_c.so  # FUSEDPS_NATIVE_LIB names bin/'s.
bash tests/integration/make_test_certs.sh .device-pack/certs >/dev/null
cp /usr/share/doc/jargon-text/jargon.txt.gz .device-pack/
du -sh .device-pack
