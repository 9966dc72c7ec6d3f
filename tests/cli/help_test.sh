#!/usr/bin/env bash
# Checks a program's --help: exit 0, its own flags listed as the README spells them, and
# --helpfull honoured when --help offers it.
#   help_test.sh PROGRAM [--expect=TEXT]... [--reject=TEXT]...
# Runs PROGRAM --help and PROGRAM -h. Always rejected: absl's "No flags matched".
set -euo pipefail
program=$1
shift
expect=()
reject=("No flags matched")
for arg in "$@"; do
  case $arg in
    --expect=*) expect+=("${arg#--expect=}") ;;
    --reject=*) reject+=("${arg#--reject=}") ;;
    *) echo "help_test: unknown argument $arg" >&2; exit 2 ;;
  esac
done

failed=0
for help in --help -h; do
  status=0
  output=$("$program" "$help" 2>&1) || status=$?
  if ((status != 0)); then
    echo "FAIL: $program $help exited $status" >&2
    failed=1
  fi
  for text in "${expect[@]}"; do
    if ! grep -qF -- "$text" <<<"$output"; then
      echo "FAIL: $program $help does not mention $text" >&2
      failed=1
    fi
  done
  for text in "${reject[@]}"; do
    if grep -qF -- "$text" <<<"$output"; then
      echo "FAIL: $program $help mentions $text" >&2
      failed=1
    fi
  done
done
# A --help that offers --helpfull must honour it: absl prints every library's flags (and exits 1).
if grep -qF -- "--helpfull" <<<"$output"; then
  full=$("$program" --helpfull 2>&1) || true
  if grep -qF -- "unknown flag" <<<"$full" || ! grep -qF -- "--flagfile" <<<"$full"; then
    echo "FAIL: $program --helpfull does not list absl's flags: ${full:0:200}" >&2
    failed=1
  fi
fi
if ((failed)); then
  printf '%s --help printed:\n%s\n' "$program" "$output" >&2
  exit 1
fi
echo "ok: $program --help and -h"
