#!/usr/bin/env bash
# bad_flag_test.sh PROGRAM ARG...: PROGRAM with each ARG alone must exit 2 (a bad flag,
# docs/errors.md) and name the flag on stderr, where absl's own parser exits 1.
set -u
program=$1
shift
for arg in "$@"; do
  err=$("$program" "$arg" 2>&1 >/dev/null)
  status=$?
  name=${arg%%=*}
  name=${name#--}
  if [[ $status != 2 ]]; then
    echo "FAIL: $program $arg exited $status, not 2: $err"
    exit 1
  fi
  if [[ $err != *"${name//-/_}"* && $err != *"$name"* ]]; then
    echo "FAIL: $program $arg: the error does not name $name: $err"
    exit 1
  fi
done
echo "ok: $program exits 2 naming the flag for: $*"
