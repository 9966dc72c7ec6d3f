#!/usr/bin/env bash
# Renders deploy/k8s's base and each overlay with `kubectl kustomize` (kustomize v5 inside
# kubectl), or `kustomize build` where only kustomize is installed, into OUTDIR/NAME.yaml.
#   usage: render.sh OUTDIR
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: render.sh OUTDIR}
mkdir -p "$out"
if command -v kubectl >/dev/null; then
  render=(kubectl kustomize)
  echo "render: $(kubectl version --client 2>/dev/null | tr '\n' ' ')"
elif command -v kustomize >/dev/null; then
  render=(kustomize build)
  echo "render: kustomize $(kustomize version 2>/dev/null)"
else
  echo "render: neither kubectl nor kustomize is installed; deploy/k8s needs kubectl >= 1.27" \
    "(kustomize v5) to render" >&2
  exit 1
fi
for target in base overlays/gpu overlays/cpu overlays/sharded-4 overlays/mtls; do
  name=$(basename "$target")
  "${render[@]}" "$root/deploy/k8s/$target" >"$out/$name.yaml"
  echo "render: deploy/k8s/$target -> $out/$name.yaml ($(grep -c '^kind:' "$out/$name.yaml") objects:" \
    "$(grep '^kind:' "$out/$name.yaml" | cut -d' ' -f2 | sort | tr '\n' ' '))"
done
