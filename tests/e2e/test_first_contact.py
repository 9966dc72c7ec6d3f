"""A first contact that never misleads (issue 35): the mistakes users make first get an error
that says what happened, at once.

* A second server on a port that one already serves exits 1 naming the address (gRPC turns
  SO_REUSEPORT on by default: both would listen and split the connections).
* A wrong port raises a FusedPSError naming the target and the cause, within connect_timeout
  at worst, and a malformed target a ValueError naming it (TLS mismatches:
  client/python/tests/test_security.py).
* load_state_dict of a state_dict without "maximize" resets it to False, as torch does.
* The server reports the version of the package (one release, one number).
"""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
import torch

import fusedps
from fusedps import errors
from fusedps.torch import RemoteAdamW
from server_fixture import running_server, server_path

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_second_server_on_a_served_port_exits_1_naming_the_address(server_target):
    result = subprocess.run([server_path(), f"--listen={server_target}", "--device=cpu",
                             "--metrics-listen="], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr[-2000:]
    assert server_target in result.stderr
    assert "in use" in result.stderr
    # The first server still answers, alone.
    with fusedps.Client(server_target) as client:
        client.info()


def test_a_wrong_port_raises_a_fusedps_error_naming_the_target_at_once():
    target = f"127.0.0.1:{_free_port()}"  # Nothing listens there.
    model = torch.nn.Linear(3, 2)
    start = time.monotonic()
    with pytest.raises(errors.FusedPSError) as info:
        RemoteAdamW(model.named_parameters(), targets=target, connect_timeout=2.0)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert target in message and "refused" in message.lower(), message


@pytest.mark.parametrize("target", ["127.0.0.1:50051x", "127.0.0.1", "127.0.0.1:0",
                                    "127.0.0.1:70000", ":50051", "host:port"])
def test_malformed_targets_are_refused_naming_them(target):
    with pytest.raises(ValueError, match="target"):
        fusedps.Client(target)


@pytest.mark.parametrize("target", ["localhost:50051", "[::1]:50051", "dns:///ps-0:50051",
                                    "unix:/tmp/fusedps.sock", "ipv4:127.0.0.1:50051"])
def test_well_formed_targets_are_taken(target):
    fusedps.Client(target, transport="grpcio").close()


def test_load_state_dict_without_maximize_resets_it_as_torch_does(server_target):
    model = torch.nn.Linear(3, 2)
    ref = torch.optim.AdamW(model.parameters(), maximize=True)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target, prefix="maximize/",
                      maximize=True)
    try:
        saved = ref.state_dict()
        for group in saved["param_groups"]:
            del group["maximize"]  # A state_dict of a torch without the key.
        ref.load_state_dict(saved)
        opt.load_state_dict(saved)
        assert ref.param_groups[0]["maximize"] is False
        assert opt.param_groups[0]["maximize"] is False
    finally:
        opt.close()


def test_the_server_reports_the_packages_version(server_target):
    with fusedps.Client(server_target) as client:
        assert client.info().server_version == fusedps.__version__
