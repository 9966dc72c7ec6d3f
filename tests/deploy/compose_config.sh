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

command -v promtool >/dev/null || {
  echo "compose: promtool is not installed (Debian: apt-get install prometheus)" >&2
  exit 1
}
# /etc/prometheus/rules in the container is deploy/prometheus/rules here.
mkdir -p "$out/compose-prometheus"
sed "s|/etc/prometheus/rules/|$root/deploy/prometheus/rules/|" \
  "$root/deploy/compose/prometheus.yml" >"$out/compose-prometheus/prometheus.yml"
promtool check config "$out/compose-prometheus/prometheus.yml"
