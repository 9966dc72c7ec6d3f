"""Importing fusedps changes nothing process-wide: the warning filters after ``import fusedps``,
``import fusedps.torch`` and every other module of the package are the ones before.

Each case runs in a fresh interpreter (the pytest process has imported fusedps already, and
pytest manages warning filters of its own). torch, grpc and numpy are imported before the
snapshot: what they do on import is theirs, not fusedps's.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import fusedps

# Prints, as JSON, the warning filters before and after importing the modules named in argv[1:]:
# {"before": [...], "after": [...]}, each filter as its repr.
_PROBE = r"""
import importlib, json, sys, warnings
import grpc, numpy, torch  # third-party side effects, before the snapshot

def snapshot():
    return [repr(f) for f in warnings.filters]

before = snapshot()
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({"before": before, "after": snapshot()}))
"""


def _package_modules():
    """Every module of the fusedps package on disk (the generated protos and the bench
    subpackage included), by dotted name."""
    root = pathlib.Path(fusedps.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] == "__main__":
            continue  # running it is the point of it
        names.append(".".join(parts))
    return names


def _assert_filters_unchanged(*modules):
    out = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS=""))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    added = [f for f in seen["after"] if f not in seen["before"]]
    assert seen["after"] == seen["before"], f"importing {modules} added the filters {added}"


@pytest.mark.parametrize("modules", [("fusedps",), ("fusedps", "fusedps.torch")],
                         ids=["fusedps", "fusedps.torch"])
def test_import_leaves_the_warning_filters_alone(modules):
    _assert_filters_unchanged(*modules)


def test_no_module_of_the_package_changes_the_warning_filters():
    modules = _package_modules()
    assert "fusedps.torch" in modules and "fusedps.errors" in modules
    _assert_filters_unchanged(*modules)
