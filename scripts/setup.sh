#!/usr/bin/env bash
# Installs fusedps's build and test dependencies from Debian 12's packages, only those missing.
# Used by `make`, .ci/run and deploy/docker, so that all of them install the same set.
#   --server   only what building the server and the CLI needs (deploy/docker's build stages:
#              no Python, no test tools)
#   --fuzz     adds what scripts/fuzz.sh needs: clang-14, its libFuzzer and sanitizer
#              runtimes, libomp
#   --deploy   adds what `make test-deploy` needs: the Docker engine and debootstrap
#   --print    prints the package names instead of installing them
#   --only PKG...  only these packages, the same way (the check scripts' tools: clang-format-14,
#              pyflakes3, mypy, clang-14)
set -euo pipefail
# What CMake needs to configure and build the server and the CLI (find_package at the top of
# CMakeLists.txt: the test frameworks too).
server_packages=(
  build-essential cmake make pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev libgoogle-glog-dev
  nlohmann-json3-dev libdeflate-dev zlib1g-dev libssl-dev
)
packages=(
  "${server_packages[@]}"
  # the security tests make their certificates with the openssl CLI
  openssl
  python3 python3-grpcio python3-protobuf python3-numpy python3-torch python3-sklearn
  python3-pytest
  # the Python package's install test (venv, pip, setuptools, wheel) and the GPT example's
  # corpus (the Jargon File)
  python3-venv python3-pip python3-setuptools python3-wheel jargon-text
  # deploy/ checks (tests/deploy): compose config, YAML, node for the schema validators
  docker-compose python3-yaml nodejs
  # metrics checks (tests/metrics): a live Prometheus server, promtool (and python3-yaml)
  prometheus
)
print=0
if [[ ${1:-} == --only ]]; then
  shift
  packages=("$@")
  set --
fi
for arg in "$@"; do
  case $arg in
    --server) packages=("${server_packages[@]}") ;;
    --fuzz) packages+=(clang-14 libclang-rt-14-dev libomp-14-dev) ;;
    --deploy) packages+=(docker.io debootstrap) ;;
    --print) print=1 ;;
    *) echo "usage: setup.sh [--server] [--fuzz] [--deploy] [--print] | --only PKG..." >&2
       exit 2 ;;
  esac
done
if ((print)); then printf '%s\n' "${packages[@]}"; exit 0; fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
((${#missing[@]})) || exit 0
echo "setup: installing ${missing[*]}" >&2
sudo=()
[[ $(id -u) == 0 ]] || sudo=(sudo)
"${sudo[@]}" apt-get update -qq
# Elsewhere than Debian (deploy/docker builds on NVIDIA's Ubuntu CUDA images), skip, with a
# warning, what that distribution lacks (e.g. python3-torch on Ubuntu 24.04): only the tests
# need those. On Debian every package is required.
if ! grep -qx 'ID=debian' /etc/os-release 2>/dev/null; then
  available=()
  for p in "${missing[@]}"; do
    if apt-cache show "$p" 2>/dev/null | grep -q '^Package:'; then
      available+=("$p")
    else
      echo "setup: $p is not available here; skipped" >&2
    fi
  done
  missing=("${available[@]}")
fi
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >&2
