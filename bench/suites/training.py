"""Suites of training through fusedps: examples/train_gpt.py against local torch.optim.AdamW,
the self-check, the training quality of each storage option, the Python client's pushes."""

from typing import Any, Dict

from .common import GPU_SERVER, MPS

# RemoteAdamW(overlap=True) against the step's fresh server; {remote_flags}: more flags of the
# remote runs (e.g. "--streams 8").
REMOTE = "--optimizer remote --overlap --target {target} {remote_flags}"
BF16_WIRE = " --grad-dtype bfloat16 --pull-dtype bfloat16"
# Each variant of the training suite: train_gpt.py's flags, and the server it trains through
# (none for local runs; "remote-copy" keeps a bf16 copy of the params, which bf16 pulls read).
VARIANTS = {
    "local": ("--optimizer torch", ""),
    "local2": ("--optimizer torch --seed 1", ""),  # The run-to-run spread.
    "fp32": (REMOTE, "remote"),
    "fp32grpc": (REMOTE + " --data-plane grpc", "remote"),
    "bf16": (REMOTE + BF16_WIRE, "remote-copy"),
    "bf16grpc": (REMOTE + BF16_WIRE + " --data-plane grpc", "remote-copy"),
    "delay": (REMOTE + BF16_WIRE + " --delay 1 --delay-warmup 10", "remote-copy"),
    # Through a host workspace (shared memory, page-locked), whatever auto would pick.
    "fp32ws": (REMOTE + " --data-plane workspace", "remote"),
    "bf16ws": (REMOTE + BF16_WIRE + " --data-plane workspace", "remote-copy"),
    "delayws": (REMOTE + BF16_WIRE + " --delay 1 --delay-warmup 10 --data-plane workspace",
                "remote-copy"),
    # Through a device workspace (the server GPU's memory, CUDA IPC): no host copies at all.
    "fp32dev": (REMOTE + " --data-plane device", "remote"),
    "bf16dev": (REMOTE + BF16_WIRE + " --data-plane device", "remote-copy"),
    "delaydev": (REMOTE + BF16_WIRE + " --delay 1 --delay-warmup 10 --data-plane device",
                 "remote-copy"),
    # The device workspace with the gradients pushed during backward (its default pushes them
    # at step(): RemoteAdamW's push_during_backward).
    "fp32devbw": (REMOTE + " --data-plane device --push-during-backward on", "remote"),
    "bf16devbw": (REMOTE + BF16_WIRE + " --data-plane device --push-during-backward on",
                  "remote-copy"),
    # Without overlap: every step waits for its push and pull.
    "sync": ("--optimizer remote --target {target} {remote_flags}", "remote"),
}
TRAIN_SERVER = ("{server_prefix} {bin:fusedps-server} --device={server_device} {metrics_flags}"
                " --staging-pool-bytes=4294967296 {server_flags}")
PYTHON_PUSH = ("{python} bench/python_push_bench.py --target={target} --transport={transport}"
               " --tensors={tensors} --streams={streams} --duration={duration}"
               " --warmup-steps={warmup_steps} --pulls={pulls}")
# Storage options of the quality suite: "state:params" dtypes.
STORAGES = ["fp32:fp32", "bf16:fp32", "int8:fp32", "fp32:bf16", "int8:bf16"]
ALL_STORAGES = STORAGES + ["bf16:bf16"]

SUITES: Dict[str, Dict[str, Any]] = {
    "training": {
        "about": "one GPU: examples/train_gpt.py with local torch.optim.AdamW (two seeds) against "
                 "RemoteAdamW variants through a fresh server per run on the same host; the "
                 "self-check; parts `probe` (contention_probe.py) on request",
        "defaults": {
            "device": "cuda", "amp": "bf16", "server_device": "cuda:0", "mps": 0,
            # Steps per preset; `--set steps=N` sets every preset's.
            "steps_tiny": 20, "steps_small": 200, "steps_medium": 100, "steps_gpt2": 100,
            "timing_warmup": 20, "log_every": 50,
            # flags: more flags of every train_gpt.py run; prefixes: commands before the
            # trainer and the servers (e.g. "taskset -c 0-7"); server_flags: e.g.
            # "--workspace-dir=/dev/shm".
            "flags": "", "remote_flags": "", "server_flags": "", "train_prefix": "",
            "server_prefix": "",
            "selfcheck_preset": "small", "selfcheck_flags": "",
            "probe_preset": "gpt2",
            "probe_loads": "idle external pull_py pull_nocopy push_py gil idle"},
        "setup": [MPS],
        "parts": ["train", "selfcheck"],
        "servers": {
            "remote": TRAIN_SERVER,
            "remote-copy": TRAIN_SERVER + " --param-copy-dtype=bf16",
        },
        "steps": [
            {"kind": "train", "part": "train", "parse": "train-log", "timeout": 600,
             "servers": ["{train_server}"], "fresh": True,
             "reads": "{out}/train_{preset}_{variant}.jsonl",
             "run": "{train_prefix} {python} examples/train_gpt.py --device {device}"
                    " --amp {amp} --preset {preset} --steps {steps} --timing-warmup"
                    " {timing_warmup} --data {corpus} --sample-bytes 0 --log-every {log_every}"
                    " --eval-every 0 --eval-batches 4 {variant_flags} {flags}"
                    " --log-json {out}/train_{preset}_{variant}.jsonl",
             "params": {"preset": ["small", "gpt2"],
                        "variant": ["local", "local2", "fp32", "bf16", "delay"]}},
            {"kind": "selfcheck", "part": "selfcheck", "parse": "json", "timeout": 300,
             "servers": ["remote"], "fresh": True,
             "run": "{python} -m fusedps.bench e2e --target {target} --preset"
                    " {selfcheck_preset} --json {selfcheck_flags}"},
            # Local training beside each kind of background load.
            {"kind": "probe", "part": "probe", "parse": "probe", "timeout": 300,
             "servers": ["remote"], "fresh": True,
             "run": "{python} bench/contention_probe.py --target {target} --preset"
                    " {probe_preset} --loads '{probe_loads}' --bench"
                    " '{bin:fusedps-transport-bench} --target={target} --mib=256 --streams=8"
                    " --iters=100000'"},
        ],
        "lookups": {
            "steps": {"key": "preset", "values": {
                p: "{steps_" + p + "}" for p in ("tiny", "small", "medium", "gpt2")}},
            "variant_flags": {"key": "variant",
                              "values": {v: f for v, (f, _) in VARIANTS.items()}},
            "train_server": {"key": "variant",
                             "values": {v: s for v, (_, s) in VARIANTS.items()}},
        },
    },
    "quality": {
        "about": "one GPU: training quality of each storage option (state:params dtypes), "
                 "examples/train_digits.py and examples/train_gpt.py, a fresh server per run "
                 "and seed; `parallel` runs share the GPU at once",
        "defaults": {"device": "cuda", "server_device": "cuda", "amp": "bf16", "parallel": 8,
                     "digits_epochs": 10, "gpt_preset": "small", "gpt_steps": 200,
                     "omp_threads": 2},
        "steps": [
            {"kind": "quality", "parse": "result-line", "timeout": 900, "parallel": "{parallel}",
             # tests/e2e/server_fixture.py starts $FUSEDPS_SERVER and fills in {target}.
             "run": "env OMP_NUM_THREADS={omp_threads} PYTHONUNBUFFERED=1 {python}"
                    " tests/e2e/server_fixture.py --device={server_device} -- {python}"
                    " {example_command}",
             "params": {"example": ["digits", "gpt"], "storage": STORAGES, "seed": [0, 1, 2]}},
        ],
        "lookups": {
            "example_command": {"key": "example", "values": {
                "digits": "examples/train_digits.py --target {{target}} --epochs"
                          " {digits_epochs} --seed {seed} --state-dtype {state_dtype}"
                          " --params-dtype {params_dtype} --min-accuracy 0",
                "gpt": "examples/train_gpt.py --optimizer remote --target {{target}} --device"
                       " {device} --preset {gpt_preset} --steps {gpt_steps} --seed {seed} --amp"
                       " {amp} --deterministic --grad-dtype bfloat16 --streams 4"
                       " --sample-bytes 0 --data {corpus} --state-dtype {state_dtype}"
                       " --params-dtype {params_dtype}"}},
            "state_dtype": {"key": "storage",
                            "values": {s: s.split(":")[0] for s in ALL_STORAGES}},
            "params_dtype": {"key": "storage",
                             "values": {s: s.split(":")[1] for s in ALL_STORAGES}},
        },
    },
    "python": {
        "about": "one GPU: one client pushing GPT-2 small bf16 to one server, back to back: "
                 "the C++ client (fusedps-bench), then the Python client's native and grpcio "
                 "transports (bench/python_push_bench.py, which also times fp32 pulls)",
        "defaults": {"device": "cuda:0", "duration": 8, "pulls": 3, "warmup_steps": 2,
                     # The model: fusedps-bench's (at a scale), the Python bench's file.
                     "model": "gpt2", "scale": 1,
                     "tensors": "tests/data/gpt2_small_tensors.json"},
        "servers": {"fusedps": GPU_SERVER},
        "steps": [
            {"kind": "python-push", "parse": "json", "servers": ["fusedps"], "timeout": 180,
             "run": "{client_command}",
             "params": {"streams": [1, 8], "round": [1], "client": ["cpp", "native", "grpcio"]}},
        ],
        "lookups": {"client_command": {"key": "client", "values": {
            "cpp": "{bin:fusedps-bench} --json --warmup-steps={warmup_steps} --target={target}"
                   " --model={model} --scale={scale} --dtype=bf16 --clients=1"
                   " --streams={streams} --duration={duration}s",
            "native": PYTHON_PUSH.replace("{transport}", "native"),
            "grpcio": PYTHON_PUSH.replace("{transport}", "grpcio"),
        }}},
    },
}
