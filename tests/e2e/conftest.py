"""pytest fixtures for the end-to-end tests: one fusedps-server (CPU backend) per test module.

Needs PYTHONPATH to hold build/python (the fusedps package and its generated stubs) and
fusedps-server at $FUSEDPS_SERVER or build/server/fusedps-server (ctest sets both).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from server_fixture import running_server  # noqa: E402


@pytest.fixture(scope="module")
def server_target():
    """"127.0.0.1:<port>" of a fusedps-server that lives as long as the test module."""
    with running_server() as target:
        yield target


@pytest.fixture(scope="module")
def client(server_target):
    """A fusedps.Client connected to the module's server."""
    import fusedps

    with fusedps.Client(server_target) as c:
        c.wait_ready(timeout=10)
        yield c
