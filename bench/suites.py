"""The benchmark suites of bench/run.py, as data.

A suite is a dict:
  about    one line: what it measures and on what machine
  servers  optional {name: command template}: servers the steps push to, each started on
           127.0.0.1 port 0 (the driver adds --listen and --port-file); "metrics": servers whose
           template has {metrics_flags} are scraped (their /metrics) before and after each step
  steps    a list of steps, run in order

A step is a dict:
  kind     the step kind: report.py prints one table per kind
  run      the command template (a string: formatted, then split like a shell would)
  params   {name: [values]}: the step runs once per combination (the first name outermost);
           `bench/run.py SUITE --set name=v1,v2` replaces a list
  parse    how its stdout becomes metrics (bench/run.py, PARSERS): "json" (one JSON object),
           "json-rows:KEY" (one result per element of the object's KEY list), "transport"
           (fusedps-transport-bench's table), "wall" (the command's wall time over `reps`)
  servers  optional: the servers (names, templates over params) the step needs; {target} is
           the first one's address, {targets} all of them joined by commas
  fresh    optional: start the step's servers for each run and stop them after it (the default
           is one server per name for the whole suite)
  record   optional, False: run (e.g. to register a model) but record nothing
  size_of  optional ("wall"): a file whose size becomes the metric file_bytes
  derive   optional {metric: expression}: more metrics, computed from the params and metrics
  timeout  optional: seconds before the command is killed (default 600)

Templates name binaries as {bin:NAME} (a build's executable, or the pack's `run NAME`),
{python} (the interpreter that runs the driver), {out} (the run's scratch folder) and {certs}
(the TLS test certificates, tests/integration/make_test_certs.sh). Every other {name} is a
param of the step, of the suite's `defaults`, or of its `lookups` ({param: {"key": another
param, "values": {its value: this param's value}}}). Servers that the whole suite shares are
formatted with the defaults alone; a step's `fresh` servers with the step's params.
"""

from typing import Any, Dict

KERNEL = ("{bin:fusedps-kernel-bench} --backend={backend} --workload={workload} --warmup={warmup}"
          " --iters={iters} --json {config}")
PUSH = "{bin:fusedps-bench} --json --warmup-steps={warmup_steps} --target={target} {client_flags}"
GPT2_PUSH = PUSH + (" --model=gpt2 --scale={scale} --dtype=bf16 --clients={clients}"
                    " --streams={streams} --duration={duration}")
LATENCY_PUSH = PUSH + (" --model=synthetic --tensors=1 --numel=1000000 --dtype=bf16 --clients=1"
                       " --steps={latency_steps} --warmup-steps=10")
GPU_SERVER = ("{bin:fusedps-server} --device={device} {metrics_flags}"
              " --staging-pool-bytes=4294967296")
FP32, BF16 = "", "--grad-dtype=bf16 --param-copy=bf16"

SUITES: Dict[str, Dict[str, Any]] = {
    "cpu-smoke": {
        "about": "the kernel bench on the CPU backend at a tiny scale: checks the driver anywhere",
        "defaults": {"backend": "cpu", "warmup": 1, "iters": 2},
        "steps": [{
            "kind": "kernel", "run": KERNEL + " --scale=0.001 --threads=2 --copy-reference=false",
            "params": {"workload": ["all"], "config": [FP32, BF16]},
            "parse": "json-rows:results"}],
    },
    "kernel": {
        "about": "one GPU: the step kernel per workload (fp32 grads; bf16 grads with a bf16 "
                 "copy) beside torch's fused and compiled AdamW",
        "defaults": {"backend": "cuda", "warmup": 10, "iters": 50},
        "steps": [
            {"kind": "kernel", "run": KERNEL, "parse": "json-rows:results",
             "params": {"workload": ["all"], "config": [FP32, BF16]}},
            {"kind": "torch-kernel", "parse": "json-rows:rows", "timeout": 400,
             "run": "{python} bench/torch_gpu_baseline.py --workload={workload} --iters={iters}"
                    " --compile-workloads={compile}",
             "params": {"workload": ["all"], "compile": ["one_large,gpt2,t1000x100k"]}},
        ],
    },
    "state": {
        "about": "one GPU: the step kernel for each storage option (state and params dtypes), "
                 "fp32 and bf16 grads, and the largest GPT each fits",
        "defaults": {"backend": "cuda", "warmup": 5, "iters": 30, "config": ""},
        "steps": [
            {"kind": "kernel", "parse": "json-rows:results",
             "run": KERNEL + " --grad-dtype={grads} --state-dtype={state} --params-dtype={params}",
             "params": {"workload": ["all"], "grads": ["fp32", "bf16"],
                        "state": ["fp32", "bf16", "int8"], "params": ["fp32", "bf16"]}},
            {"kind": "gpt-fit", "parse": "json",
             "run": "{bin:fusedps-gpt-fit} --backend=cuda:0 --json", "params": {}},
        ],
    },
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
                 "loopback TCP, fp32 and bf16",
        "defaults": {"device": "cuda:0"},
        "servers": {"fusedps": GPU_SERVER + " --param-copy-dtype=bf16"},
        "steps": [
            {"kind": "transport", "parse": "transport", "servers": ["fusedps"], "timeout": 300,
             "run": "{bin:fusedps-transport-bench} --target={target} --mib=256 --streams=1,8"
                    " --iters=5 --dtype={dtype} --prefix=t-{dtype}/",
             "params": {"dtype": ["fp32", "bf16"]}},
        ],
    },
}
