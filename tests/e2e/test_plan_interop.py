"""The C++ plan (`fusedps plan`, fusedps::ShardPlan) and the Python one (fusedps.plan) agree:
the same slices on the same shards and the same hash, byte for byte in the printed JSON, for
GPT-2 small and for synthetic lists made to catch the corners of docs/sharding.md (names that
sort differently as UTF-8 bytes than as code points or case-insensitively, JSON escapes, sizes
around the slice size, 0-dim and 0-element tensors).

The CLI binary: $FUSEDPS_CLI, else build/client/fusedps (ctest sets it). The test is skipped
while that binary has no `plan` command.
"""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from fusedps.plan import make_plan
from server_fixture import REPO_ROOT

CLI = os.environ.get("FUSEDPS_CLI") or os.path.join(REPO_ROOT, "build", "client", "fusedps")
GPT2_SMALL = os.path.join(REPO_ROOT, "tests", "data", "gpt2_small_tensors.json")


def run_plan(tensors_file, shards, slice_elements):
    return subprocess.run(
        [CLI, "plan", f"--shards={shards}", f"--slice-elements={slice_elements}",
         f"--tensors-file={tensors_file}"], capture_output=True, timeout=60)


def write_tensors(path, tensors):
    with open(path, "w", encoding="utf-8") as f:
        json.dump([{"name": name, "shape": list(shape)} for name, shape in tensors], f)
    return str(path)


def many_tiny_tensors():
    """300 tensors of 0..60 elements; names in several scripts, some with JSON escapes."""
    rng = random.Random(12)
    stems = ["layer", "Layer", "béta", "βeta", "日本語", "😀emoji", "\uffff", "q\"uote",
             "back\\slash", "tab\tname", "Ā", "z", "~tilde"]
    tensors = []
    for i in range(300):
        dims = rng.choice([(), (rng.randint(0, 60),), (rng.randint(0, 7), rng.randint(0, 8))])
        tensors.append((f"{rng.choice(stems)}.{i}", dims))
    return tensors


def around_the_slice_size(c):
    """Tensors of C - 1, C, C + 1, 2C, 2C + 1, 10C + 3 elements, a 0-dim and a 0-element one."""
    return [("below", (c - 1,)), ("exact", (c,)), ("above", (c + 1,)), ("two", (2, c)),
            ("two_plus", (2 * c + 1,)), ("ten", (10 * c + 3, 1)), ("scalar", ()),
            ("empty", (0, c)), ("empty_1d", (0,)), ("one", (1, 1, 1))]


@pytest.fixture(scope="module")
def cli_with_plan(tmp_path_factory):
    """Skips the module unless the CLI exists and knows `plan`."""
    if not os.path.exists(CLI):
        pytest.skip(f"no CLI at {CLI}")
    probe = write_tensors(tmp_path_factory.mktemp("probe") / "t.json", [("w", (3,))])
    r = run_plan(probe, 1, 2)
    stderr = r.stderr.decode("utf-8", "replace")
    if r.returncode != 0 and ("unknown command" in stderr.lower() or
                              "unknown command line flag" in stderr.lower()):
        pytest.skip(f"{CLI} has no `plan` command yet: {stderr.strip()[:200]}")
    return CLI


def tensor_lists(tmp_path):
    with open(GPT2_SMALL, encoding="utf-8") as f:
        gpt2 = [(t["name"], tuple(t["shape"])) for t in json.load(f)]
    return {
        "gpt2_small": (GPT2_SMALL, gpt2, [1 << 20, 100_000]),
        "many_tiny": (write_tensors(tmp_path / "tiny.json", many_tiny_tensors()),
                      many_tiny_tensors(), [7, 64]),
        "around_c": (write_tensors(tmp_path / "around.json", around_the_slice_size(1000)),
                     around_the_slice_size(1000), [1000]),
    }


@pytest.mark.parametrize("which", ["gpt2_small", "many_tiny", "around_c"])
def test_cli_plan_matches_python_plan(cli_with_plan, tmp_path, which):
    path, tensors, slice_sizes = tensor_lists(tmp_path)[which]
    for c in slice_sizes:
        for shards in range(1, 9):
            r = run_plan(path, shards, c)
            assert r.returncode == 0, r.stderr.decode("utf-8", "replace")
            printed = r.stdout.decode("utf-8").rstrip("\n")
            expected = make_plan(tensors, shards, c)
            assert json.loads(printed) == expected.to_dict(), (which, shards, c)
            assert printed == expected.to_json(), (which, shards, c)
