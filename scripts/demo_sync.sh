#!/usr/bin/env bash
# `make demo-sync`: builds fusedps, starts 2 servers in sync mode (--total-replicas=4), trains
# the digits MLP with 4 worker processes through them, the model sharded over the two
# (examples/train_digits_sync.py; extra arguments go to it), then stops the servers with SIGTERM
# and checks that they exit cleanly.
#   FUSEDPS_DEVICE=auto|cpu|cuda:N   the servers' backend (default auto: a GPU when there is one)
#   BUILD_DIR (default build), PYTHON (default /usr/bin/python3)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
python=${PYTHON:-/usr/bin/python3}
shards=2
workers=4

scripts/build.sh

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fusedps-demo-sync.XXXXXX")
server_pids=()
cleanup() {
  local rc=$?
  for i in "${!server_pids[@]}"; do
    if kill -0 "${server_pids[$i]}" 2>/dev/null; then
      echo "demo-sync: stopping server $i (pid ${server_pids[$i]}) after a failure" >&2
      kill -TERM "${server_pids[$i]}" 2>/dev/null || true
      wait "${server_pids[$i]}" 2>/dev/null || true
    fi
    if ((rc != 0)) && [[ -s $tmp/server$i.log ]]; then
      echo "demo-sync: server $i log (last 20 lines):" >&2
      tail -n 20 "$tmp/server$i.log" >&2
    fi
  done
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start_server I: starts server I in the background; prints its "127.0.0.1:PORT" once serving.
start_server() {
  local i=$1 pid
  "$build/server/fusedps-server" --listen=127.0.0.1:0 --port-file="$tmp/port$i" \
    --metrics-listen=127.0.0.1:0 --device="${FUSEDPS_DEVICE:-auto}" \
    --mode=sync --total-replicas="$workers" >"$tmp/server$i.log" 2>&1 &
  pid=$!
  server_pids[i]=$pid
  for ((t = 0; t < 300; t++)); do
    [[ -s $tmp/port$i ]] && break
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "demo-sync: server $i exited before serving" >&2
      return 1
    fi
    sleep 0.1
  done
  if [[ ! -s $tmp/port$i ]]; then
    echo "demo-sync: server $i wrote no port file within 30 s" >&2
    return 1
  fi
  local port
  port=$(<"$tmp/port$i")
  echo "127.0.0.1:${port//[$'\r\n ']/}"
}

targets=()
for ((i = 0; i < shards; i++)); do
  start_server "$i" >"$tmp/target$i"
  targets+=("$(<"$tmp/target$i")")
  echo "demo-sync: fusedps-server $i (pid ${server_pids[$i]}) serving on ${targets[$i]}," \
    "sync rounds of $workers"
done

PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH} "$python" examples/train_digits_sync.py \
  --targets "$(IFS=,; echo "${targets[*]}")" --workers "$workers" "$@"

failed=0
for i in "${!server_pids[@]}"; do
  kill -TERM "${server_pids[$i]}"
  status=0
  wait "${server_pids[$i]}" || status=$?
  if ((status != 0)); then
    echo "demo-sync: server $i exited with $status after SIGTERM (expected 0)" >&2
    failed=1
  fi
done
server_pids=()
((failed == 0)) || exit 1
echo "demo-sync: servers stopped cleanly (exit 0)"
