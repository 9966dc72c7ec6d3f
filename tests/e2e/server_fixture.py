"""Starts a fusedps-server child process for end-to-end tests and scripts.

The server binary is $FUSEDPS_SERVER (default build/server/fusedps-server, relative to the
repository root). It is started as

    fusedps-server --listen=127.0.0.1:0 --port-file=<tmp> --metrics-listen=127.0.0.1:0 \
        --device=cpu [extra args]

and is ready once the port file exists (written atomically by the server). On exit the server
gets SIGTERM and must exit with code 0.

In tests (see conftest.py for the pytest fixtures)::

    with running_server() as target:          # "127.0.0.1:<port>"
        client = fusedps.Client(target)

From the command line, to run a command against a fresh server (ctest uses this for the
examples); "{target}" in the command is replaced by the server's address::

    server_fixture.py [--server-arg=ARG ...] -- python3 examples/train_digits.py --target {target}
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_SERVER = os.path.join(REPO_ROOT, "build", "server", "fusedps-server")


def server_path() -> str:
    """The fusedps-server binary: $FUSEDPS_SERVER, else build/server/fusedps-server."""
    return os.environ.get("FUSEDPS_SERVER") or DEFAULT_SERVER


class ServerError(RuntimeError):
    """The server did not start, or did not stop cleanly."""


@contextlib.contextmanager
def running_server(extra_args: Sequence[str] = (), *, device: Optional[str] = None,
                   start_timeout: float = 30.0, stop_timeout: float = 60.0,
                   server: Optional[str] = None) -> Iterator[str]:
    """Runs fusedps-server for the duration of the with-block; yields "127.0.0.1:<port>".

    Args:
      extra_args: more flags for the server, e.g. ["--param-copy-dtype=bf16"].
      device: the --device flag; default $FUSEDPS_TEST_DEVICE, else "cpu" (set it to "cuda" to
        run the same tests against the CUDA backend on a GPU machine).
      start_timeout: seconds to wait for the port file.
      stop_timeout: seconds to wait for the exit after SIGTERM (then SIGKILL, and an error).
      server: the binary; default server_path().

    Raises:
      ServerError: the binary is missing, the server exited or timed out before writing its
        port file, or it did not exit with code 0 after SIGTERM. The message includes the tail
        of the server's stderr.
    """
    binary = server or server_path()
    if not os.path.isfile(binary) or not os.access(binary, os.X_OK):
        raise ServerError(f"fusedps-server not found at {binary!r} (set FUSEDPS_SERVER)")
    with tempfile.TemporaryDirectory(prefix="fusedps-e2e-") as tmp:
        port_file = os.path.join(tmp, "port")
        log_path = os.path.join(tmp, "server.log")
        cmd = server_command(binary, port_file, extra_args, device)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)

        def log_tail(n: int = 4000) -> str:
            try:
                with open(log_path, "rb") as f:
                    return f.read().decode("utf-8", "replace")[-n:]
            except OSError:
                return ""

        try:
            port = wait_for_port(proc, port_file, start_timeout, log_tail)
        except BaseException:
            _kill(proc)
            raise
        stopped = False
        try:
            yield f"127.0.0.1:{port}"
        except BaseException:
            # The body failed: still stop the server, but let the original error through.
            _stop(proc, stop_timeout)
            stopped = True
            raise
        finally:
            if not stopped:
                code = _stop(proc, stop_timeout)
                if code != 0:
                    raise ServerError(f"fusedps-server exited with {code} after SIGTERM "
                                      f"(expected 0); log:\n{log_tail()}")


def server_command(binary: str, port_file: str, extra_args: Sequence[str] = (),
                   device: Optional[str] = None) -> list:
    """The command line of a test server: loopback, a free port written to port_file, metrics on
    a free port too (so that servers running side by side never collide), `device` (default
    $FUSEDPS_TEST_DEVICE, else "cpu"), then extra_args."""
    return [binary, "--listen=127.0.0.1:0", f"--port-file={port_file}",
            "--metrics-listen=127.0.0.1:0",
            f"--device={device or os.environ.get('FUSEDPS_TEST_DEVICE', 'cpu')}", *extra_args]


def wait_for_port(proc: subprocess.Popen, port_file: str, timeout: float, log_tail) -> int:
    """The port `proc` (a fusedps-server) writes to port_file; ServerError, with log_tail(),
    when it exits first or writes none within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(port_file):
            with open(port_file) as f:
                text = f.read().strip()
            if text:
                try:
                    return int(text)
                except ValueError:
                    raise ServerError(f"bad port file content {text!r}") from None
        code = proc.poll()
        if code is not None:
            raise ServerError(f"fusedps-server exited with {code} before serving; log:\n"
                              f"{log_tail()}")
        if time.monotonic() > deadline:
            raise ServerError(f"fusedps-server wrote no port file within {timeout} s; log:\n"
                              f"{log_tail()}")
        time.sleep(0.02)


def _stop(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, wait up to timeout, then SIGKILL. Returns the exit code (-9 when killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
    return proc.returncode


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        description="Run a command against a fresh fusedps-server ({target} is substituted).")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra server flag (repeatable)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    with running_server(args.server_arg, device=args.device) as target:
        code = subprocess.call([c.replace("{target}", target) for c in command])
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
