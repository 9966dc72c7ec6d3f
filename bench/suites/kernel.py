"""Suites of the step kernel alone: fusedps-kernel-bench (and torch's step beside it)."""

from typing import Any, Dict

from .common import BF16, FP32, KERNEL

# Nsight Compute: `ncu` on the PATH, else the newest under /opt/nvidia/nsight-compute.
NCU = ("sh -c 'exec $(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | tail -1) \"$@\"'"
       " ncu")
NCU_SECTIONS = ("--section SpeedOfLight --section Occupancy --section WarpStateStats"
                " --section MemoryWorkloadAnalysis --section LaunchStats"
                " --section ComputeWorkloadAnalysis --section InstructionStats"
                " --section MemoryWorkloadAnalysis_Tables"
                " --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio'")

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
    "ncu": {
        "about": "one GPU: Nsight Compute on one AdamWApply launch of the kernel bench per "
                 "workload (speed of light, occupancy, warp stalls, memory, instructions); "
                 "`config` adds kernel-bench flags",
        "defaults": {"ncu": NCU, "sections": NCU_SECTIONS, "launch_skip": 4},
        "steps": [
            {"kind": "ncu", "parse": "ncu", "timeout": 240,
             "run": "{ncu} --kernel-name regex:AdamWApply --launch-skip {launch_skip}"
                    " --launch-count 1 {sections} {bin:fusedps-kernel-bench} --backend=cuda"
                    " --workload={workload} --warmup=2 --iters=2 --copy-reference=false {config}",
             "params": {"workload": ["one_large", "t10000x1k"], "config": [FP32]}},
        ],
    },
}
