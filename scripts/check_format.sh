#!/usr/bin/env bash
# The C++ and CUDA format check (.ci/run's stage format): every tracked .cc, .h, .cu and .cuh
# file must be as clang-format-14 writes it with the tree's .clang-format. Prints each file that
# drifts with its diff, and exits 1 if any does. Needs no build; installs Debian's
# clang-format-14 first when missing. To fix: clang-format-14 -i FILE...
#   usage: check_format.sh
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh --only clang-format-14

mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
drift=0
for f in "${files[@]}"; do
  if ! clang-format-14 --style=file "$f" | diff -u --label "$f" --label "$f (clang-format)" \
      "$f" -; then
    drift=$((drift + 1))
  fi
done
if ((drift)); then
  echo "check_format: $drift of ${#files[@]} files drift from .clang-format" \
       "(fix: clang-format-14 -i FILE)" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files as .clang-format writes them"
