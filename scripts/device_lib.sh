# Sourced by the device scripts (scripts/device_*.sh, scripts/ab_push.sh), which run on the GPU
# machine from the repository root with .device-pack carried. Needs $out (the log folder).

# start_server NAME BINARY [FLAGS...]: BINARY (a packed fusedps-server build) in the background
# on 127.0.0.1, its port in /tmp/NAME.port, its log in $out/server_NAME.log, its PID in
# $server_pid. $SERVER_PREFIX (e.g. "taskset -c 0-9") goes before it. Returns 1, with the log's
# tail, when it writes no port within 30 s.
start_server() {
  local name=$1 binary=$2
  shift 2
  rm -f "/tmp/$name.port"
  ${SERVER_PREFIX:-} .device-pack/run "$binary" --listen=127.0.0.1:0 \
    --port-file="/tmp/$name.port" "$@" >"$out/server_$name.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 120); do [[ -s /tmp/$name.port ]] && return 0; sleep 0.25; done
  echo "server $name did not start"; tail -5 "$out/server_$name.log"; return 1
}

# python_env: the environment in which the Python package (PY_PATH, else build/python) and its
# tests run against the packed server and CLI: wrappers for fusedps-server and fusedps, the
# native transport's library, FUSEDPS_SERVER and FUSEDPS_CLI. From the repository root.
python_env() {
  local here=$PWD exe
  for exe in fusedps-server fusedps; do
    printf '#!/usr/bin/env bash\nexec "%s/.device-pack/run" %s "$@"\n' "$here" "$exe" \
      > ".device-pack/$exe-wrapper"
    chmod +x ".device-pack/$exe-wrapper"
  done
  export FUSEDPS_NATIVE_LIB=$here/.device-pack/bin/libfusedps_c.so
  export LD_LIBRARY_PATH=$here/.device-pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONPATH=${PY_PATH:-$here/build/python} PYTHONDONTWRITEBYTECODE=1
  export FUSEDPS_SERVER=$here/.device-pack/fusedps-server-wrapper
  export FUSEDPS_CLI=$here/.device-pack/fusedps-wrapper
}
