"""docs/operations/security.md's "Make certificates with openssl", run as it is written (issue
35, item 9): its openssl commands in an empty directory, then a server started with its flags
and those files, and clients that connect over TLS and over mutual TLS, its Python block among
them.

Skips without the openssl CLI, as client/python/tests/test_security.py does.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import types

import pytest
import torch

import fusedps
from fusedps import _native, errors
from server_fixture import REPO_ROOT, running_server

SECTION = "## Make certificates with openssl"
DOC_TARGET = "ps-0.example.com:50051"

TRANSPORTS = ["grpcio", pytest.param("native", marks=pytest.mark.skipif(
    _native.library() is None, reason=f"no native library: {_native.load_error()}"))]
SMALL = dict(max_chunk_bytes=4096, timeout=20)


def _recipe_blocks():
    """(the openssl commands, the server's command line, the Python block) of the section."""
    with open(os.path.join(REPO_ROOT, "docs", "operations", "security.md")) as f:
        text = f.read()
    section = text.split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    sh = re.findall(r"```sh\n(.*?)```", section, re.S)
    py = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(sh) == 2 and len(py) == 1, "the recipe has two sh blocks and one python block"
    return sh[0], sh[1].strip(), py[0]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The directory where the recipe's commands ran, and its server line and Python block."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to run the recipe")
    commands, server_line, python = _recipe_blocks()
    directory = tmp_path_factory.mktemp("tls-recipe")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=directory,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return types.SimpleNamespace(dir=directory, server_line=server_line, python=python)


def _server_args(recipe, mutual: bool):
    """The recipe's server flags for running_server (which listens on 127.0.0.1:0 itself),
    with its files in the recipe's directory; without --tls-client-ca for TLS alone."""
    argv = shlex.split(recipe.server_line)
    assert argv[0] == "fusedps-server", argv
    args = []
    for arg in argv[1:]:
        flag, _, value = arg.partition("=")
        if flag == "--listen" or (flag == "--tls-client-ca" and not mutual):
            continue
        assert flag in ("--tls-cert", "--tls-key", "--tls-client-ca"), arg
        args.append(f"{flag}={recipe.dir / value}")
    return args


def _push_and_pull(client: fusedps.Client, name: str) -> None:
    client.register_model({name: torch.zeros(1000)})
    grads = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    result = client.push_gradients({name: grads}, grad_dtype="float32")
    assert result.tensors_updated == 1
    into = torch.zeros(1000)
    assert client.pull_parameters({name: into}).version == result.version
    assert into.abs().min() > 0  # one AdamW step from zeros moved every element


def test_the_recipe_makes_a_ca_a_server_and_a_trainer_certificate(recipe):
    names = sorted(os.listdir(recipe.dir))
    assert names == ["ca.crt", "ca.key", "ca.srl", "tls.crt", "tls.key", "trainer-0.crt",
                     "trainer-0.key"], names
    for key in ("ca.key", "tls.key", "trainer-0.key"):
        assert os.stat(recipe.dir / key).st_mode & 0o077 == 0, key
    verify = subprocess.run(["openssl", "verify", "-CAfile", "ca.crt", "tls.crt",
                             "trainer-0.crt"], cwd=recipe.dir, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    text = subprocess.run(["openssl", "x509", "-in", "tls.crt", "-noout", "-text"],
                          cwd=recipe.dir, capture_output=True, text=True, check=True).stdout
    for name in ("DNS:ps-0.example.com", "DNS:localhost", "IP Address:127.0.0.1",
                 "TLS Web Server Authentication", "TLS Web Client Authentication"):
        assert name in text, name


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tls_with_the_recipes_certificates(recipe, transport):
    with running_server(_server_args(recipe, mutual=False)) as target:
        with fusedps.Client(target, tls_ca=str(recipe.dir / "ca.crt"), transport=transport,
                            **SMALL) as client:
            client.wait_ready(10)
            _push_and_pull(client, f"recipe.tls.{transport}")
        with fusedps.Client(target, transport=transport, **SMALL) as plaintext:
            with pytest.raises(errors.Unavailable):
                plaintext.info()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mutual_tls_with_the_recipes_certificates(recipe, transport):
    files = {k: str(recipe.dir / v) for k, v in
             dict(tls_ca="ca.crt", tls_cert="trainer-0.crt", tls_key="trainer-0.key").items()}
    with running_server(_server_args(recipe, mutual=True)) as target:
        with fusedps.Client(target, client_id="trainer-0", transport=transport, **files,
                            **SMALL) as trainer:
            trainer.wait_ready(10)
            _push_and_pull(trainer, f"recipe.mtls.{transport}")
            # The certificate's name is the principal: a push as another trainer is refused.
            with pytest.raises(errors.PermissionDenied, match="trainer-1"):
                trainer.push_gradients({f"recipe.mtls.{transport}": torch.ones(1000)},
                                       client_id="trainer-1")
        with fusedps.Client(target, tls_ca=files["tls_ca"], transport=transport,
                            **SMALL) as no_certificate:
            with pytest.raises(errors.Unavailable):
                no_certificate.info()


def test_the_python_block_connects_as_written(recipe):
    with running_server(_server_args(recipe, mutual=True)) as target:
        assert DOC_TARGET in recipe.python
        script = recipe.python.replace(DOC_TARGET, target) + "\nclient.info()\nclient.close()\n"
        result = subprocess.run([sys.executable, "-c", script], cwd=recipe.dir,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
