#!/usr/bin/env bash
# The Python checks (.ci/run's stage pycheck): pyflakes over the package, its tests, examples/
# and bench/ (but protoc's generated stubs), then mypy over the package with
# client/python/mypy.ini (which says what it leaves out). Both run, each printing its findings;
# the exit status is 1 when either found anything. Needs no build. Debian's pyflakes3 and mypy
# are installed first when missing.
#   usage: check_python.sh
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh --only pyflakes3 mypy

# Left out of pyflakes, each with its reason:
#   bench/torch_gpu_baseline.py: pyflakes takes the `del params, grads` and `del opt` in run()
#     to make those names undefined in bf16_step(), a closure that runs only before them (a
#     false "undefined name").
excluded=(bench/torch_gpu_baseline.py)
files=()
while IFS= read -r -d '' f; do
  [[ " ${excluded[*]} " == *" $f "* ]] || files+=("$f")
done < <(find client/python/fusedps client/python/tests examples bench \
  -path client/python/fusedps/v1 -prune -o -name '*.py' -print0 | sort -z)

status=0
echo "check_python: pyflakes3 over ${#files[@]} files"
pyflakes3 "${files[@]}" || status=1
echo "check_python: mypy over client/python/fusedps"
(cd client/python && mypy --config-file mypy.ini -p fusedps) || status=1
((status == 0)) && echo "check_python: no findings" || echo "check_python: FAILED" >&2
exit "$status"
