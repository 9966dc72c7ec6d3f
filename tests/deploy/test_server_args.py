"""Runs fusedps-server with exactly the arguments that deploy/ gives it, until it is ready.

Sources of arguments: the rendered Kubernetes StatefulSet of the base and of each overlay (its
command and args, with $(VAR) taken from the envFrom ConfigMap as the kubelet does), the
resolved docker-compose file, and each Dockerfile's ENTRYPOINT + CMD. The only changes: the
--listen and --metrics-listen addresses become 127.0.0.1:0 (a free port), plus --port-file and
--metrics-port-file to learn the ports. Then, on the running server: every probe's and health
check's port is the --listen port and its gRPC health service is SERVING, /metrics answers,
and SIGTERM ends it with exit status 0.

The --device=cuda:0 of the gpu overlay (and of sharded-4, built on it) on a machine without a
GPU: the server must refuse to start with an error that names CUDA, and then the same arguments
with --device=cpu must serve. With a GPU (FUSEDPS_TEST_CUDA=1), they run as they are.

Environment: FUSEDPS_SERVER, FUSEDPS_CLI (the executables), FUSEDPS_RENDERED (render.sh's and
compose_config.sh's output folder), FUSEDPS_SOURCE_DIR (the repository).
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import tempfile
import time
import urllib.request

import grpc
import pytest
import yaml

SERVER = os.environ["FUSEDPS_SERVER"]
CLI = os.environ["FUSEDPS_CLI"]
RENDERED = pathlib.Path(os.environ["FUSEDPS_RENDERED"])
SOURCE = pathlib.Path(os.environ["FUSEDPS_SOURCE_DIR"])
HAVE_CUDA = os.environ.get("FUSEDPS_TEST_CUDA") == "1"
SERVICES = ("", "fusedps.v1.ParameterService")
READY_TIMEOUT_S = 60


# ---------------------------------------------------------------- where the arguments come from


def k8s_spec(variant):
    objects = [o for o in yaml.safe_load_all((RENDERED / f"{variant}.yaml").read_text()) if o]
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(next(o for o in objects if o["kind"] == "ConfigMap" and
                        o["metadata"]["name"] == name)["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", [])})

    def resolve(arg):
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], arg)

    argv = [resolve(a) for a in container.get("command", []) + container.get("args", [])]
    probes = [(name, container[name]["grpc"]) for name in
              ("startupProbe", "livenessProbe", "readinessProbe")]
    return {
        "argv": argv,
        "grpc_checks": [(name, g["port"], g.get("service", "")) for name, g in probes],
        "ports": {p["name"]: p["containerPort"] for p in container["ports"]},
        "grace_period": pod["terminationGracePeriodSeconds"],
    }


def compose_spec():
    compose = yaml.safe_load((RENDERED / "compose.yaml").read_text())
    service = compose["services"]["fusedps"]
    # The image's ENTRYPOINT is fusedps-server; compose's command is its arguments.
    entrypoint = dockerfile_instructions(SOURCE / "deploy/docker/Dockerfile.cpu")["ENTRYPOINT"]
    ports = [int(p.split(":")[-1].split("/")[0]) for p in service["ports"]]
    return {
        "argv": entrypoint + service["command"],
        "healthcheck": service["healthcheck"]["test"][1:],  # after "CMD"
        "container_ports": ports,
        "grace_period": duration_seconds(service["stop_grace_period"]),
        "service": service,
    }


def dockerfile_instructions(path):
    """The last ENTRYPOINT, CMD and HEALTHCHECK of a Dockerfile, in exec form."""
    text = re.sub(r"\\\n", " ", path.read_text())
    found = {}
    for line in text.splitlines():
        keyword, _, rest = line.strip().partition(" ")
        if keyword == "HEALTHCHECK":
            rest = re.sub(r"^(--\S+\s+)*CMD\s+", "", rest.strip())
        if keyword in ("ENTRYPOINT", "CMD", "HEALTHCHECK"):
            found[keyword] = json.loads(rest)
    return found


def docker_spec(name):
    instructions = dockerfile_instructions(SOURCE / "deploy/docker" / name)
    return {"argv": instructions["ENTRYPOINT"] + instructions["CMD"],
            "healthcheck": instructions["HEALTHCHECK"]}


def duration_seconds(text):
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", str(text))
    assert match and text, f"duration {text}"
    return int(match.group(1) or 0) * 60 + int(match.group(2) or 0)


SPECS = {
    "k8s-base": lambda: k8s_spec("base"),
    "k8s-gpu": lambda: k8s_spec("gpu"),
    "k8s-cpu": lambda: k8s_spec("cpu"),
    # The gpu overlay with 4 replicas and sync mode's flags (--mode=sync, K of N, the round
    # timeout): one server of it is one shard.
    "k8s-sharded-4": lambda: k8s_spec("sharded-4"),
    "compose": compose_spec,
    "docker-cuda": lambda: docker_spec("Dockerfile"),
    "docker-cpu": lambda: docker_spec("Dockerfile.cpu"),
}


# ----------------------------------------------------------------------------- running a server


def flag(argv, name):
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    assert len(values) <= 1, f"--{name} given twice in {argv}"
    return values[0] if values else None


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def local_argv(argv, tmp):
    """argv with the listen addresses moved to free loopback ports and the checkpoint directory
    (the manifests' volume) to a temporary one, plus port files."""
    out = [SERVER]
    for arg in argv[1:]:
        if arg.startswith("--listen="):
            arg = "--listen=127.0.0.1:0"
        elif arg.startswith("--metrics-listen="):
            arg = "--metrics-listen=127.0.0.1:0"
        elif arg.startswith("--checkpoint-dir="):
            arg = f"--checkpoint-dir={tmp}/checkpoints"
        out.append(arg)
    return out + [f"--port-file={tmp}/grpc.port", f"--metrics-port-file={tmp}/metrics.port"]


class RunningServer:
    def __init__(self, argv):
        self.tmp = tempfile.mkdtemp(prefix="fusedps-deploy-")
        self.log = open(f"{self.tmp}/server.log", "w+")
        self.argv = local_argv(argv, self.tmp)
        self.process = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self):
        if not self.log.closed:
            self.log.flush()
        return pathlib.Path(f"{self.tmp}/server.log").read_text()

    def wait_ready(self):
        port_file = pathlib.Path(f"{self.tmp}/grpc.port")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not port_file.exists():
            if self.process.poll() is not None:
                pytest.fail(f"{self.argv} exited {self.process.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.argv} not ready in {READY_TIMEOUT_S}s:\n{self.output()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.metrics_port = int(pathlib.Path(f"{self.tmp}/metrics.port").read_text())
        assert "fusedps-server listening on" in self.output()

    def stop(self, timeout):
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.log.close()


def health_status(port, service):
    """grpc.health.v1.Health/Check with hand-encoded messages: 0 UNKNOWN, 1 SERVING, ..."""
    request = service.encode()
    request = bytes([0x0A, len(request)]) + request if request else b""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        response = check(request, timeout=10)
    assert response in (b"", b"\x08\x00", b"\x08\x01", b"\x08\x02", b"\x08\x03"), response
    return response[1] if response else 0


def metrics_text(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def serve_and_check(argv):
    """Starts the server; returns it once it serves gRPC health and /metrics."""
    server = RunningServer(argv)
    try:
        server.wait_ready()
        for service in SERVICES:
            assert health_status(server.port, service) == 1, f"health of {service!r}"
        assert "fusedps_" in metrics_text(server.metrics_port)
    except BaseException:
        server.stop(timeout=10)
        raise
    return server


# ------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("source", SPECS)
def test_arguments_serve_and_drain(source):
    spec = SPECS[source]()
    argv = spec["argv"]
    assert os.path.basename(argv[0]) == "fusedps-server", argv
    listen, metrics_listen = flag(argv, "listen"), flag(argv, "metrics-listen")
    assert listen and metrics_listen, f"{argv} must set --listen and --metrics-listen"
    assert (port_of(listen), port_of(metrics_listen)) == (50051, 9464)

    device = flag(argv, "device")
    if device and device.startswith("cuda") and not HAVE_CUDA:
        refused = subprocess.run(local_argv(argv, tempfile.mkdtemp()), capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode != 0, "--device=cuda without a GPU must not start"
        assert "cuda" in refused.stderr.lower(), refused.stderr
        print(f"{source}: without a GPU, {device} is refused: {refused.stderr.strip()}")
        argv = [a if not a.startswith("--device=") else "--device=cpu" for a in argv]

    server = serve_and_check(argv)
    grace = int(flag(argv, "shutdown-grace-seconds") or 30)
    if "grace_period" in spec:
        assert spec["grace_period"] >= grace + 10, "the platform must wait out the drain"
    assert server.stop(timeout=grace + 10) == 0, server.output()
    assert "fusedps-server stopped" in server.output()


@pytest.mark.parametrize("source", ["k8s-base", "k8s-gpu", "k8s-cpu", "k8s-sharded-4"])
def test_k8s_probes_name_the_servers_port_and_services(source):
    spec = SPECS[source]()
    listen_port = port_of(flag(spec["argv"], "listen"))
    assert spec["ports"]["grpc"] == listen_port
    assert spec["ports"]["metrics"] == port_of(flag(spec["argv"], "metrics-listen"))
    for name, port, service in spec["grpc_checks"]:
        assert port == listen_port, f"{name} probes port {port}, the server listens on {listen_port}"
        assert service in SERVICES, f"{name} asks for service {service!r}"


def test_compose_container_settings():
    spec = compose_spec()
    service = spec["service"]
    argv = spec["argv"]
    assert sorted(spec["container_ports"]) == sorted(
        [port_of(flag(argv, "listen")), port_of(flag(argv, "metrics-listen"))])
    assert service["read_only"] is True
    assert not str(service["user"]).startswith(("0", "root"))
    assert any(v.endswith(":/var/lib/fusedps:rw") or v.endswith(":/var/lib/fusedps")
               for v in service["volumes"]), service["volumes"]


@pytest.mark.parametrize("source", ["compose", "docker-cuda", "docker-cpu"])
def test_healthcheck_command_passes_on_a_serving_server(source):
    spec = SPECS[source]()
    command = spec["healthcheck"]
    assert command[:2] == ["fusedps", "health"], command
    target = flag(command, "target")
    assert target and port_of(target) == port_of(flag(spec["argv"], "listen")), command
    argv = spec["argv"]
    if not HAVE_CUDA:
        argv = [a if not a.startswith("--device=cuda") else "--device=cpu" for a in argv]
    server = serve_and_check(argv)
    try:
        local = [CLI, *[f"--target=127.0.0.1:{server.port}" if a.startswith("--target=") else a
                        for a in command[1:]]]
        result = subprocess.run(local, capture_output=True, text=True, timeout=30)
        if "unknown command health" in result.stderr:
            pytest.fail("the fusedps CLI has no `health` subcommand, which the Dockerfiles' and "
                        "compose's HEALTHCHECK run: `fusedps health --target=HOST:PORT` must "
                        "exit 0 when grpc.health.v1 reports SERVING")
        assert result.returncode == 0, f"{local}: {result.stdout}{result.stderr}"
    finally:
        assert server.stop(timeout=40) == 0
    # And it must fail once nothing serves there.
    result = subprocess.run(local, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0, "the health check passes with no server"
