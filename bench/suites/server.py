"""Suites of the server under load: pushes, pulls, TLS, shards, transport, the core's readers,
checkpoints."""

from typing import Any, Dict

from .common import GPT2_PUSH, GPU_SERVER, LATENCY_PUSH, MPS, PUSH

# The checkpoint suite's disk, measured with dd at the size of the newest checkpoint: buffered
# with fsync, then O_DIRECT; each dd summary line after a label (bench/suites/parsers.py, dd).
DD_SIZE = "mb=$(( $(du -sb $(ls -d {ckpt_dir}/checkpoint-* | tail -1) | cut -f1) / 1048576 + 1 ))"
DD_WRITES = ("echo write-fsync $(dd if=/dev/zero of={ckpt_dir}/dd.bin bs=1M count=$mb conv=fsync"
             " 2>&1 | tail -1); rm -f {ckpt_dir}/dd.bin; sleep 2; echo write-direct $(dd"
             " if=/dev/zero of={ckpt_dir}/dd.bin bs=64M count=$((mb / 64 + 1)) oflag=direct"
             " conv=fsync 2>&1 | tail -1)")
# Drops the page cache of every file under a folder (written back first; no root needed).
DROP_CACHE = "sync; find {ckpt_dir} -type f -exec dd if={} iflag=nocache count=0 status=none \\;"
DD_READ = "echo read $(dd if={ckpt_dir}/dd.bin of=/dev/null bs=1M 2>&1 | tail -1)"

SUITES: Dict[str, Dict[str, Any]] = {
    "push": {
        "about": "one GPU: GPT-2 small bf16 pushes and 1M-parameter latency from fusedps-bench "
                 "to fusedps-server, the gRPC sink (the ceiling) and the torch peer",
        "defaults": {"device": "cuda:0", "peer_device": "cuda", "warmup_steps": 1, "scale": 1,
                     "duration": "8s", "latency_steps": 200, "client_flags": ""},
        "servers": {
            "fusedps": GPU_SERVER,
            "sink": "{bin:fusedps-grpc-sink}",
            "peer": "{python} bench/peers/torch_peer.py --device={peer_device} --max-workers=320",
        },
        "steps": [
            {"kind": "push", "run": GPT2_PUSH, "parse": "json", "servers": ["{server}"],
             "timeout": 120, "params": {"server": ["fusedps", "sink", "peer"], "streams": [1],
                                        "clients": [1, 4, 16]}},
            {"kind": "push-latency", "run": LATENCY_PUSH, "parse": "json", "servers": ["{server}"],
             "timeout": 120, "params": {"server": ["fusedps", "sink", "peer"]}},
        ],
    },
    "pull": {
        "about": "one GPU: the fusedps CLI pulling GPT-2 small's params into a safetensors file "
                 "from fusedps-server and from the torch peer, fp32 and bf16, 1 and 8 streams",
        "defaults": {"device": "cuda:0", "peer_device": "cuda", "scale": 1},
        "servers": {
            "fusedps": GPU_SERVER,
            "peer": "{python} bench/peers/torch_peer.py --device={peer_device} --max-workers=64",
        },
        "steps": [
            {"kind": "register", "record": False, "parse": "wall", "servers": ["{server}"],
             "run": "{bin:fusedps-bench} --target={target} --model=gpt2 --scale={scale}"
                    " --steps=1 --warmup-steps=0",
             "params": {"server": ["fusedps", "peer"]}},
            {"kind": "pull", "parse": "wall", "servers": ["{server}"],
             "run": "{bin:fusedps} --target={target} --streams={streams} --dtype={dtype} pull"
                    " --out={out}/pull.safetensors",
             # The file holds every value as fp32 after a small header.
             "size_of": "{out}/pull.safetensors",
             "derive": {"payload_mb_per_s": "file_bytes / 4 * (2 if dtype == 'bf16' else 4)"
                                            " / seconds_median / 1e6"},
             "params": {"server": ["fusedps", "peer"], "dtype": ["fp32", "bf16"],
                        "streams": [1, 8], "reps": [5]}},
        ],
    },
    "tls": {
        "about": "one GPU: what TLS and mTLS cost a push (GPT-2 small bf16, 1M latency), three "
                 "servers alike but for the gRPC port's security, interleaved in rounds",
        "defaults": {"device": "cuda:0", "warmup_steps": 1, "scale": 1, "duration": "8s",
                     "latency_steps": 300},
        "servers": {
            "plain": GPU_SERVER,
            "tls": GPU_SERVER + " --tls-cert={certs}/server.crt --tls-key={certs}/server.key",
            "mtls": GPU_SERVER + " --tls-cert={certs}/server.crt --tls-key={certs}/server.key"
                                 " --tls-client-ca={certs}/ca.crt",
        },
        "steps": [
            {"kind": "push", "run": GPT2_PUSH, "parse": "json", "servers": ["{server}"],
             "timeout": 150,
             "params": {"round": [1, 2], "server": ["plain", "tls", "mtls"], "streams": [1],
                        "clients": [1, 16]}},
            {"kind": "push-latency", "run": LATENCY_PUSH, "parse": "json",
             "servers": ["{server}"], "timeout": 150,
             "params": {"round": [1, 2], "server": ["plain", "tls", "mtls"]}},
        ],
        # The clients' flags, chosen by the step's `server` param.
        "lookups": {"client_flags": {"key": "server", "values": {
            "plain": "",
            "tls": "--tls-ca={certs}/ca.crt",
            "mtls": "--tls-ca={certs}/ca.crt --tls-cert={certs}/bench-client.crt"
                    " --tls-key={certs}/bench-client.key",
        }}},
    },
    "shards": {
        "about": "two GPUs: GPT-2 small pushes from 16 clients through fusedps-bench's "
                 "ShardedClient to 1 shard against 2, fresh servers per run; then sync rounds "
                 "on 2 shards, their time split from the servers' metrics",
        "defaults": {"device_a": "cuda:0", "device_b": "cuda:1", "warmup_steps": 1, "scale": 1,
                     "duration": "20s", "clients": 16,
                     # Commands before each shard and the bench, e.g. "taskset -c 0-7": each
                     # shard on cores of its own, as on a host of its own.
                     "pin_a": "", "pin_b": "", "pin_bench": "",
                     "mode_flags": "", "client_flags": ""},
        "servers": {
            "a": "{pin_a} " + GPU_SERVER.replace("{device}", "{device_a}") + " {mode_flags}",
            "b": "{pin_b} " + GPU_SERVER.replace("{device}", "{device_b}") + " {mode_flags}",
        },
        "steps": [
            {"kind": "shards", "fresh": True, "timeout": 300, "parse": "json",
             "servers": ["{shard_servers}"],
             "run": "{pin_bench} " + PUSH.replace("--target={target}", "--targets={targets}") +
                    " --model=gpt2 --scale={scale} --dtype=bf16 --clients={clients}"
                    " --duration={duration}",
             "params": {"round": [1, 2], "shard_servers": ["a", "a b"], "mode": ["async"]}},
            {"kind": "shards", "fresh": True, "timeout": 300, "parse": "json",
             "servers": ["a", "b"],
             "run": "{pin_bench} " + PUSH.replace("--target={target}", "--targets={targets}") +
                    " --model=gpt2 --scale={scale} --dtype=bf16 --clients={clients}"
                    " --duration={duration}",
             "params": {"round": [1], "shard_servers": ["a b"], "mode": ["sync"],
                        "mode_flags": ["--mode=sync --total-replicas={clients}"
                                       " --round-timeout-seconds=5"]}},
        ],
    },
    "transport": {
        "about": "one GPU: one trainer's gRPC push and pull GB/s (1 and 8 streams) against raw "
                 "loopback TCP, fp32 and bf16; part `tuning`: under FUSEDPS_GRPC_ARGS settings",
        "defaults": {"device": "cuda:0", "mps": 0, "tuning_flags": ""},
        "setup": [MPS],
        "parts": ["transport"],
        "servers": {
            "fusedps": GPU_SERVER + " --param-copy-dtype=bf16",
            # Server and client alike get the setting (common/grpc_args.h).
            "tuning": "env FUSEDPS_GRPC_ARGS={grpc_args} " + GPU_SERVER +
                      " --max-message-bytes=16777216",
        },
        "steps": [
            {"kind": "transport", "parse": "transport", "servers": ["fusedps"], "timeout": 300,
             "part": "transport",
             "run": "{bin:fusedps-transport-bench} --target={target} --mib=256 --streams=1,8"
                    " --iters=5 --dtype={dtype} --prefix=t-{dtype}/",
             "params": {"dtype": ["fp32", "bf16"]}},
            # name=int pairs; commas in a --set value as "\,".
            {"kind": "transport", "parse": "transport", "servers": ["tuning"], "fresh": True,
             "part": "tuning", "timeout": 200,
             "run": "env FUSEDPS_GRPC_ARGS={grpc_args} {bin:fusedps-transport-bench}"
                    " --target={target} --mib=256 --streams=1,8 --iters=4 {tuning_flags}",
             "params": {"grpc_args": [""]}},
        ],
    },
    "core": {
        "about": "one GPU: the server's readers under load: GetInfo and a 1 MB pull (the "
                 "reader probe of fusedps-bench) while one client pushes GPT-2 small bf16 in 1 "
                 "or 8 parts (0: no pushes, the host's floor); back-to-back pushes of 10,000 x 1K",
        "defaults": {"device": "cuda:0", "scale": 1, "warmup_steps": 2, "client_flags": "",
                     "probe_interval": "5ms", "probe_seconds": 10,
                     # The pusher starts 2 s before the probe and ends after it.
                     "push_seconds": 13, "duration": "10s",
                     # e.g. "taskset -c 0-9", "taskset -c 10-13", "taskset -c 14-15": the load
                     # generator cannot starve the server or the probe.
                     "pin_server": "", "pin_push": "", "pin_probe": ""},
        "servers": {"readers": "{pin_server} " + GPU_SERVER, "small": "{pin_server} " + GPU_SERVER},
        "parts": ["readers", "small"],
        "steps": [
            {"kind": "register", "record": False, "parse": "wall", "servers": ["readers"],
             "part": "readers",
            
             "run": "{bin:fusedps-bench} --target={target} --model=gpt2 --scale={scale}"
                    " --dtype=bf16 --steps=1 --warmup-steps=0"},
            {"kind": "readers", "parse": "json", "servers": ["readers"], "timeout": 120,
             "part": "readers",
             "run": "{pin_probe} {bin:fusedps-bench} --json --target={target} --clients=0"
                    " --model=gpt2 --scale={scale} --register=false"
                    " --probe-interval={probe_interval} --duration={probe_seconds}s",
             "background": {
                 "when": "streams > 0", "lead": 2, "parse": "json", "key": "push",
                 "run": "{pin_push} {bin:fusedps-bench} --json --warmup-steps={warmup_steps}"
                        " --target={target} --model=gpt2 --scale={scale} --dtype=bf16"
                        " --register=false --clients=1 --streams={streams}"
                        " --duration={push_seconds}s"},
             "params": {"streams": [0, 1, 8]}},
            {"kind": "push", "parse": "json", "servers": ["small"], "timeout": 200,
             "part": "small",
             "run": PUSH + " --model=t10000x1k --dtype=bf16 --clients={clients}"
                           " --duration={duration}",
             "params": {"model": ["t10000x1k"], "clients": [1, 4]}},
        ],
    },
    "checkpoint": {
        "about": "one GPU: GPT-2 small pushes to a server that checkpoints every 10 s and to one "
                 "that does not, alternating; each checkpoint's snapshot and write (the server's "
                 "log); dd on the same disk under the load and idle; the restore, cache dropped",
        "defaults": {"device": "cuda:0", "scale": 1, "warmup_steps": 1, "client_flags": "",
                     "clients": 16, "streams": 8, "duration": "30s", "interval": 10,
                     # The disk measured; emptied first.
                     "ckpt_dir": "{out}/checkpoints",
                     # dd starts load_lead seconds into a load of load_duration.
                     "load_duration": "40s", "load_lead": 12},
        "setup": [{"name": "checkpoint-dir", "run": "sh -c 'rm -rf {ckpt_dir} && mkdir -p"
                                                   " {ckpt_dir}'"}],
        "servers": {
            "on": GPU_SERVER + " --checkpoint-dir={ckpt_dir}"
                               " --checkpoint-interval-seconds={interval}",
            "off": GPU_SERVER,
            # Restores the newest checkpoint at start; killed without one more.
            "restore": "{bin:fusedps-server} --device={device} --metrics-listen="
                       " --checkpoint-dir={ckpt_dir} --checkpoint-on-sigterm=false",
        },
        "steps": [
            {"kind": "checkpoint-push", "parse": "json", "servers": ["{server}"], "timeout": 300,
             "run": GPT2_PUSH, "alternate": True,
             "params": {"round": [1, 2], "server": ["off", "on"]}},
            {"kind": "disk", "parse": "dd", "servers": ["off"], "timeout": 300,
             "run": "sh -c '" + DD_SIZE + "; " + DD_WRITES + "; rm -f {ckpt_dir}/dd.bin'",
             "background": {"lead": "{load_lead}", "parse": "json", "key": "push",
                            "run": GPT2_PUSH.replace("{duration}", "{load_duration}")},
             "params": {"load": ["push"]}},
            # Both stopped first: the server's log then holds its checkpoint on exit too.
            {"kind": "checkpoint-log", "parse": "checkpoint-log", "stop": ["on", "off"],
             "run": "cat {out}/server_on.log"},
            {"kind": "drop-cache", "record": False, "parse": "wall",
             "run": "sh -c '" + DROP_CACHE + "'"},
            {"kind": "checkpoint-log", "parse": "checkpoint-log", "servers": ["restore"],
             "fresh": True, "run": "cat {out}/server_restore.log"},
            {"kind": "disk", "parse": "dd",
             "run": "sh -c '" + DD_SIZE + "; " + DD_WRITES + "; " +
                    DROP_CACHE.replace("find {ckpt_dir} -type f", "find {ckpt_dir}/dd.bin") +
                    "; " + DD_READ + "; rm -f {ckpt_dir}/dd.bin'",
             "params": {"load": ["idle"]}},
        ],
    },
}
