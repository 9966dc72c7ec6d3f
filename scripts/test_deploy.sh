#!/usr/bin/env bash
# `make test-deploy`: builds deploy/docker's images on the local Debian base and runs the compose
# test stack (tests/deploy/stack_test.py), on a machine with no image registry. In order:
#   1. Debian's docker.io and debootstrap (scripts/setup.sh --deploy), and a Docker engine:
#      dockerd is started (log in build-deploy/dockerd.log) when none answers;
#   2. the base images, cached by name (deploy/docker/base-image.sh; --cuda where this machine
#      has nvcc);
#   3. the images, with the classic builder (cached by its layers), side by side (logs in
#      build-deploy/image-<name>.log): the CPU server, Prometheus and the trainer through the
#      test compose file; where nvcc exists the CUDA server too, whose files are then copied out
#      of the image (`docker create` + `docker cp`) to build-deploy/cuda-image/ for a GPU
#      machine (docs/operations.md, "Images");
#   4. the stack test, which tears the stack down and checks that nothing is left behind.
# Image sizes go to build-deploy/images.txt. Exit status 0 only when every step passed.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=$repo/build-deploy
mkdir -p "$out"
scripts/setup.sh --deploy

if ! docker info >/dev/null 2>&1; then
  if [[ $(id -u) != 0 ]]; then
    echo "test-deploy: no Docker engine answers, and only root can start one" >&2
    exit 1
  fi
  echo "test-deploy: starting dockerd (log: $out/dockerd.log)"
  dockerd >"$out/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$out/dockerd.log" >&2; exit 1; }
fi

# timed LABEL COMMAND...: runs COMMAND and prints how long it took.
timed() {
  local label=$1 start=$SECONDS
  shift
  "$@"
  echo "test-deploy: $label took $((SECONDS - start)) s"
}

cuda=()
if [[ -x ${CUDA_HOME:-/usr/local/cuda}/bin/nvcc ]]; then cuda=(--cuda); fi
timed "base images" deploy/docker/base-image.sh "${cuda[@]}"

export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
compose=(docker-compose -p fusedps-test -f deploy/compose/docker-compose.yml
  -f deploy/compose/docker-compose.test.yml)
images=(fusedps:0.1.0-cpu fusedps-prometheus:2.42 fusedps-trainer:0.1.0)
build_cuda_image() {
  docker build -q --build-arg CUDA_DEVEL_IMAGE=fusedps-cuda-devel:13.0 \
    --build-arg CUDA_RUNTIME_IMAGE=fusedps-debian:12 -f deploy/docker/Dockerfile \
    -t fusedps:0.1.0-cuda . >/dev/null
}

# The images are built side by side, each one's output in build-deploy/image-<name>.log: their
# package downloads and installs (apt in every image, Debian's torch in the trainer's) then overlap
# with the server's compilation in the other images instead of waiting for it.
pids=()
names=()
# in_background NAME COMMAND...: runs COMMAND (timed) in the background.
in_background() {
  local name=$1
  shift
  timed "image of $name" "$@" >"$out/image-$name.log" 2>&1 &
  pids+=($!)
  names+=("$name")
}
for service in fusedps prometheus trainer; do
  in_background "$service" "${compose[@]}" build -q "$service"
done
if ((${#cuda[@]})); then
  in_background cuda build_cuda_image
  images+=(fusedps:0.1.0-cuda)
fi
failed=()
for i in "${!pids[@]}"; do
  status=0
  wait "${pids[$i]}" || status=$?
  if ((status != 0)); then
    tail -n 60 "$out/image-${names[$i]}.log" >&2
    echo "test-deploy: the image of ${names[$i]} FAILED (exit $status);" \
      "log: $out/image-${names[$i]}.log" >&2
    failed+=("${names[$i]}")
  else
    cat "$out/image-${names[$i]}.log"
  fi
done
((${#failed[@]} == 0)) || exit 1

if ((${#cuda[@]})); then
  # The image's files, for a GPU machine (no Docker engine there): bin/ and lib/ as in the image.
  rm -rf "$out/cuda-image"
  mkdir -p "$out/cuda-image"
  container=$(docker create fusedps:0.1.0-cuda)
  docker cp "$container:/usr/local/bin" "$out/cuda-image/bin"
  docker cp "$container:/usr/local/lib/fusedps" "$out/cuda-image/lib"
  docker rm "$container" >/dev/null
  # It loads, and has the CUDA backend: here, with no GPU, it stops at "no CUDA device" (a
  # server built without CUDA says that it was); on a GPU machine it serves until the timeout.
  status=0
  message=$(LD_LIBRARY_PATH=$out/cuda-image/lib timeout 5 "$out/cuda-image/bin/fusedps-server" \
    --device=cuda --listen=127.0.0.1:0 --metrics-listen= 2>&1) || status=$?
  if ((status != 124)) && ! grep -q "no CUDA device" <<<"$message"; then
    echo "test-deploy: the CUDA image's server does not start as one with CUDA:" >&2
    echo "$message" >&2
    exit 1
  fi
  echo "test-deploy: the CUDA image's server and CLI are in $out/cuda-image" \
    "($(du -sh "$out/cuda-image" | cut -f1))"
else
  echo "test-deploy: no nvcc here (CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}): the CUDA image" \
    "is not built"
fi

{
  printf '%-28s %10s\n' image "size (MB)"
  for image in fusedps-debian:12 "${images[@]}"; do
    docker image inspect -f '{{.Size}}' "$image" |
      awk -v i="$image" '{printf "%-28s %10.1f\n", i, $1 / 1e6}'
  done
} | tee "$out/images.txt"

/usr/bin/python3 tests/deploy/stack_test.py --project fusedps-test
