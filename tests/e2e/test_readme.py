"""The README's quickstart, run as it is written: its server command (with a free port for
127.0.0.1:50051 and --device=cpu for auto, so that it runs anywhere), then its Python block
against that server, which must train: the printed loss under 0.3 after 200 server steps."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys

import fusedps
from server_fixture import REPO_ROOT, server_path


def _quickstart_blocks():
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    sh = re.findall(r"```sh\n(.*?)```", section, re.S)
    py = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(sh) == 1 and len(py) == 1, "the quickstart has one sh and one python block"
    return sh[0], py[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_quickstart_trains_as_written(tmp_path):
    sh, py = _quickstart_blocks()
    lines = [line for line in sh.splitlines() if line.strip()]
    assert lines[0] == "make build"  # The tests run on a built tree.
    server_line = lines[1]
    assert server_line.startswith("build/server/fusedps-server ") and server_line.endswith(" &")
    port = _free_port()
    argv = shlex.split(server_line[:-2].replace("127.0.0.1:50051", f"127.0.0.1:{port}")
                       .replace("--device=auto", "--device=cpu"))
    argv[0] = server_path()
    argv.append("--metrics-listen=")  # The default metrics port may be taken on a CI machine.
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        target = f"127.0.0.1:{port}"
        fusedps.Client(target).wait_ready(30.0)
        script = py.replace("127.0.0.1:50051", target)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=300, env=dict(os.environ))
        assert result.returncode == 0, result.stderr[-3000:]
        match = re.search(r"loss ([0-9.]+) after (\d+) server steps", result.stdout)
        assert match, result.stdout
        assert float(match.group(1)) < 0.3, result.stdout
        assert int(match.group(2)) == 200, result.stdout
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
