# Sourced by scripts/ab_push.sh and scripts/device_tests.sh, which run on the GPU machine from
# the repository root with a binary pack (scripts/pack_device.sh) carried. bench/run.py does
# the same for the benchmark suites.
# shellcheck shell=bash

# start_server NAME BINARY [FLAGS...]: BINARY (a packed fusedps-server build) in the background
# on 127.0.0.1, its port in /tmp/NAME.port, its log in $out/server_NAME.log, its PID in
# $server_pid. $SERVER_PREFIX (e.g. "taskset -c 0-9") goes before it. Returns 1, with the log's
# tail, when it writes no port within 30 s.
start_server() {
  local name=$1 binary=$2
  shift 2
  rm -f "/tmp/$name.port"
  # shellcheck disable=SC2154  # $out is the caller's log folder.
  ${SERVER_PREFIX:-} .device-pack/run "$binary" --listen=127.0.0.1:0 \
    --port-file="/tmp/$name.port" "$@" >"$out/server_$name.log" 2>&1 &
  # shellcheck disable=SC2034  # For the caller.
  server_pid=$!
  for _ in $(seq 1 120); do [[ -s /tmp/$name.port ]] && return 0; sleep 0.25; done
  echo "server $name did not start"; tail -5 "$out/server_$name.log"; return 1
}

# python_env [PACK]: the environment in which the Python package (PY_PATH, else build/python)
# and its tests run against the packed server and CLI of PACK (default .device-pack, under the
# current folder): wrappers for fusedps-server and fusedps, the native transport's library,
# FUSEDPS_SERVER and FUSEDPS_CLI.
python_env() {
  local here=$PWD pack=${1:-.device-pack} exe
  [[ $pack == /* ]] || pack=$here/$pack
  for exe in fusedps-server fusedps; do
    printf '#!/usr/bin/env bash\nexec "%s/run" %s "$@"\n' "$pack" "$exe" > "$pack/$exe-wrapper"
    chmod +x "$pack/$exe-wrapper"
  done
  export FUSEDPS_NATIVE_LIB=$pack/bin/libfusedps_c.so
  export LD_LIBRARY_PATH=$pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONPATH=${PY_PATH:-$here/build/python} PYTHONDONTWRITEBYTECODE=1
  export FUSEDPS_SERVER=$pack/fusedps-server-wrapper
  export FUSEDPS_CLI=$pack/fusedps-wrapper
}
