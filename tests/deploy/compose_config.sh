#!/usr/bin/env bash
# Checks deploy/compose/docker-compose.yml with `docker-compose config` (Debian's docker-compose,
# or the `docker compose` plugin where that is what exists) and writes the resolved file to
# OUTDIR/compose.yaml; then its Prometheus configuration with `promtool check config`, with the
# rules folder that compose mounts (deploy/prometheus/rules). Needs no Docker engine.
#   usage: compose_config.sh OUTDIR
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: compose_config.sh OUTDIR}
mkdir -p "$out"
if command -v docker-compose >/dev/null; then
  compose=(docker-compose)
elif docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
else
  echo "compose: docker-compose is not installed (Debian: apt-get install docker-compose)" >&2
  exit 1
fi
echo "compose: $("${compose[@]}" version 2>/dev/null | head -n1)"
"${compose[@]}" -f "$root/deploy/compose/docker-compose.yml" config -q
"${compose[@]}" -f "$root/deploy/compose/docker-compose.yml" config >"$out/compose.yaml"
echo "compose: deploy/compose/docker-compose.yml is valid; services:" \
  "$("${compose[@]}" -f "$root/deploy/compose/docker-compose.yml" config --services | tr '\n' ' ')"
# The test stack of `make test-deploy`: the same file with its override.
test_stack=(-f "$root/deploy/compose/docker-compose.yml"
  -f "$root/deploy/compose/docker-compose.test.yml")
"${compose[@]}" "${test_stack[@]}" config -q
echo "compose: with docker-compose.test.yml, valid; services:" \
  "$("${compose[@]}" "${test_stack[@]}" config --services | tr '\n' ' ')"

command -v promtool >/dev/null || {
  echo "compose: promtool is not installed (Debian: apt-get install prometheus)" >&2
  exit 1
}
# /etc/prometheus/rules in the container is deploy/prometheus/rules here.
mkdir -p "$out/compose-prometheus"
for config in prometheus.yml prometheus.test.yml; do
  sed "s|/etc/prometheus/rules/|$root/deploy/prometheus/rules/|" \
    "$root/deploy/compose/$config" >"$out/compose-prometheus/$config"
  promtool check config "$out/compose-prometheus/$config"
done
