"""The Python client's transport security against a real fusedps-server, on both transports:
TLS, mutual TLS, bearer tokens with roles, and the identity binding of pushes (with
authentication on, a push's client_id must be the caller's principal).

Certificates come from tests/integration/make_test_certs.sh (the openssl CLI; the tests that
need them skip without it). The server is $FUSEDPS_SERVER (ctest sets it), else
build/server/fusedps-server, run by tests/e2e/server_fixture.py; without either, the tests
that need one skip. The checks of the options themselves need neither.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import types

import pytest
import torch

import fusedps
from fusedps import _native, errors

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
MAKE_TEST_CERTS = os.path.join(REPO_ROOT, "tests", "integration", "make_test_certs.sh")
sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "e2e"))

from server_fixture import running_server, server_path  # noqa: E402

TRANSPORTS = ["grpcio", pytest.param("native", marks=pytest.mark.skipif(
    _native.library() is None, reason=f"no native library: {_native.load_error()}"))]

# The --auth-tokens file: TOKEN ROLE PRINCIPAL.
ADMIN_TOKEN = "admin-token-0123456789abcdef"
TRAINER_TOKEN = "trainer0-token-0123456789abcdef"
READER_TOKEN = "reader-token-0123456789abcdef"
TOKENS = (f"# role tokens\n{ADMIN_TOKEN} admin ops\n{TRAINER_TOKEN} trainer trainer-0\n"
          f"{READER_TOKEN} reader eval\n")

NUMEL = 3000  # 12 KB of float32: several 4 KiB messages, so that streams=2 pushes in 2 parts.
SMALL = dict(max_chunk_bytes=4096, timeout=20)


def _grads(seed: int = 0) -> dict:
    return {"w": torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))}


def _started_server(args):
    """running_server(args), skipping when there is no fusedps-server to run."""
    if not os.environ.get("FUSEDPS_SERVER") and not os.path.exists(server_path()):
        pytest.skip(f"no fusedps-server at {server_path()} (set FUSEDPS_SERVER)")
    return running_server(args)


# -- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Paths of make_test_certs.sh's files: certs.ca, certs.server_key, certs.other_client, ...
    (``-`` and ``.crt`` dropped from the names, ``.key`` as ``_key``)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make test certificates")
    directory = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", MAKE_TEST_CERTS, str(directory)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    paths = {}
    for name in ("ca", "other-ca", "server", "client", "other-client"):
        key = name.replace("-", "_")
        paths[key] = str(directory / f"{name}.crt")
        paths[key + "_key"] = str(directory / f"{name}.key")
    tokens = directory / "tokens"
    tokens.write_text(TOKENS)
    paths["tokens"] = str(tokens)
    return types.SimpleNamespace(**paths)


@pytest.fixture(scope="module")
def tls_server(certs):
    """A server with TLS only (no authentication)."""
    with _started_server([f"--tls-cert={certs.server}", f"--tls-key={certs.server_key}"]) as t:
        yield t


@pytest.fixture(scope="module")
def mtls_server(certs):
    """A server with mutual TLS: clients need a certificate of certs.ca; no tokens, so such a
    client is an admin whose principal is its certificate's name (trainer-0)."""
    with _started_server([f"--tls-cert={certs.server}", f"--tls-key={certs.server_key}",
                          f"--tls-client-ca={certs.ca}"]) as target:
        yield target


@pytest.fixture(scope="module")
def auth_server(certs):
    """A server with TLS and bearer tokens (TOKENS), and "auth.w" registered by the admin."""
    with _started_server([f"--tls-cert={certs.server}", f"--tls-key={certs.server_key}",
                          f"--auth-tokens={certs.tokens}"]) as target:
        with fusedps.Client(target, tls_ca=certs.ca, token=ADMIN_TOKEN, **SMALL) as admin:
            admin.register_model({"auth.w": torch.zeros(NUMEL)})
        yield target


def _push_and_pull(client: fusedps.Client, name: str, client_id: str = "") -> None:
    """Registers ``name`` (NUMEL elements), pushes one step and pulls it back into a tensor:
    the pull lands in the tensor (through the native transport where that is in use)."""
    client.register_model({name: torch.zeros(NUMEL)})
    result = client.push_gradients({name: _grads()["w"]}, grad_dtype="float32",
                                   client_id=client_id)
    assert not result.step_skipped and result.tensors_updated == 1
    into = torch.zeros(NUMEL)
    pulled = client.pull_parameters({name: into})
    assert pulled.version == result.version
    assert into.abs().max() > 0  # one AdamW step from zeros moved every element


# -- the options, without a server ----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(tls_cert="c.pem"), "go together"),
    (dict(tls_key="k.pem"), "go together"),
    (dict(token="a-token-0123456789", token_file="t"), "exclusive"),
    (dict(tls_ca="/nonexistent/ca.pem"), "cannot be read"),
    (dict(token_file="/nonexistent/token"), "cannot be read"),
    (dict(token=""), "empty"),
    (dict(token="two words"), "spaces"),
])
def test_bad_security_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fusedps.Client("127.0.0.1:1", **kwargs)


def test_an_empty_token_file_raises_value_error(tmp_path):
    (tmp_path / "token").write_text(" \n")
    with pytest.raises(ValueError, match="holds no token"):
        fusedps.Client("127.0.0.1:1", token_file=str(tmp_path / "token"))


def test_tls_options_are_refused_with_a_given_channel():
    import grpc

    with grpc.insecure_channel("127.0.0.1:1") as channel:
        with pytest.raises(ValueError, match="own credentials"):
            fusedps.Client("127.0.0.1:1", channel=channel, tls=True)


# -- TLS ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tls_client_pushes_and_pulls_over_every_stream(tls_server, certs, transport):
    with fusedps.Client(tls_server, tls_ca=certs.ca, transport=transport, streams=2,
                        **SMALL) as client:
        assert client.transport_in_use == transport
        _push_and_pull(client, f"tls.{transport}.w")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_plaintext_client_cannot_reach_a_tls_server(tls_server, transport):
    with fusedps.Client(tls_server, transport=transport, **SMALL) as client:
        with pytest.raises(errors.Unavailable):
            client.pull_parameters({"tls.missing": torch.zeros(1)})
        with pytest.raises(errors.Unavailable):
            client.info()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tls_client_refuses_a_server_of_another_ca(tls_server, certs, transport):
    with fusedps.Client(tls_server, tls_ca=certs.other_ca, transport=transport,
                        **SMALL) as client:
        with pytest.raises(errors.Unavailable):
            client.pull_parameters({"tls.missing": torch.zeros(1)})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tls_client_cannot_reach_a_plaintext_server(certs, transport):
    with _started_server([]) as target:
        with fusedps.Client(target, tls_ca=certs.ca, transport=transport, **SMALL) as client:
            with pytest.raises(errors.Unavailable):
                client.pull_parameters({"tls.missing": torch.zeros(1)})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_connecting_with_the_wrong_security_says_so_at_once(tls_server, mtls_server, certs,
                                                            transport):
    """wait_ready (RemoteAdamW's connect_timeout) against a server whose security the client
    does not match: a FusedPSError naming the target and the cause, at once, not a bare
    timeout after connect_timeout (issue 35, item 4)."""
    with _started_server([]) as plaintext:
        cases = [(tls_server, {}), (plaintext, {"tls_ca": certs.ca}),
                 (mtls_server, {"tls_ca": certs.ca})]
        for target, options in cases:
            with fusedps.Client(target, transport=transport, **options, **SMALL) as client:
                start = time.monotonic()
                with pytest.raises(errors.Unavailable) as info:
                    client.wait_ready(30.0)
                assert time.monotonic() - start < 10, (target, options)
                assert target in str(info.value), str(info.value)


# -- mutual TLS -----------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mutual_tls_refuses_a_client_without_a_certificate_of_its_ca(mtls_server, certs,
                                                                      transport):
    with fusedps.Client(mtls_server, tls_ca=certs.ca, transport=transport, **SMALL) as client:
        with pytest.raises(errors.Unavailable):
            client.pull_parameters({"mtls.missing": torch.zeros(1)})
    with fusedps.Client(mtls_server, tls_ca=certs.ca, tls_cert=certs.other_client,
                        tls_key=certs.other_client_key, transport=transport,
                        **SMALL) as client:
        with pytest.raises(errors.Unavailable):
            client.pull_parameters({"mtls.missing": torch.zeros(1)})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mutual_tls_serves_a_client_certificate_as_its_principal(mtls_server, certs,
                                                                 transport):
    with fusedps.Client(mtls_server, tls_ca=certs.ca, tls_cert=certs.client,
                        tls_key=certs.client_key, transport=transport, streams=2,
                        **SMALL) as client:
        _push_and_pull(client, f"mtls.{transport}.w", client_id="trainer-0")
        with pytest.raises(errors.PermissionDenied, match="trainer-1"):
            client.push_gradients({f"mtls.{transport}.w": _grads()["w"]},
                                  client_id="trainer-1")


# -- bearer tokens --------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_call_without_a_known_token_is_unauthenticated(auth_server, certs, transport):
    for token in (None, "unknown-token-0123456789abcdef"):
        with fusedps.Client(auth_server, tls_ca=certs.ca, token=token, transport=transport,
                            client_id="trainer-0", **SMALL) as client:
            with pytest.raises(errors.Unauthenticated):
                client.pull_parameters({"auth.w": torch.zeros(NUMEL)})
            with pytest.raises(errors.Unauthenticated):
                client.push_gradients(_grads(), prefix="auth.")
            with pytest.raises(errors.Unauthenticated):
                client.info()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_reader_pulls_but_may_not_push_or_register(auth_server, certs, transport):
    with fusedps.Client(auth_server, tls_ca=certs.ca, token=READER_TOKEN, transport=transport,
                        client_id="eval", **SMALL) as reader:
        into = torch.full((NUMEL,), float("nan"))
        reader.pull_parameters({"auth.w": into})
        assert not into.isnan().any()
        assert reader.info().tensor_count >= 1
        with pytest.raises(errors.PermissionDenied):
            reader.push_gradients(_grads(), prefix="auth.")
        with pytest.raises(errors.PermissionDenied):
            reader.register_model({"auth.reader.w": torch.zeros(4)})


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("streams", [1, 2])
def test_a_trainer_pushes_under_its_principal_only(auth_server, certs, transport, streams):
    with fusedps.Client(auth_server, tls_ca=certs.ca, token=TRAINER_TOKEN, transport=transport,
                        streams=streams, client_id="trainer-0", **SMALL) as trainer:
        before = trainer.pull_parameters({"auth.w": torch.zeros(NUMEL)}).version
        result = trainer.push_gradients(_grads(), prefix="auth.")
        assert result.version > before and result.tensors_updated == 1
        for client_id in ("trainer-1", ""):
            with pytest.raises(errors.PermissionDenied):
                trainer.push_gradients(_grads(), prefix="auth.", client_id=client_id)
        with pytest.raises(errors.PermissionDenied):
            trainer.register_model({"auth.trainer.w": torch.zeros(4)})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_token_file_works_as_the_token(auth_server, certs, transport, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(f"\n  {TRAINER_TOKEN}\n")  # surrounding whitespace is ignored
    with fusedps.Client(auth_server, tls_ca=certs.ca, token_file=str(token_file),
                        transport=transport, streams=2, client_id="trainer-0",
                        **SMALL) as trainer:
        assert trainer.push_gradients(_grads(), prefix="auth.").tensors_updated == 1
        trainer.pull_parameters({"auth.w": torch.zeros(NUMEL)})


def test_a_sharded_client_passes_the_security_options_to_each_shard(auth_server, certs):
    with fusedps.ShardedClient([auth_server], client_id="trainer-0", tls_ca=certs.ca,
                               token=TRAINER_TOKEN, **SMALL) as ps:
        assert ps.info()[0].tensor_count >= 1  # over TLS, with the token


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_remote_adamw_steps_with_an_admin_token_over_tls(auth_server, certs, transport):
    from fusedps.torch import RemoteAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    reference = torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())
    # Registration needs an admin; the pushes' client_id is that token's principal.
    options = dict(tls_ca=certs.ca, token=ADMIN_TOKEN, client_id="ops", transport=transport,
                   streams=2, **SMALL)
    with RemoteAdamW(model.named_parameters(), targets=auth_server, lr=0.01,
                     prefix=f"adamw.{transport}.", client_options=options) as opt:
        torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
        x = torch.randn(16, 8)
        for m in (model, reference):
            m(x).square().mean().backward()
        opt.step()
        torch_opt.step()
        assert opt.client.transport_in_use == transport
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
