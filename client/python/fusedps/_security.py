"""Transport security and bearer tokens of the fusedps Python client.

Internal module: fusedps.client.Client takes the options (tls, tls_ca, tls_cert, tls_key,
token, token_file) and checks them here once; its docstring and docs/python.md ("Security")
say what the server does with them. The C++ client does the same for the native transport
(client/channel.cc), given the same paths and the token.

Every channel the grpcio transport makes goes through make_channel: TLS credentials when TLS
is on, and, with a token, an interceptor that adds ``authorization: Bearer TOKEN`` to every
call's metadata (unary, streaming, the raw pushes and loads of _transport.py alike).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import grpc


@dataclass(frozen=True)
class Security:
    """The checked options.

    tls: the channels use TLS (given, or implied by a tls_* file).
    tls_ca, tls_cert, tls_key: the paths given (None when not).
    token: the bearer token (from token= or read from token_file), or None.
    credentials: the grpc.ChannelCredentials of TLS channels, or None for plaintext.
    """

    tls: bool = False
    tls_ca: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    token: Optional[str] = None
    credentials: Optional[grpc.ChannelCredentials] = None


def _read(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{option} {path!r} cannot be read: {e.strerror or e}") from e


def _check_token(token: str, where: str) -> str:
    if not isinstance(token, str):
        raise TypeError(f"{where} must be a str, got {type(token).__name__}")
    if not token:
        raise ValueError(f"{where} is empty")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(f"{where} holds spaces or characters outside printable ASCII")
    return token


def check_security(tls: bool = False, tls_ca: Optional[str] = None,
                   tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                   token: Optional[str] = None, token_file: Optional[str] = None) -> Security:
    """Checks the options and reads their files: the TLS files (PEM) and the token file (the
    token, surrounding whitespace ignored).

    Raises:
      ValueError: tls_cert without tls_key (or the reverse); both token and token_file; a
        file that cannot be read; a token file that holds no token; a token that is empty or
        holds spaces or characters outside printable ASCII (it travels as an HTTP/2 header).
    """
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together (a client certificate and its key)")
    if token is not None and token_file is not None:
        raise ValueError("token and token_file are exclusive")
    if token_file is not None:
        text = _read(token_file, "token_file").decode("utf-8", "replace").strip()
        if not text:
            raise ValueError(f"token_file {token_file!r} holds no token")
        token = _check_token(text, f"the token in token_file {token_file!r}")
    elif token is not None:
        token = _check_token(token, "token")
    use_tls = bool(tls) or tls_ca is not None or tls_cert is not None
    credentials = None
    if use_tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=None if tls_ca is None else _read(tls_ca, "tls_ca"),
            private_key=None if tls_key is None else _read(tls_key, "tls_key"),
            certificate_chain=None if tls_cert is None else _read(tls_cert, "tls_cert"))
    return Security(use_tls, tls_ca, tls_cert, tls_key, token, credentials)


class _CallDetails(
        collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    """A call's details with other metadata (grpc.ClientCallDetails is abstract)."""


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer TOKEN`` to the metadata of every call of its channel."""

    def __init__(self, token: str):
        self._header: Tuple[str, str] = ("authorization", "Bearer " + token)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = list(details.metadata or ())
        metadata.append(self._header)
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def with_token(channel: grpc.Channel, token: Optional[str]) -> grpc.Channel:
    """``channel`` whose calls carry the token (itself when token is None). Closing the
    result closes ``channel``."""
    if token is None:
        return channel
    return grpc.intercept_channel(channel, BearerToken(token))


def make_channel(target: str, options: Sequence[Tuple[str, object]],
                 security: Security) -> grpc.Channel:
    """A channel to ``target`` with channel ``options``: TLS with security's credentials (the
    server's certificate must name the target's host; "grpc.ssl_target_name_override" in
    ``options`` names another), else plaintext; with security's token on every call."""
    if security.credentials is not None:
        channel = grpc.secure_channel(target, security.credentials, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    return with_token(channel, security.token)
