"""End-to-end tests of the `fusedps` CLI against a real fusedps-server: its pull writes a
safetensors file that an independent reader (the format's definition, in Python below; and
safetensors.torch.load_file where that package is installed) reads back bit-exact.

The CLI binary: $FUSEDPS_CLI, else build/client/fusedps (ctest sets it).
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess

import numpy as np
import pytest
import torch

from server_fixture import REPO_ROOT

CLI = os.environ.get("FUSEDPS_CLI") or os.path.join(REPO_ROOT, "build", "client", "fusedps")


def read_safetensors(path):
    """(tensors, metadata) of a safetensors file, read by its definition: u64 LE header length,
    a JSON header, then row-major little-endian data covered exactly by the offsets."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors, spans = {}, []
    for name, entry in header.items():
        assert entry["dtype"] == "F32", entry
        begin, end = entry["data_offsets"]
        spans.append((begin, end))
        tensors[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(entry["shape"])
    covered = 0
    for begin, end in sorted(spans):
        assert begin == covered, "a gap or an overlap in the data"
        covered = end
    assert covered == len(data), "the offsets do not cover the data"
    return tensors, metadata


@pytest.mark.skipif(not os.path.exists(CLI), reason=f"no CLI at {CLI}")
def test_pull_writes_safetensors_that_an_independent_reader_reads(client, server_target, tmp_path):
    g = torch.Generator().manual_seed(11)
    model = {
        "cli.w": torch.randn(3, 5, generator=g),
        "cli.b\u00e9": torch.randn(7, generator=g),  # A name that is not ASCII.
        "cli.empty": torch.zeros(0, 4),
        "cli.scalar": torch.tensor(0.25),
    }
    client.register_model(model)
    grads = {name: torch.ones_like(t) for name, t in model.items()}
    client.push_gradients(grads, tensors=["cli.w"])
    expected = client.pull_parameters(list(model))
    out = tmp_path / "pulled.safetensors"
    subprocess.run([CLI, f"--target={server_target}", "pull", f"--out={out}",
                    f"--tensors={','.join(model)}"], check=True, capture_output=True, timeout=60)

    tensors, metadata = read_safetensors(out)
    assert set(tensors) == set(model)
    for name in model:
        got = torch.from_numpy(tensors[name].copy())
        assert got.shape == model[name].shape, name
        assert torch.equal(got, expected[name].float()), name
    assert int(metadata["fusedps.version"]) == expected.version
    assert metadata["fusedps.field"] == "param"
    steps = json.loads(metadata["fusedps.steps"])
    assert steps == {"cli.w": 1, "cli.b\u00e9": 0, "cli.empty": 0, "cli.scalar": 0}

    try:
        from safetensors.torch import load_file
    except ImportError:
        return  # Not in Debian 12; the reader above is the check then.
    loaded = load_file(str(out))
    for name in model:
        assert torch.equal(loaded[name], expected[name].float()), name


@pytest.mark.skipif(not os.path.exists(CLI), reason=f"no CLI at {CLI}")
def test_list_shows_how_each_tensor_is_stored(client, server_target):
    """`fusedps list` names each tensor's stored params and state dtypes, as the server reports
    them to the client (a tensor under 4096 elements keeps fp32 state in an int8 group)."""
    client.register_param_group("cli-int8", state_dtype="int8", params_dtype="bf16",
                                rounding_seed=5)
    client.register_param_group("cli-bf16", state_dtype="bf16")
    g = torch.Generator().manual_seed(12)
    client.register_model([("cli8.big", torch.randn(16, 256, generator=g)),
                           ("cli8.small", torch.randn(300, generator=g))], param_group="cli-int8")
    client.register_model([("cli16.w", torch.randn(4, 4, generator=g))], param_group="cli-bf16")
    out = subprocess.run([CLI, f"--target={server_target}", "list"], check=True,
                         capture_output=True, text=True, timeout=60).stdout.splitlines()
    header = out[1].split()
    assert header == ["name", "shape", "group", "step", "params", "state", "numel"], out[:2]
    row = re.compile(r"^(\S+)\s+(\[[^\]]*\])\s+(\S+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\d+)$")
    rows = {}
    for line in out[2:]:
        match = row.match(line)
        assert match, line
        rows[match[1]] = dict(zip(header, match.groups()))
    expected = {"cli8.big": ("bf16", "int8", "4096"), "cli8.small": ("bf16", "fp32", "300"),
                "cli16.w": ("fp32", "bf16", "16")}
    for name, (params, state, numel) in expected.items():
        assert (rows[name]["params"], rows[name]["state"], rows[name]["numel"]) == \
            (params, state, numel), rows[name]
    listed = {t.name: (t.params_dtype, t.state_dtype) for t in client.list_tensors()}
    for name, (params, state, _) in expected.items():
        assert listed[name] == (params, state), name


def test_models_commands_create_list_describe_delete(server_target):
    """`fusedps models ...` and `--model`: a model created with its own consistency, listed,
    described, used by another command, deleted; usage errors exit 2, a missing model 1."""
    def cli(*args, check=True):
        return subprocess.run([CLI, f"--target={server_target}", *args], check=check,
                              capture_output=True, text=True, timeout=60)

    out = cli("models", "create", "cli-job", "--mode=bounded", "--max-staleness=4").stdout
    assert out.startswith("created\n") and "bounded (max staleness 4)" in out, out
    assert cli("models", "create", "cli-job").stdout.startswith("exists already")
    cli("register", "--model=cli-job", "--shapes=w:4x4")
    listed = cli("models", "list").stdout.splitlines()
    row = next(line.split() for line in listed if line.startswith("cli-job "))
    assert row[1:4] == ["0", "1", "16"], listed  # version, tensors, params
    assert int(row[4]) > 0  # memory_bytes
    described = cli("models", "describe", "cli-job").stdout
    assert "tensors      1" in described and "params       16" in described, described
    info = cli("info", "--model=cli-job").stdout
    assert "model        cli-job" in info and "tensors      1" in info, info
    out = cli("models", "delete", "cli-job").stdout
    assert out.startswith("deleted model cli-job:") and "freed" in out, out
    gone = cli("info", "--model=cli-job", check=False)
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr and "cli-job" in gone.stderr
    usage = cli("models", "delete", check=False)
    assert usage.returncode == 2 and "usage: fusedps models" in usage.stderr, usage.stderr
