"""The benchmark driver (bench/run.py) and its printer (bench/report.py), without a GPU.

Every suite lists and dry-runs, and each command it would run names an executable that a
CMakeLists.txt of the tree defines and scripts that exist. The suites that can run on the CPU
run for real, at tiny sizes, against CPU servers of the build (cpu-smoke, training, quality,
checkpoint, core, python), and report.py prints their results; report.py also prints
hand-written results of the GPU-only kinds, and the parsers read sample outputs of the tools.
"""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "bench", "run.py")
REPORT = os.path.join(ROOT, "bench", "report.py")
sys.path.insert(0, os.path.join(ROOT, "bench"))

from suites import SUITES  # noqa: E402  bench/suites/
from suites.parsers import PARSERS  # noqa: E402

CORPUS = "/usr/share/doc/jargon-text/jargon.txt.gz"


def driver(*args, script=RUN, timeout=120):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def build_dir():
    """The build whose server the e2e tests use (ctest's FUSEDPS_SERVER), else build/."""
    server = os.environ.get("FUSEDPS_SERVER", os.path.join(ROOT, "build/server/fusedps-server"))
    return os.path.dirname(os.path.dirname(server))


def run_on_cpu(tmp_path, suite, *sets, needs=("server/fusedps-server", "bench/fusedps-bench")):
    """Runs a suite from the build with --set NAME=VALUE for each of sets; its results
    document and report.py's tables of them. Skips when the build lacks what it needs."""
    build = build_dir()
    for path in needs:
        if not os.path.exists(os.path.join(build, path)):
            pytest.skip(f"no {path} in {build}")
    results = tmp_path / f"{suite}.json"
    args = [suite, "--build", build, "--out", str(results)]
    for item in sets:
        args += ["--set", item]
    out = driver(*args, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    doc = json.loads(results.read_text())
    assert doc["suite"] == suite and doc["results"], doc
    errors = [r for r in doc["results"] if "error" in r]
    assert not errors, errors
    table = driver(str(results), script=REPORT)
    assert table.returncode == 0, table.stderr
    return doc, table.stdout


def defined_executables():
    names = set()
    for path in glob.glob(os.path.join(ROOT, "**", "CMakeLists.txt"), recursive=True):
        if os.path.relpath(path, ROOT).split(os.sep)[0].startswith("build"):
            continue  # build trees (build/, build-deploy/, ...) copy no CMakeLists.txt of ours
        names.update(re.findall(r"add_executable\(\s*([\w.-]+)", open(path).read()))
    return names


def test_list_names_every_suite():
    out = driver("--list")
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    assert listed == list(SUITES)


@pytest.mark.parametrize("suite", list(SUITES))
def test_dry_run_names_defined_binaries(suite):
    out = driver(suite, "--pack", "PACK", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("  ")]
    assert lines, out.stdout
    # tests/e2e/server_fixture.py fills in the {target} of the command it runs.
    text = re.sub(r"(server_fixture\.py .*?)\{target\}", r"\1", out.stdout)
    assert not re.search(r"\{\w+(:[\w.-]+)?\}", text), "an unfilled placeholder"
    binaries = set(re.findall(r"PACK/run ([\w.-]+)", out.stdout))
    scripts = re.findall(r"\b((?:bench|examples|tests/e2e)/[\w/]+\.py)\b", out.stdout)
    assert binaries or scripts, out.stdout
    assert binaries <= defined_executables(), binaries - defined_executables()
    for script in scripts:
        assert os.path.exists(os.path.join(ROOT, script)), script


def test_parts_and_setup_are_chosen_by_set():
    out = driver("training", "--dry-run", "--set", "parts=probe", "--set", "mps=1")
    assert out.returncode == 0, out.stderr
    assert "  probe {}:" in out.stdout and "contention_probe.py" in out.stdout
    assert "  train " not in out.stdout and "selfcheck" not in out.stdout
    assert "  setup mps: sh -c 'mkdir -p" in out.stdout
    assert "nvidia-cuda-mps-control -d" in out.stdout
    default = driver("training", "--dry-run")
    assert "  train " in default.stdout and "selfcheck" in default.stdout
    assert "probe" not in default.stdout and "mps" not in default.stdout


def test_alternate_swaps_each_second_round_and_lists_repeat_only_their_steps():
    out = driver("checkpoint", "--dry-run", "--set", "round=1,2,3")
    assert out.returncode == 0, out.stderr
    order = re.findall(r'checkpoint-push \{"round": (\d), "server": "(\w+)"\}', out.stdout)
    assert order == [("1", "off"), ("1", "on"), ("2", "on"), ("2", "off"), ("3", "off"),
                     ("3", "on")]
    assert out.stdout.count("  checkpoint-log {}") == 2  # round is another step's param


def test_bad_values_fail_before_running():
    out = driver("quality", "--dry-run", "--set", "storage=fp8:fp32")
    assert out.returncode == 2 and "no value for storage='fp8:fp32'" in out.stderr, out.stderr
    out = driver("no-such-suite", "--dry-run")
    assert out.returncode != 0 and "no suite" in out.stderr


def test_cpu_smoke_runs_and_reports(tmp_path):
    doc, table = run_on_cpu(tmp_path, "cpu-smoke", needs=("bench/fusedps-kernel-bench",))
    assert {r["metrics"]["workload"] for r in doc["results"]} >= {"gpt2", "one_large"}
    assert "### kernel" in table and "| gpt2 |" in table


def test_training_runs_on_cpu(tmp_path):
    if not os.path.exists(CORPUS):
        pytest.skip(f"no {CORPUS} (Debian's jargon-text)")
    doc, table = run_on_cpu(
        tmp_path, "training", "preset=tiny", "steps=3", "timing_warmup=1", "device=cpu",
        "amp=none", "server_device=cpu", "variant=local,fp32,delay", "selfcheck_preset=tiny",
        "selfcheck_flags=--steps 2 --warmup 1 --device cpu", needs=("server/fusedps-server",))
    train = [r for r in doc["results"] if r["step"] == "train"]
    assert [r["params"]["variant"] for r in train] == ["local", "fp32", "delay"]
    for r in train:
        assert r["metrics"]["steps"] == 3 and len(r["metrics"]["losses"]) == 3, r
    # The remote runs' servers were scraped; the local run had none.
    assert "server_ms" not in train[0]["metrics"] and "fp32" not in train[0]["metrics"]
    assert train[1]["metrics"]["server_ms"]["remote"]
    assert train[1]["metrics"]["push_total_ms"] > 0
    (selfcheck,) = [r for r in doc["results"] if r["step"] == "selfcheck"]
    assert selfcheck["metrics"]["preset"] == "tiny"
    assert "### train" in table and "### selfcheck" in table
    assert re.search(r"\| local \| [\d.]+ \| 1\.000x \|", table), table
    assert re.search(r"\| delay \| [\d.]+ \| [\d.]+x \| [\d.]+ \| [\d.]+ \(", table), table


def test_quality_runs_on_cpu(tmp_path):
    doc, table = run_on_cpu(
        tmp_path, "quality", "example=digits", "storage=fp32:fp32,int8:bf16", "seed=0",
        "parallel=2", "digits_epochs=1", "device=cpu", "server_device=cpu",
        needs=("server/fusedps-server",))
    assert sorted(r["params"]["storage"] for r in doc["results"]) == ["fp32:fp32", "int8:bf16"]
    assert all(r["metrics"]["test_accuracy"] > 0.5 for r in doc["results"])
    assert "| digits | int8 | bf16 | test_accuracy |" in table, table


def test_checkpoint_runs_on_cpu(tmp_path):
    doc, table = run_on_cpu(
        tmp_path, "checkpoint", "device=cpu", "scale=0.01", "clients=1", "streams=1",
        "duration=2s", "interval=1", "load_duration=3s", "load_lead=1")
    kinds = [r["step"] for r in doc["results"]]
    assert kinds.count("checkpoint-push") == 4
    disk = {(r["params"]["load"], r["metrics"]["mode"]) for r in doc["results"]
            if r["step"] == "disk"}
    assert {("push", "write-fsync"), ("idle", "write-fsync")} <= disk, disk  # O_DIRECT: if
    # the file system has it.
    events = [r["metrics"]["event"] for r in doc["results"] if r["step"] == "checkpoint-log"]
    assert "checkpoint" in events and events[-1] == "restore", events
    pushing = [r for r in doc["results"] if r["step"] == "disk" and r["params"]["load"] == "push"]
    assert pushing[0]["metrics"]["push"]["gbps"] > 0  # The background load's own result.
    assert "### checkpoint-push" in table and "max ms" in table and "checkpoint write" in table
    assert "### disk" in table and "| restore |" in table


def test_core_runs_on_cpu(tmp_path):
    doc, table = run_on_cpu(
        tmp_path, "core", "device=cpu", "scale=0.01", "streams=0,1", "probe_seconds=1",
        "push_seconds=3", "duration=1s", "clients=1")
    readers = {r["params"]["streams"]: r["metrics"] for r in doc["results"]
               if r["step"] == "readers"}
    assert "push" not in readers[0] and readers[1]["push"]["gbps"] > 0
    assert readers[0]["probe"]["get_info_ms"]["count"] > 0
    assert [r["step"] for r in doc["results"]].count("push") == 1
    assert "### readers" in table and "GetInfo p50 ms" in table


def test_python_runs_on_cpu(tmp_path):
    tensors = tmp_path / "tensors.json"
    tensors.write_text(json.dumps([{"name": "w", "shape": [128, 32]},
                                   {"name": "b", "shape": [32]}]))
    doc, table = run_on_cpu(
        tmp_path, "python", "device=cpu", "scale=0.001", f"tensors={tensors}", "duration=1",
        "streams=1", "warmup_steps=1", "pulls=1")
    assert [r["params"]["client"] for r in doc["results"]] == ["cpp", "native", "grpcio"]
    assert all(r["metrics"]["gbps"] > 0 for r in doc["results"])
    ratio = driver(str(tmp_path / "python.json"), "--ratio", "client=cpp", script=REPORT)
    assert "| cpp |" in ratio.stdout and "GB/s / client=cpp" in ratio.stdout


NCU_TEXT = """==PROF== Profiling "AdamWApply": 0%....50%....100% - 9 passes
  void fusedps::AdamWApply<float>(Params) (132, 1, 1)x(256, 1, 1), Context 1, Stream 13
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Throughput                   %        92.51
    Duration                         us       931.23
    Elapsed Cycles                cycle    1,234,567
    Section: Occupancy
    Achieved Occupancy                %        85.10
"""


def test_parsers_read_the_tools_outputs():
    (ncu,) = PARSERS["ncu"](NCU_TEXT, {})
    assert ncu["ncu"] == {"DRAM Throughput (%)": 92.51, "Duration (us)": 931.23,
                          "Elapsed Cycles (cycle)": 1234567.0, "Achieved Occupancy (%)": 85.1}
    dd = PARSERS["dd"]("write-fsync 1048576000 bytes (1.0 GB, 1000 MiB) copied, 0.5 s, 2.1 GB/s"
                       "\nwrite-direct dd: failed to open 'x': Invalid argument\n", {})
    assert dd == [{"mode": "write-fsync", "bytes": 1048576000, "seconds": 0.5,
                   "gbps": 1048576000 / 0.5 / 1e9}]
    log = ("I1129 checkpointer.cc:203] checkpoint: version 7 in /c/checkpoint-2, 1000 bytes; "
           "snapshot 27.5 ms (fenced), write 0.5 s (0.000002 GB/s)\n"
           "I1129 model_files.cc:212] model 'default': restored version 7 from /c/checkpoint-2:"
           " 900 bytes in 0.25 s (0.0000036 GB/s)\n")
    rows = PARSERS["checkpoint-log"](log, {})
    assert [(r["event"], r["version"], r["bytes"], r.get("snapshot_ms")) for r in rows] == [
        ("checkpoint", 7, 1000, 27.5), ("restore", 7, 900, None)]
    probe = PARSERS["probe"]("idle 10.00 ms/step\n\nload  ms/step  vs idle  background rate\n"
                             "idle  10.00  1.00x\nexternal (bench exited early)  12.50  1.25x\n"
                             "pull_py  11.00  1.10x  3.20 GB/s\n", {})
    assert [(r["load"], r["vs_idle"], r["rate"]) for r in probe] == [
        ("idle", 1.0, ""), ("external (bench exited early)", 1.25, ""),
        ("pull_py", 1.1, "3.20 GB/s")]
    with pytest.raises(ValueError):
        PARSERS["result-line"]("no result here\n", {})


def write(tmp_path, name, suite, results):
    path = tmp_path / name
    path.write_text(json.dumps({"suite": suite, "about": "", "device": "test GPU",
                                "date": "2026-11-29T00:00:00Z", "git": "abc",
                                "binaries": "pack", "results": results}))
    return str(path)


def test_report_prints_one_table_per_kind(tmp_path):
    path = write(tmp_path, "results.json", "push", [
        {"step": "push", "params": {"server": "fusedps", "clients": 1},
         "metrics": {"gbps": 2.0, "pushes_per_s": 8.0,
                     "latency_ms": {"p50": 10.0, "p90": 12.0, "p99": 20.0},
                     "server_ms": {"fusedps": {'fusedps_stage_duration{stage="apply"}': 1.5}}}},
        {"step": "push", "params": {"server": "sink", "clients": 1},
         "metrics": {"gbps": 4.0, "pushes_per_s": 16.0,
                     "latency_ms": {"p50": 5.0, "p90": 6.0, "p99": 9.0}}},
        {"step": "pull", "params": {"server": "sink"}, "metrics": {}, "error": "exit 1"},
    ])
    out = driver(path, "--ratio", "server=sink", script=REPORT)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "test GPU" in text and "### push" in text and "### pull" in text
    assert "| server | GB/s | pushes/s | p50 ms |" in text
    assert "| fusedps | 2.000 | 8.00 | 10.00 | 12.00 | 20.00 | fusedps: apply 1.50 | 0.50 |" in text
    assert "failed: exit 1" in text


def test_report_tables_of_gpu_kinds(tmp_path):
    ncu = {"ncu": {"DRAM Throughput (%)": 92.5, "Duration (us)": 931.0, "Elapsed Cycles": 9.0}}
    new = write(tmp_path, "new.json", "ncu", [
        {"step": "ncu", "params": {"workload": "one_large", "config": ""}, "metrics": ncu},
        {"step": "ncu", "params": {"workload": "t10000x1k", "config": ""}, "metrics": {},
         "error": "exit 1"},
        {"step": "readers", "params": {"streams": 8},
         "metrics": {"push": {"gbps": 6.0}, "probe": {
             "get_info_ms": {"p50": 0.2, "p99": 0.4, "max": 1.0, "count": 900},
             "pull_ms": {"p50": 0.8, "p99": 1.6}}}}])
    old = write(tmp_path, "old.json", "ncu", [
        {"step": "readers", "params": {"streams": 8},
         "metrics": {"push": {"gbps": 4.0}, "probe": {"get_info_ms": {"p50": 0.4}}}}])
    out = driver(new, old, "--ratio", "run=2", script=REPORT)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "| metric (workload) | 1: one_large | 1: t10000x1k |" in text, text
    assert "| DRAM Throughput (%) | 92.5 | - |" in text and "Elapsed Cycles" not in text
    assert "| failed |  | exit 1 |" in text
    assert "| 1 | 6.00 | 0.200 | 0.400 | 1.000 | 0.800 | 1.600 | 900 | 1.50 |" in text, text
    assert "| 2 | 4.00 | 0.400 |" in text and text.rstrip().endswith("| 1.00 |")


def test_report_takes_medians_over_rounds_against_each_rounds_local_run(tmp_path):
    """--set round=1,2,3 of the training suite: a table of medians follows the runs', each
    ratio against the local run of its own round (the median of the ratios, 1.2x here, not
    the ratio of the medians, 15/10)."""
    def train(round_, variant, ms):
        return {"step": "train", "params": {"round": round_, "preset": "small",
                                            "variant": variant},
                "metrics": {"step_ms": ms, "losses": []}}
    path = write(tmp_path, "rounds.json", "training", [
        train(1, "local", 10.0), train(1, "bf16", 12.0),
        train(2, "local", 20.0), train(2, "bf16", 22.0),
        train(3, "local", 10.0), train(3, "bf16", 15.0)])
    out = driver(path, script=REPORT)
    assert out.returncode == 0, out.stderr
    assert "| round | variant | ms/step | vs local |" in out.stdout, out.stdout
    assert "| 3 | bf16 | 15.00 | 1.500x |" in out.stdout, out.stdout
    assert "| variant | rounds | ms/step (median) | vs local (median) | ms/step of each round |" \
        in out.stdout, out.stdout
    assert "| local | 3 | 10.00 | 1.000x | 10.00, 20.00, 10.00 |" in out.stdout, out.stdout
    assert "| bf16 | 3 | 15.00 | 1.200x | 12.00, 22.00, 15.00 |" in out.stdout, out.stdout
