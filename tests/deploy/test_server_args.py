"""Runs fusedps-server with exactly the arguments that deploy/ gives it, until it is ready.

Sources of arguments: the rendered Kubernetes StatefulSet of the base and of each overlay (its
command and args, with $(VAR) taken from the envFrom ConfigMap as the kubelet does), the
resolved docker-compose file, and each Dockerfile's ENTRYPOINT + CMD. The only changes: the
--listen and --metrics-listen addresses become 127.0.0.1:0 (a free port), plus --port-file and
--metrics-port-file to learn the ports, and the paths of the volumes (the checkpoint volume,
the Secrets' mounts) become temporary directories. Then, on the running server: every probe's
and health check's port is the --listen port and its gRPC health service is SERVING, /metrics
answers, and SIGTERM ends it with exit status 0.

Security (the Kubernetes variants: docs/operations.md, "Security"): each Secret volume's files
that the arguments and the probes name are made here, as the Secret would hold them: tls.crt
and tls.key a certificate signed by ca.crt, a test CA (by openssl), with the names and usages
of the variant's cert-manager Certificate for that Secret where it has one (else localhost,
127.0.0.1, server and client auth); tokens one admin token. The probes (exec: the fusedps CLI
over TLS) run as they are, with the CLI built here, and must pass on the serving server and
fail once it has stopped; a call without TLS, without a token, or (mTLS) without a client
certificate must be refused.

The --device=cuda:0 of the gpu overlay (and of sharded-4, built on it) on a machine without a
GPU: the server must refuse to start with an error that names CUDA, and then the same arguments
with --device=cpu must serve. With a GPU (FUSEDPS_TEST_CUDA=1), they run as they are.

Environment: FUSEDPS_SERVER, FUSEDPS_CLI (the executables), FUSEDPS_RENDERED (render.sh's and
compose_config.sh's output folder), FUSEDPS_SOURCE_DIR (the repository).
"""
import functools
import json
import os
import pathlib
import re
import shlex
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


def k8s_objects(variant):
    return [o for o in yaml.safe_load_all((RENDERED / f"{variant}.yaml").read_text()) if o]


def k8s_spec(variant):
    objects = k8s_objects(variant)
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
    probes = {name: container[name] for name in
              ("startupProbe", "livenessProbe", "readinessProbe")}
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret_mounts = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")  # Claims are not volumes.
        if secret:
            assert "subPath" not in mount, f"{mount}: a subPath mount never sees updates"
            secret_mounts[mount["mountPath"]] = secret["secretName"]
    certificates = {o["spec"]["secretName"]: o["spec"] for o in objects
                    if o["kind"] == "Certificate" and
                    o["apiVersion"].startswith("cert-manager.io/")}
    return {
        "argv": argv,
        "probes": probes,
        "ports": {p["name"]: p["containerPort"] for p in container["ports"]},
        "grace_period": pod["terminationGracePeriodSeconds"],
        "secret_mounts": secret_mounts,
        "certificates": certificates,
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
    # The gpu overlay with mutual TLS and cert-manager's certificates.
    "k8s-mtls": lambda: k8s_spec("mtls"),
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


def local_path(arg, paths):
    """arg with a leading FLAG= value (or the whole arg) under a mapped directory remapped."""
    flag_, sep, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    for mount, local in paths.items():
        if value == mount or value.startswith(mount + "/"):
            return f"{flag_}{sep}{local}{value[len(mount):]}"
    return arg


def local_argv(argv, tmp, paths=None):
    """argv with the listen addresses moved to free loopback ports, the checkpoint directory
    (the manifests' volume) to a temporary one and the Secrets' mount paths to `paths`, plus
    port files."""
    out = [SERVER]
    for arg in argv[1:]:
        if arg.startswith("--listen="):
            arg = "--listen=127.0.0.1:0"
        elif arg.startswith("--metrics-listen="):
            arg = "--metrics-listen=127.0.0.1:0"
        elif arg.startswith("--checkpoint-dir="):
            arg = f"--checkpoint-dir={tmp}/checkpoints"
        out.append(local_path(arg, paths or {}))
    return out + [f"--port-file={tmp}/grpc.port", f"--metrics-port-file={tmp}/metrics.port"]


# ------------------------------------------------------------------ the Secrets' files, made here

TEST_TOKEN = "deploy-test-admin-token-0123456789abcdef"
EXTENDED_KEY_USAGES = {"server auth": "serverAuth", "client auth": "clientAuth"}
TLS_SECRET_KEYS = ("tls.crt", "tls.key", "ca.crt")


def openssl(*args, cwd):
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, f"openssl {shlex.join(args)}: {result.stderr}"


@functools.lru_cache(maxsize=None)
def make_certificates(names, usages):
    """A test CA (ca.crt) and a certificate it signed (tls.crt, tls.key) with these subject
    alternative names and extended key usages; the directory that holds them."""
    out = pathlib.Path(tempfile.mkdtemp(prefix="fusedps-deploy-certs-"))
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-days", "1", "-subj", "/CN=fusedps deploy test CA",
            "-keyout", "ca.key", "-out", "ca.crt",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign", cwd=out)
    openssl("req", "-new", *ec, "-subj", "/CN=fusedps", "-keyout", "tls.key", "-out", "tls.csr",
            cwd=out)
    (out / "tls.ext").write_text(f"subjectAltName={names}\nextendedKeyUsage={usages}\n"
                                 "basicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-set_serial", "1", "-days", "1", "-extfile", "tls.ext", "-out", "tls.crt", cwd=out)
    return out


def certificates_for(certificate):
    """The test certificates for a cert-manager Certificate's spec (None: the defaults)."""
    if certificate is None:
        return make_certificates("DNS:localhost,IP:127.0.0.1", "serverAuth,clientAuth")
    names = [f"DNS:{n}" for n in certificate.get("dnsNames", [])]
    names += [f"IP:{a}" for a in certificate.get("ipAddresses", [])]
    usages = [EXTENDED_KEY_USAGES[u] for u in certificate.get("usages", [])
              if u in EXTENDED_KEY_USAGES]
    assert names and usages, f"Certificate {certificate}: no names or no TLS usages"
    return make_certificates(",".join(names), ",".join(usages))


def secret_files(spec, commands, tmp):
    """Makes, under tmp, the files of each Secret volume that `commands` (the server's argv and
    the probes') name, as the Secret would hold them; returns {mount path: local directory}."""
    paths = {}
    for mount, secret in spec.get("secret_mounts", {}).items():
        local = pathlib.Path(tmp) / "secrets" / secret
        local.mkdir(parents=True)
        paths[mount] = str(local)
        certificates = certificates_for(spec["certificates"].get(secret))
        named = {a.partition("=")[2] if a.startswith("--") else a
                 for command in commands for a in command}
        for name in sorted({p[len(mount) + 1:] for p in named if p.startswith(mount + "/")}):
            if name in TLS_SECRET_KEYS:  # A kubernetes.io/tls Secret holds all three.
                for key in TLS_SECRET_KEYS:
                    (local / key).write_bytes((certificates / key).read_bytes())
            elif name == "tokens":
                (local / name).write_text(f"# deploy test\n{TEST_TOKEN} admin deploy-test\n")
            else:
                pytest.fail(f"{mount}/{name} (Secret {secret}): this test does not know what "
                            "such a file holds; teach secret_files")
    return paths


def probe_commands(spec):
    """Each exec probe's command: {probe name: argv}."""
    out = {}
    for name, probe in spec.get("probes", {}).items():
        assert "exec" in probe, f"{name}: {probe} (the kubelet's gRPC probe cannot speak TLS)"
        out[name] = probe["exec"]["command"]
    return out


def tls_options(argv):
    """The CLI flags that connect to a server with these (local) arguments: TLS with the test
    CA, and the pod's own certificate under mTLS; nothing for a plaintext server."""
    cert = flag(argv, "tls-cert")
    if not cert:
        return []
    certificates = pathlib.Path(cert).parent
    out = [f"--tls-ca={certificates}/ca.crt"]
    if flag(argv, "tls-client-ca"):
        out += [f"--tls-cert={cert}", f"--tls-key={flag(argv, 'tls-key')}"]
    return out


def channel_credentials(argv):
    """grpc credentials for a server with these (local) arguments, as tls_options."""
    options = dict(o[2:].split("=", 1) for o in tls_options(argv))
    if not options:
        return None
    read = lambda key: pathlib.Path(options[key]).read_bytes() if key in options else None
    return grpc.ssl_channel_credentials(read("tls-ca"), read("tls-key"), read("tls-cert"))


class RunningServer:
    def __init__(self, argv, spec=None):
        self.tmp = tempfile.mkdtemp(prefix="fusedps-deploy-")
        self.log = open(f"{self.tmp}/server.log", "w+")
        spec = spec or {}
        self.paths = secret_files(spec, [argv, *probe_commands(spec).values()], self.tmp)
        self.argv = local_argv(argv, self.tmp, self.paths)
        self.credentials = channel_credentials(self.argv)
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


def health_status(port, service, credentials=None):
    """grpc.health.v1.Health/Check with hand-encoded messages: 0 UNKNOWN, 1 SERVING, ...
    Over TLS (credentials) at localhost, the name the probes check the certificate against."""
    request = service.encode()
    request = bytes([0x0A, len(request)]) + request if request else b""
    channel = (grpc.secure_channel(f"localhost:{port}", credentials) if credentials else
               grpc.insecure_channel(f"127.0.0.1:{port}"))
    with channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        response = check(request, timeout=10)
    assert response in (b"", b"\x08\x00", b"\x08\x01", b"\x08\x02", b"\x08\x03"), response
    return response[1] if response else 0


def metrics_text(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def serve_and_check(argv, spec=None):
    """Starts the server; returns it once it serves gRPC health and /metrics."""
    server = RunningServer(argv, spec)
    try:
        server.wait_ready()
        for service in SERVICES:
            assert health_status(server.port, service, server.credentials) == 1, \
                f"health of {service!r}"
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
        tmp = tempfile.mkdtemp()
        paths = secret_files(spec, [argv], tmp)
        refused = subprocess.run(local_argv(argv, tmp, paths), capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode != 0, "--device=cuda without a GPU must not start"
        assert "cuda" in refused.stderr.lower(), refused.stderr
        print(f"{source}: without a GPU, {device} is refused: {refused.stderr.strip()}")
        argv = [a if not a.startswith("--device=") else "--device=cpu" for a in argv]

    server = serve_and_check(argv, spec)
    grace = int(flag(argv, "shutdown-grace-seconds") or 30)
    if "grace_period" in spec:
        assert spec["grace_period"] >= grace + 10, "the platform must wait out the drain"
    assert server.stop(timeout=grace + 10) == 0, server.output()
    assert "fusedps-server stopped" in server.output()


K8S_SOURCES = [s for s in SPECS if s.startswith("k8s-")]


def cpu_if_no_cuda(argv):
    if HAVE_CUDA:
        return argv
    return [a if not a.startswith("--device=cuda") else "--device=cpu" for a in argv]


def run_cli(server, command, timeout=30):
    """The CLI with `command` (after the program name), its paths and --target made local."""
    local = [CLI]
    for arg in command:
        if arg.startswith("--target="):
            host = arg.split("=", 1)[1].rsplit(":", 1)[0]
            arg = f"--target={host}:{server.port}"
        local.append(local_path(arg, server.paths))
    return local, subprocess.run(local, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("source", K8S_SOURCES)
def test_k8s_probes_name_the_servers_port_and_services(source):
    spec = SPECS[source]()
    listen_port = port_of(flag(spec["argv"], "listen"))
    assert spec["ports"]["grpc"] == listen_port
    assert spec["ports"]["metrics"] == port_of(flag(spec["argv"], "metrics-listen"))
    for name, command in probe_commands(spec).items():
        assert command[:2] == ["fusedps", "health"], f"{name}: {command}"
        target = flag(command, "target")
        assert target and port_of(target) == listen_port, \
            f"{name} probes {target}, the server listens on port {listen_port}"
        assert (flag(command, "service") or "") in SERVICES, f"{name}: {command}"
        timeout = flag(command, "timeout")
        assert timeout and timeout.endswith("s") and \
            float(timeout[:-1]) < spec["probes"][name]["timeoutSeconds"], \
            f"{name}: the CLI's --timeout must end before the probe's timeoutSeconds"


@pytest.mark.parametrize("source", K8S_SOURCES)
def test_k8s_probes_pass_on_a_serving_server(source):
    """Each probe's command, as the kubelet runs it in the container, against the server with
    the deployed arguments and the Secrets' files: exit 0 while it serves, non-zero after."""
    spec = SPECS[source]()
    server = serve_and_check(cpu_if_no_cuda(spec["argv"]), spec)
    probes = probe_commands(spec)
    try:
        for name, command in probes.items():
            local, result = run_cli(server, command[1:],
                                    timeout=spec["probes"][name]["timeoutSeconds"])
            assert result.returncode == 0, f"{name}: {local}: {result.stdout}{result.stderr}"
            assert "SERVING" in result.stdout
    finally:
        assert server.stop(timeout=40) == 0, server.output()
    for name, command in probes.items():
        local, result = run_cli(server, command[1:])
        assert result.returncode != 0, f"{name} passes with no server: {local}"


@pytest.mark.parametrize("source", K8S_SOURCES)
def test_k8s_security_is_on(source):
    """The deployed server serves TLS only and wants a token on every ParameterService call
    (and, with --tls-client-ca, a client certificate at the handshake)."""
    spec = SPECS[source]()
    argv = spec["argv"]
    for needed in ("tls-cert", "tls-key", "auth-tokens"):
        assert flag(argv, needed), f"{source}: --{needed} is not set"
    server = serve_and_check(cpu_if_no_cuda(argv), spec)
    try:
        tls = tls_options(server.argv)
        token = pathlib.Path(server.tmp) / "admin.token"
        token.write_text(TEST_TOKEN + "\n")
        target = f"--target=localhost:{server.port}"
        calls = {
            "plaintext": ([target, "info"], "UNAVAILABLE"),
            "without a token": ([target, *tls, "info"], "UNAUTHENTICATED"),
            "with a wrong token": ([target, *tls, f"--token={'x' * 32}", "info"],
                                   "UNAUTHENTICATED"),
            "with the token": ([target, *tls, f"--token-file={token}", "info"], None),
        }
        if flag(argv, "tls-client-ca"):
            server_only = [o for o in tls if o.startswith("--tls-ca=")]
            calls["without a client certificate"] = (
                [target, *server_only, f"--token-file={token}", "info"], "UNAVAILABLE")
        for what, (command, refused_with) in calls.items():
            local, result = run_cli(server, command)
            if refused_with is None:
                assert result.returncode == 0, f"{what}: {local}: {result.stderr}"
            else:
                assert result.returncode != 0, f"{what}: {local} was not refused"
                assert refused_with in result.stderr, f"{what}: {local}: {result.stderr}"
    finally:
        assert server.stop(timeout=40) == 0, server.output()


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
    server = serve_and_check(cpu_if_no_cuda(spec["argv"]))
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
