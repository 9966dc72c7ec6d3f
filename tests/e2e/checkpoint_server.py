"""A fusedps-server process that checkpoint tests start, SIGKILL and start again on one
--checkpoint-dir, and the independent checks they make of the shard and the files.

The independent references:
  * shard_digest: sha256 of every tensor's params, exp_avg, exp_avg_sq (max_exp_avg_sq for
    amsgrad tensors), its step, and the version, read through the public API;
  * newest_complete / read_safetensors: the checkpoint directory read by the format's
    definition (docs/checkpoints.md), without the server's code;
  * to_format_3: a manifest of format 4 rewritten as format 3, for the readers of older
    formats.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import tempfile
from typing import Dict, List, Sequence, Tuple

import fusedps

from prometheus_text import Samples, scrape_samples
from server_fixture import server_command, server_path, wait_for_port
from test_cli import read_safetensors


class ServerProcess:
    """One fusedps-server (CPU backend unless $FUSEDPS_TEST_DEVICE), logging to a file."""

    def __init__(self, args: Sequence[str], preexec_fn=None, start_timeout: float = 60.0):
        self._tmp = tempfile.TemporaryDirectory(prefix="fusedps-ckpt-")
        port_file = os.path.join(self._tmp.name, "port")
        self.log_path = os.path.join(self._tmp.name, "server.log")
        cmd = server_command(server_path(), port_file,
                             [f"--metrics-port-file={port_file}.metrics", *args])
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
        try:
            port = wait_for_port(self.proc, port_file, start_timeout, self.log)
        except BaseException:
            self.kill()
            raise
        self.target = f"127.0.0.1:{port}"
        with open(f"{port_file}.metrics") as f:
            self.metrics_port = int(f.read().strip())

    def log(self, n: int = 20000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")[-n:]

    def metrics(self) -> Samples:
        return scrape_samples(self.metrics_port)

    def kill(self) -> None:
        """SIGKILL: no drain, no checkpoint."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        self.kill()
        self._tmp.cleanup()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shard_digest(client: "fusedps.Client") -> Tuple[str, int]:
    """(sha256 hex, version) of the whole shard's state as the server serves it.

    Hashes, per tensor in registration order: its name, step, and the fp32 bytes of params,
    exp_avg, exp_avg_sq, and max_exp_avg_sq for tensors of amsgrad groups; then the version.
    Raises when the version moves while it reads (callers read a quiet server).
    """
    listing = client.list_tensors()
    amsgrad = {g.name for g in client.info().param_groups if g.amsgrad}
    names = [t.name for t in listing]
    fields = {"param": client.pull_parameters(names)}
    for field in ("exp_avg", "exp_avg_sq"):
        fields[field] = client.pull_state(field, names)[0]
    ams_names = [t.name for t in listing if t.param_group in amsgrad]
    if ams_names:
        fields["max_exp_avg_sq"] = client.pull_state("max_exp_avg_sq", ams_names)[0]
    h = hashlib.sha256()
    for t in listing:
        h.update(t.name.encode())
        h.update(int(t.step).to_bytes(8, "little"))
        for field, values in fields.items():
            if t.name in values:
                h.update(values[t.name].contiguous().numpy().tobytes())
    version = client.list_tensors().version
    if version != listing.version:
        raise RuntimeError(f"the version moved from {listing.version} to {version}")
    h.update(int(version).to_bytes(8, "little"))
    return h.hexdigest(), version


def complete_checkpoints(root: str) -> List[Tuple[int, str]]:
    """(serial, directory) of every directory with a manifest.json, newest first."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if name.startswith("checkpoint-") and os.path.exists(os.path.join(path, "manifest.json")):
            found.append((int(name[len("checkpoint-"):]), path))
    return sorted(found, reverse=True)


def manifest_of(directory: str) -> Dict:
    """manifest.json's JSON as it is (format 4: 64-bit integers are strings)."""
    with open(os.path.join(directory, "manifest.json")) as f:
        return json.load(f)


def to_format_3(m: Dict) -> Dict:
    """A format 4 manifest's JSON (fusedps.v1.CheckpointManifest in protobuf's JSON mapping) as
    format 3 wrote it (docs/checkpoints.md, "Formats 2 and 3"), by the format's definition: its
    64-bit integers as JSON numbers, a tensor's dtypes and the param copy's by their short names
    ("none": no copy). The param groups are the same in both."""
    names = {"DTYPE_FLOAT32": "fp32", "DTYPE_BFLOAT16": "bf16", "STATE_DTYPE_FLOAT32": "fp32",
             "STATE_DTYPE_BFLOAT16": "bf16", "STATE_DTYPE_INT8": "int8"}
    m = json.loads(json.dumps(m))
    m["format_version"] = 3
    m["param_copy_dtype"] = {"DTYPE_UNSPECIFIED": "none", "DTYPE_BFLOAT16": "bf16",
                             "DTYPE_FLOAT16": "fp16"}[m["param_copy_dtype"]]
    m["serial"], m["version"] = int(m["serial"]), int(m["version"])
    for t in m["tensors"]:
        t["shape"] = [int(d) for d in t["shape"]]
        t["step"] = int(t["step"])
        for key in ("params_dtype", "state_dtype"):
            t[key] = names[t[key]]
    for entry in m["files"].values():
        entry["bytes"] = int(entry["bytes"])
    for client in m["retry_table"]:
        client["highest"] = int(client["highest"])
        for r in client["replies"]:
            for key in ("sequence_number", "version", "grad_bytes"):
                r[key] = int(r[key])
    return m


def params_of(directory: str) -> Dict:
    """The params file's tensors (name -> torch tensor), read by the format's definition."""
    import torch
    tensors, _ = read_safetensors(os.path.join(directory, "params.safetensors"))
    return {name: torch.from_numpy(values.copy()) for name, values in tensors.items()}


def fsize_limit(max_bytes: int):
    """A preexec_fn: the child's files may not grow past max_bytes (writes fail with EFBIG, and
    SIGXFSZ, which would kill it, is ignored)."""
    def apply() -> None:
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return apply
