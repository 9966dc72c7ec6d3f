"""The benchmark driver (bench/run.py) and its printer (bench/report.py), without a GPU.

Every suite lists and dry-runs, and each command it would run names an executable that a
CMakeLists.txt of the tree defines and scripts that exist; the CPU smoke suite runs for real
when the build has fusedps-kernel-bench; report.py prints a small hand-written results file.
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

from suites import SUITES  # noqa: E402  bench/suites.py


def driver(*args, script=RUN):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


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
    assert not re.search(r"\{\w+(:[\w.-]+)?\}", out.stdout), "an unfilled placeholder"
    binaries = set(re.findall(r"PACK/run ([\w.-]+)", out.stdout))
    assert binaries, out.stdout
    assert binaries <= defined_executables(), binaries - defined_executables()
    for script in re.findall(r"\b(bench/[\w/]+\.py)\b", out.stdout):
        assert os.path.exists(os.path.join(ROOT, script)), script


def test_unknown_suite_fails():
    out = driver("no-such-suite", "--dry-run")
    assert out.returncode != 0 and "no suite" in out.stderr


def test_cpu_smoke_runs_and_reports(tmp_path):
    server = os.environ.get("FUSEDPS_SERVER", os.path.join(ROOT, "build/server/fusedps-server"))
    build = os.path.dirname(os.path.dirname(server))
    if not os.path.exists(os.path.join(build, "bench", "fusedps-kernel-bench")):
        pytest.skip(f"no fusedps-kernel-bench in {build}")
    results = tmp_path / "results.json"
    out = driver("cpu-smoke", "--build", build, "--out", str(results))
    assert out.returncode == 0, out.stderr
    doc = json.loads(results.read_text())
    assert doc["suite"] == "cpu-smoke" and doc["results"]
    assert {r["metrics"]["workload"] for r in doc["results"]} >= {"gpt2", "one_large"}
    table = driver(str(results), script=REPORT)
    assert table.returncode == 0, table.stderr
    assert "### kernel" in table.stdout and "| gpt2 |" in table.stdout


def test_report_prints_one_table_per_kind(tmp_path):
    doc = {"suite": "push", "about": "", "device": "test GPU", "date": "2026-11-29T00:00:00Z",
           "git": "abc", "binaries": "build", "results": [
               {"step": "push", "params": {"server": "fusedps", "clients": 1},
                "metrics": {"gbps": 2.0, "pushes_per_s": 8.0,
                            "latency_ms": {"p50": 10.0, "p90": 12.0, "p99": 20.0},
                            "server_ms": {"fusedps": {
                                'fusedps_stage_duration{stage="apply"}': 1.5}}}},
               {"step": "push", "params": {"server": "sink", "clients": 1},
                "metrics": {"gbps": 4.0, "pushes_per_s": 16.0,
                            "latency_ms": {"p50": 5.0, "p90": 6.0, "p99": 9.0}}},
               {"step": "pull", "params": {"server": "sink"}, "metrics": {},
                "error": "exit 1"},
           ]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    out = driver(str(path), "--ratio", "server=sink", script=REPORT)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "test GPU" in text and "### push" in text and "### pull" in text
    assert "| server | GB/s | pushes/s | p50 ms |" in text
    assert "| fusedps | 2.000 | 8.00 | 10.00 | 12.00 | 20.00 | fusedps: apply 1.50 | 0.50 |" in text
    assert "failed: exit 1" in text
