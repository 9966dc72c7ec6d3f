"""Command templates that several suites share (bench/suites/__init__.py says what a template
may name)."""

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

# `--set mps=1`: the suite's processes share the GPU through one MPS daemon, started before the
# first step and stopped after the last (without MPS, kernels and copies of different processes
# take turns in time slices; with it they run side by side).
MPS = {"name": "mps", "when": "mps",
       "run": "sh -c 'mkdir -p {out}/mps {out}/mps-log && nvidia-cuda-mps-control -d'",
       "undo": "sh -c 'echo quit | nvidia-cuda-mps-control'",
       "env": {"CUDA_MPS_PIPE_DIRECTORY": "{out}/mps", "CUDA_MPS_LOG_DIRECTORY": "{out}/mps-log"}}
