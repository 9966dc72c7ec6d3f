#!/usr/bin/env bash
# Makes the base images that deploy/docker's Dockerfiles build on where no image registry can be
# reached, from Debian's own packages: no `docker pull`, no BuildKit frontend.
#
#   deploy/docker/base-image.sh           fusedps-debian:12, Debian 12 (bookworm) made with
#                                         `debootstrap --variant=minbase` and `docker import`,
#                                         configured as Docker's debian:12-slim is (below)
#   deploy/docker/base-image.sh --cuda    also fusedps-cuda-devel:13.0: that base plus the CUDA
#                                         toolkit of this machine ($CUDA_HOME, /usr/local/cuda),
#                                         the compiler and the static runtime, not the math
#                                         libraries; the devel stage of deploy/docker/Dockerfile
#   --rebuild                             makes them again even when they exist
#
# Cached by name: an image that exists is kept (`docker image inspect`), so a second run takes a
# second. The published images build on the upstream bases instead (debian:12-slim,
# nvidia/cuda), the Dockerfiles' defaults; docs/operations.md, "Images", has both commands.
#
# Needs root (debootstrap), a running Docker engine, and debootstrap (Debian: apt-get install
# debootstrap; scripts/setup.sh --deploy). DEBIAN_MIRROR picks the mirror (deb.debian.org).
# Prints the names of the images it made or kept, one per line.
set -euo pipefail
cuda=0 rebuild=0
for arg in "$@"; do
  case $arg in
    --cuda) cuda=1 ;;
    --rebuild) rebuild=1 ;;
    *) echo "usage: base-image.sh [--cuda] [--rebuild]" >&2; exit 2 ;;
  esac
done
DEBIAN_IMAGE=${DEBIAN_IMAGE:-fusedps-debian:12}
CUDA_DEVEL_IMAGE=${CUDA_DEVEL_IMAGE:-fusedps-cuda-devel:13.0}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
cuda_home=${CUDA_HOME:-/usr/local/cuda}

exists() { ((rebuild == 0)) && docker image inspect "$1" >/dev/null 2>&1; }
work=$(mktemp -d /tmp/fusedps-base.XXXXXX)
trap 'rm -rf "$work"' EXIT

if exists "$DEBIAN_IMAGE"; then
  echo "base-image: $DEBIAN_IMAGE exists; kept (--rebuild makes it again)" >&2
else
  command -v debootstrap >/dev/null || {
    echo "base-image: debootstrap is not installed (apt-get install debootstrap)" >&2
    exit 1
  }
  root=$work/rootfs
  echo "base-image: debootstrap --variant=minbase bookworm from $mirror" >&2
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -20 "$work/debootstrap.log" >&2
    exit 1
  }
  # As debian:12-slim: the release, its updates and the security archive; no documentation,
  # manual pages or translations (dpkg leaves them out of every later apt-get install too, but
  # keeps the copyright files); no package lists or downloaded packages in the image.
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
EOF
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "$root"/usr/share/{man,groff,info,lintian,linda,locale}/* \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log \
    "$root/debootstrap"
  created=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  tar -C "$root" --numeric-owner -c . | docker import \
    --change 'CMD ["bash"]' \
    --change "LABEL org.opencontainers.image.created=$created" \
    --change 'LABEL org.opencontainers.image.description="Debian 12 minbase (debootstrap)"' \
    - "$DEBIAN_IMAGE" >/dev/null
  echo "base-image: made $DEBIAN_IMAGE ($(docker image inspect -f '{{.Size}}' "$DEBIAN_IMAGE")" \
    "bytes)" >&2
fi
echo "$DEBIAN_IMAGE"

((cuda)) || exit 0
if exists "$CUDA_DEVEL_IMAGE"; then
  echo "base-image: $CUDA_DEVEL_IMAGE exists; kept" >&2
  echo "$CUDA_DEVEL_IMAGE"
  exit 0
fi
[[ -x $cuda_home/bin/nvcc ]] || {
  echo "base-image: no nvcc at $cuda_home/bin/nvcc (set CUDA_HOME)" >&2
  exit 1
}
toolkit=$(readlink -f "$cuda_home")
version=$("$toolkit/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
# What nvcc, CMake's FindCUDAToolkit and our build use: the compiler (bin, nvvm), the headers,
# the static runtime, CUPTI (the tests' kernel counter, which CMake configures) and the driver
# stubs. Not the math and communication libraries (cuBLAS, cuDNN, NCCL...: 2.5 GB here).
context=$work/cuda
mkdir -p "$context/toolkit/lib"
ln -s lib "$context/toolkit/lib64"
cp -a "$toolkit"/{bin,nvvm,include} "$context/toolkit/"
[[ -d $toolkit/targets ]] && cp -a "$toolkit/targets" "$context/toolkit/"
for lib in libcudart_static.a libcudadevrt.a libculibos.a 'libcudart.so*' 'libcupti.so*' \
  stubs cmake; do
  # shellcheck disable=SC2086  # the globs above
  cp -a "$toolkit"/lib64/$lib "$context/toolkit/lib/"
done
cat >"$context/Dockerfile" <<EOF
FROM $DEBIAN_IMAGE
COPY toolkit /usr/local/cuda-$version
RUN ln -s cuda-$version /usr/local/cuda
ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    CUDA_HOME=/usr/local/cuda
LABEL org.opencontainers.image.description="$DEBIAN_IMAGE with the CUDA $version toolkit of \
the build machine (compiler, headers, static runtime)"
EOF
echo "base-image: $CUDA_DEVEL_IMAGE from $toolkit ($(du -sh "$context/toolkit" | cut -f1))" >&2
DOCKER_BUILDKIT=0 docker build -q -t "$CUDA_DEVEL_IMAGE" "$context" >/dev/null
echo "$CUDA_DEVEL_IMAGE"
