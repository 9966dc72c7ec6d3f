#!/usr/bin/env python3
"""The compose test stack, run for real (`make test-deploy`, after scripts/test_deploy.sh has
built the images): what a user gets from `docker-compose up`.

deploy/compose/docker-compose.yml with deploy/compose/docker-compose.test.yml starts the server
(the CPU image), Prometheus (Debian's package) and a trainer container running
examples/train_digits.py against the server by its service name. Then, from this host:

1. the server container becomes healthy (its HEALTHCHECK), runs as UID 10001, and answers gRPC
   health and /metrics on the published ports;
2. the trainer exits 0 with test accuracy >= 0.9, and says how many pushes it made;
3. through Prometheus's HTTP API: up{job="fusedps"} == 1; fusedps_optimizer_steps_total equals
   the trainer's pushes; every recording rule of deploy/prometheus/rules returns data, and every
   rule (alerts too) evaluates without error;
4. `docker stop` on the server exits 0 within its grace period (120 s, the compose file's
   stop_grace_period), writing its checkpoint on the way out;
5. the same container started again on the same volume restores the same version, parameters
   and optimizer state (tests/deploy/stack_probe.py, run in the trainer image, before and after);
6. `docker-compose down -v` leaves no container, network or volume of the project behind.

Needs /usr/bin/python3 with Debian's grpcio and yaml, docker and docker-compose, and the ports
that docker-compose.yml publishes on 127.0.0.1 (50051, 9464, 9090) free.

    /usr/bin/python3 tests/deploy/stack_test.py [--project fusedps-test] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import grpc
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE_FILES = ["deploy/compose/docker-compose.yml", "deploy/compose/docker-compose.test.yml"]
SERVICES = ["fusedps", "prometheus", "trainer"]
PORTS = {"gRPC": 50051, "metrics": 9464, "Prometheus": 9090}
PROMETHEUS = "http://127.0.0.1:9090"
GRACE_SECONDS = 120  # stop_grace_period of the fusedps service in docker-compose.yml
SERVER_UID = "10001"


class StackError(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise StackError(message)


def log(message: str) -> None:
    print(f"stack_test: {message}", flush=True)


def run(*args: str, check_rc: bool = True, timeout: float = 600) -> str:
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check_rc and result.returncode != 0:
        raise StackError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}"
                         f"{result.stderr}")
    return result.stdout


class Stack:
    def __init__(self, project: str):
        self.project = project
        self.compose = ["docker-compose", "-p", project]
        for path in COMPOSE_FILES:
            self.compose += ["-f", path]

    def __call__(self, *args: str, **kwargs) -> str:
        return run(*self.compose, *args, **kwargs)

    def container(self, service: str) -> str:
        ids = self("ps", "-a", "-q", service).split()
        check(len(ids) == 1, f"service {service}: {len(ids)} containers")
        return ids[0]

    def leftovers(self) -> dict:
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: run("docker", *command, "--filter", label, "-q").split()
                for kind, command in (("containers", ["ps", "-a"]), ("networks", ["network", "ls"]),
                                      ("volumes", ["volume", "ls"]))}

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "--timeout", str(GRACE_SECONDS), check_rc=False)


def inspect(container: str, template: str) -> str:
    return run("docker", "inspect", "-f", template, container).strip()


def wait_healthy(container: str, timeout: float = 90) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        status = inspect(container, "{{.State.Status}} {{.State.Health.Status}}")
        if status == "running healthy":
            return time.monotonic() - start
        check(not status.startswith("exited"), f"server container exited: {status}")
        time.sleep(0.5)
    raise StackError(f"server not healthy within {timeout} s: {status}")


def grpc_health(address: str) -> int:
    """grpc.health.v1.Health/Check with an empty service name, without generated stubs: the
    request is the empty message, the reply field 1 (status) as a varint; 1 is SERVING."""
    with grpc.insecure_channel(address) as channel:
        check_rpc = channel.unary_unary("/grpc.health.v1.Health/Check")
        reply = check_rpc(b"", timeout=10)
    check(len(reply) == 2 and reply[0] == 0x08, f"health reply {reply!r}")
    return reply[1]


def prometheus_query(expr: str) -> list:
    url = f"{PROMETHEUS}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.load(reply)
    check(body["status"] == "success", f"{expr}: {body}")
    return body["data"]["result"]


def until(what: str, probe, timeout: float = 90):
    """Calls probe() until it returns a true value; the last value or error names the failure."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
            last = value
        except (OSError, StackError, ValueError) as e:
            last = e
        time.sleep(1)
    raise StackError(f"{what}: not true within {timeout} s (last: {last})")


def recording_rules() -> list:
    rules_dir = os.path.join(ROOT, "deploy", "prometheus", "rules")
    records = []
    for name in sorted(os.listdir(rules_dir)):
        with open(os.path.join(rules_dir, name)) as f:
            for group in yaml.safe_load(f)["groups"]:
                records += [rule["record"] for rule in group["rules"] if "record" in rule]
    return records


def probe_state(stack: Stack) -> dict:
    """tests/deploy/stack_probe.py in a one-off trainer container on the stack's network."""
    out = stack("run", "--rm", "--no-deps", "-v",
                f"{ROOT}/tests/deploy/stack_probe.py:/opt/fusedps/stack_probe.py:ro",
                "trainer", "python3", "stack_probe.py", "fusedps:50051")
    return json.loads(out.strip().splitlines()[-1])


def ports_free() -> None:
    for what, port in PORTS.items():
        with socket.socket() as s:
            busy = s.connect_ex(("127.0.0.1", port)) == 0
        check(not busy, f"127.0.0.1:{port} ({what}) is in use; docker-compose.yml publishes it")


def test(stack: Stack, report: dict) -> None:
    ports_free()
    log(f"up: {' '.join(SERVICES)}")
    stack("up", "-d", "--no-build", *SERVICES)
    server = stack.container("fusedps")
    report["healthy after s"] = round(wait_healthy(server), 1)
    check(inspect(server, "{{.Config.User}}").split(":")[0] == SERVER_UID, "image USER")
    uid = run("docker", "exec", server, "id", "-u").strip()
    check(uid == SERVER_UID, f"server runs as UID {uid}, not {SERVER_UID}")
    check(grpc_health(f"127.0.0.1:{PORTS['gRPC']}") == 1, "gRPC health is not SERVING")
    with urllib.request.urlopen(f"http://127.0.0.1:{PORTS['metrics']}/metrics", timeout=10) as r:
        check(b"fusedps_optimizer_steps_total" in r.read(), "/metrics lacks the step counter")
    log(f"server {server[:12]} healthy, UID {uid}, gRPC health SERVING, /metrics served")

    trainer = stack.container("trainer")
    exit_code = int(run("docker", "wait", trainer, timeout=900).strip())
    output = run("docker", "logs", trainer)
    print(output, end="")
    check(exit_code == 0, f"trainer exited {exit_code}")
    accuracy = float(re.search(r"final test accuracy ([0-9.]+)", output).group(1))
    pushes = int(re.search(r"^(\d+) steps in ", output, re.M).group(1))
    check(accuracy >= 0.9, f"accuracy {accuracy} < 0.9")
    check(pushes > 0, "no pushes")
    report.update(accuracy=accuracy, pushes=pushes)

    until("up{job=\"fusedps\"} == 1", lambda: [
        s for s in prometheus_query('up{job="fusedps"}') if s["value"][1] == "1"])
    steps = until("fusedps_optimizer_steps_total == the trainer's pushes", lambda: [
        s for s in prometheus_query('sum(fusedps_optimizer_steps_total{job="fusedps"})')
        if int(float(s["value"][1])) == pushes])
    report["steps in Prometheus"] = int(float(steps[0]["value"][1]))
    records = recording_rules()
    for record in records:
        until(f"recording rule {record} has data", lambda: prometheus_query(record))
    with urllib.request.urlopen(f"{PROMETHEUS}/api/v1/rules", timeout=10) as reply:
        groups = json.load(reply)["data"]["groups"]
    bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]
           if r["health"] != "ok"]
    check(not bad, f"rules not healthy: {bad}")
    report["recording rules with data"] = len(records)
    log(f"Prometheus: up == 1, steps == {pushes} pushes, {len(records)} recording rules have "
        f"data, {sum(len(g['rules']) for g in groups)} rules healthy")

    before = probe_state(stack)
    check(before["version"] == pushes, f"server version {before['version']} != {pushes}")
    start = time.monotonic()
    run("docker", "stop", "--time", str(GRACE_SECONDS), server, timeout=GRACE_SECONDS + 60)
    stopped_in = time.monotonic() - start
    code = inspect(server, "{{.State.ExitCode}} {{.State.OOMKilled}}")
    check(code == "0 false", f"server exit status, OOM-killed: {code}")
    check(stopped_in < GRACE_SECONDS, f"docker stop took {stopped_in:.1f} s")
    report["docker stop s"] = round(stopped_in, 2)
    log(f"docker stop: exit 0 in {stopped_in:.2f} s (grace {GRACE_SECONDS} s)")

    run("docker", "start", server)
    wait_healthy(server)
    after = probe_state(stack)
    check(after == before, f"after the restart {after}, before {before}")
    report["restart"] = f"version {after['version']}, {after['tensors']} tensors, same sha256"
    log(f"restarted on the same volume: {report['restart']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", default="fusedps-test", help="compose project name")
    parser.add_argument("--keep", action="store_true", help="leave the stack up (debugging)")
    args = parser.parse_args()
    stack = Stack(args.project)
    report: dict = {}
    failed = None
    try:
        test(stack, report)
    except (StackError, subprocess.TimeoutExpired, AttributeError) as e:
        failed = e
        for service in ("fusedps", "prometheus"):
            print(stack("logs", "--tail", "30", service, check_rc=False), file=sys.stderr)
    finally:
        if not args.keep:
            stack.down()
            left = stack.leftovers()
            if any(left.values()):
                failed = failed or StackError(f"left behind after down -v: {left}")
            else:
                report["left behind"] = "nothing"
    for key, value in report.items():
        print(f"  {key:28s} {value}")
    if failed:
        print(f"stack_test: FAILED: {failed}", file=sys.stderr)
        return 1
    print("stack_test: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
