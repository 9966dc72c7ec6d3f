#!/usr/bin/env bash
# `make demo`: builds fusedps, starts a server, trains a small MLP on scikit-learn's digits
# through it (examples/train_digits.py; extra arguments go to it), then stops the server with
# SIGTERM and checks that it exits cleanly.
#   FUSEDPS_DEVICE=auto|cpu|cuda:N   the server's backend (default auto: a GPU when there is one)
#   BUILD_DIR (default build), PYTHON (default /usr/bin/python3)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
python=${PYTHON:-/usr/bin/python3}

scripts/build.sh

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fusedps-demo.XXXXXX")
log=$tmp/server.log
server_pid=
cleanup() {
  local rc=$?
  if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
    echo "demo: stopping the server (pid $server_pid) after a failure" >&2
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  if ((rc != 0)) && [[ -s $log ]]; then
    echo "demo: server log (last 40 lines):" >&2
    tail -n 40 "$log" >&2
  fi
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$build/server/fusedps-server" --listen=127.0.0.1:0 --port-file="$tmp/port" \
  --metrics-listen=127.0.0.1:0 --device="${FUSEDPS_DEVICE:-auto}" >"$log" 2>&1 &
server_pid=$!

for ((i = 0; i < 300; i++)); do
  [[ -s $tmp/port ]] && break
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "demo: the server exited before serving" >&2
    exit 1
  fi
  sleep 0.1
done
if [[ ! -s $tmp/port ]]; then
  echo "demo: the server wrote no port file within 30 s" >&2
  exit 1
fi
port=$(<"$tmp/port")
target=127.0.0.1:${port//[$'\r\n ']/}
echo "demo: fusedps-server (pid $server_pid) serving on $target"

PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH} "$python" examples/train_digits.py \
  --target "$target" "$@"

kill -TERM "$server_pid"
status=0
wait "$server_pid" || status=$?
server_pid=
if ((status != 0)); then
  echo "demo: fusedps-server exited with $status after SIGTERM (expected 0)" >&2
  exit 1
fi
echo "demo: server stopped cleanly (exit 0)"
