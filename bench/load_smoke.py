"""Smoke test of fusedps-bench against a running server (ctest fusedps_bench_smoke).

Run through tests/e2e/server_fixture.py, which starts a CPU server and substitutes {target}:

    server_fixture.py -- python3 bench/load_smoke.py --bench build/bench/fusedps-bench \
        --target {target}

Checks, against that fresh server:
  1. 2 clients x 5 steps of a synthetic 3 x 1000 model in bf16, with --json: 10 timed pushes,
     5 per client, grad bytes 10 x 3000 x 2, versions advanced by 10, latencies ordered and
     positive, throughput positive; the 3 tensors were created.
  2. The same run again: the tensors now exist, and nothing else changes.
  3. --register=false with a model the server lacks: exit 1 and NOT_FOUND on stderr.
Exits non-zero with a message on the first failed check.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CLIENTS, STEPS, TENSORS, NUMEL, BF16_BYTES = 2, 5, 3, 1000, 2


def run_bench(bench: str, target: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [bench, f"--target={target}", *extra]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=120)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def check_report(report: dict, created: int, existing: int) -> None:
    pushes = CLIENTS * STEPS
    check(report["tool"] == "fusedps-bench", "tool name")
    check(report["backend"] == "cpu", f"backend {report['backend']!r}, expected cpu")
    check(report["timed_pushes"] == pushes, f"timed_pushes {report['timed_pushes']} != {pushes}")
    check(report["tensors"] == TENSORS and report["params"] == TENSORS * NUMEL, "model size")
    check(report["tensors_created"] == created and report["tensors_existing"] == existing,
          f"registration created {report['tensors_created']}, existing "
          f"{report['tensors_existing']}; expected {created}, {existing}")
    expected_bytes = pushes * TENSORS * NUMEL * BF16_BYTES
    check(report["grad_bytes"] == expected_bytes,
          f"grad_bytes {report['grad_bytes']} != {expected_bytes}")
    check(report["version_after"] - report["version_before"] == pushes,
          f"versions {report['version_before']} -> {report['version_after']}, expected +{pushes}")
    check(report["skipped_steps"] == 0, "no step should be skipped")
    check(report["seconds"] > 0 and report["pushes_per_s"] > 0 and report["gbps"] > 0,
          "seconds, pushes/s and GB/s must be positive")
    rate = pushes / report["seconds"]
    check(abs(report["pushes_per_s"] - rate) <= 1e-3 * rate + 1e-3,
          f"pushes_per_s {report['pushes_per_s']} is not pushes / seconds = {rate}")
    lat = report["latency_ms"]
    check(lat["count"] == pushes, "latency count")
    check(0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"],
          f"latencies out of order: {lat}")
    check(lat["max"] <= report["seconds"] * 1e3 + 1e-6, "a push outlasted the timed window")
    clients = report["per_client"]
    check(len(clients) == CLIENTS, f"{len(clients)} per-client entries")
    check(sorted(c["client"] for c in clients) == list(range(CLIENTS)), "client indices")
    check(len({c["client_id"] for c in clients}) == CLIENTS, "client ids must differ")
    for c in clients:
        check(c["pushes"] == STEPS and c["latency_ms"]["count"] == STEPS,
              f"client {c['client']} pushed {c['pushes']} times")
        check(c["grad_bytes"] == STEPS * TENSORS * NUMEL * BF16_BYTES, "per-client grad_bytes")
        check(0 < c["seconds"] <= report["seconds"] + 1e-9, "per-client seconds")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", required=True, help="the fusedps-bench binary")
    parser.add_argument("--target", required=True, help="HOST:PORT of a fresh server")
    args = parser.parse_args(argv)
    flags = [f"--clients={CLIENTS}", "--model=synthetic", f"--tensors={TENSORS}",
             f"--numel={NUMEL}", f"--steps={STEPS}", "--dtype=bf16", "--json"]
    try:
        for attempt, (created, existing) in enumerate([(TENSORS, 0), (0, TENSORS)]):
            proc = run_bench(args.bench, args.target, *flags)
            check(proc.returncode == 0,
                  f"run {attempt + 1} exited {proc.returncode}; stderr:\n{proc.stderr}")
            check_report(json.loads(proc.stdout), created, existing)
        proc = run_bench(args.bench, args.target, "--model=synthetic", "--tensors=1",
                         "--numel=7", "--steps=1", "--register=false")
        check(proc.returncode == 1 and "NOT_FOUND" in proc.stderr,
              f"pushing an unregistered model: exit {proc.returncode}, stderr:\n{proc.stderr}")
    except (AssertionError, json.JSONDecodeError, KeyError) as e:
        print(f"load_smoke: FAILED: {e}", file=sys.stderr)
        return 1
    print("load_smoke: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
