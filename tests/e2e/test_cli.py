"""End-to-end tests of the `fusedps` CLI against a real fusedps-server: its pull writes a
safetensors file that an independent reader (the format's definition, in Python below; and
safetensors.torch.load_file where that package is installed) reads back bit-exact.

The CLI binary: $FUSEDPS_CLI, else build/client/fusedps (ctest sets it).
"""

from __future__ import annotations

import json
import os
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
