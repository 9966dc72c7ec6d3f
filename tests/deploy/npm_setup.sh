#!/usr/bin/env bash
# Installs the node packages of tests/deploy (package-lock.json, from the npm registry) into
# WORKDIR/node_modules, again only when the lock file changes, and copies the .mjs checks beside
# them so that their imports resolve there.
#   usage: npm_setup.sh WORKDIR
set -euo pipefail
src=$(cd "$(dirname "$0")" && pwd)
work=${1:?usage: npm_setup.sh WORKDIR}
for tool in node npm; do
  command -v "$tool" >/dev/null || {
    echo "deploy tests: $tool not found; install Node.js with npm (Debian: apt-get install nodejs npm)" >&2
    exit 1
  }
done
mkdir -p "$work"
cp "$src"/*.mjs "$work/"
stamp=$work/node_modules/.fusedps-package-lock.sha256
want=$(sha256sum "$src/package-lock.json" | cut -d' ' -f1)
if [[ -f $stamp && $(<"$stamp") == "$want" ]]; then
  echo "deploy tests: node packages in $work/node_modules are current (node $(node --version))"
  exit 0
fi
cp "$src/package.json" "$src/package-lock.json" "$work/"
echo "deploy tests: installing node packages from the npm registry into $work/node_modules:" \
  "kubernetes-models, @kubernetes-models/prometheus-operator, @kubernetes-models/cert-manager," \
  "dockerfile-utils, yaml (npm ci)"
# kubernetes-models 5 declares node >= 22; it runs on node 20 (as here), so npm's engine
# warnings are left out of the log.
(cd "$work" && npm ci --no-audit --no-fund --loglevel=error)
echo "$want" >"$stamp"
echo "deploy tests: installed $(ls "$work/node_modules" | wc -l) packages (node $(node --version))"
