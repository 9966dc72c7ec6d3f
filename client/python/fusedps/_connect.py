"""First contact with a server: the target's form, and waiting until the server answers.

Internal module of fusedps.client. A user's first mistakes (a wrong port, plaintext against a
TLS server, a typo in the target) must be answered at once with what happened and where, not
after a long wait with a bare timeout.
"""

from __future__ import annotations

import re
import time
from typing import Callable, Optional

import grpc

from fusedps import errors

# Targets with a gRPC scheme are gRPC's to parse (docs: gRPC's naming.md).
_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.%a-zA-Z]+\]|[A-Za-z0-9_.-]+):([0-9]+)$")

# Causes that waiting can cure: nothing listens yet (a server still starting), or its name does
# not resolve yet (a Kubernetes service being created). Anything else is answered at once.
_REPEATS = 3
_NOT_UP_YET = ("connection refused", "no such file or directory", "dns resolution failed",
               "name or service not known", "failed to resolve")


def check_target(target: str) -> str:
    """Returns ``target`` when it is HOST:PORT (a name, an IPv4 address or a bracketed IPv6
    one; PORT 1..65535) or has a gRPC scheme (dns:, unix:, ipv4:, ...).

    Raises:
      ValueError: naming the target and the form it should have.
    """
    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be 'HOST:PORT', got {target!r}")
    if target.startswith(_SCHEMES) or "://" in target:
        return target
    match = _HOST_PORT.match(target)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise ValueError(f"target {target!r} is not HOST:PORT with a port in 1..65535 (or a "
                         "gRPC target with a scheme, such as dns:///HOST:PORT or unix:PATH)")
    return target


def wait_answering(target: str, probe: Callable[[float], None], timeout: float) -> None:
    """Calls ``probe(seconds)`` (one cheap call with that deadline, raising grpc.RpcError) until
    it returns, for at most ``timeout`` seconds. A refused connection (the server not up yet)
    is tried again; any other failure to connect is raised once it has repeated three times
    in a row (a fraction of a second: a connection that broke once, as when the server
    restarted, is tried again).

    Raises:
      fusedps.errors.Unavailable: the server cannot be reached; the message names the target
        and gRPC's cause (connection refused, a TLS handshake that failed, a closed socket).
      fusedps.errors.DeadlineExceeded: no answer within ``timeout`` seconds (a host that
        drops the packets), naming the target.
    """
    deadline = time.monotonic() + timeout
    cause: Optional[str] = None
    repeats = 0  # Consecutive failures of a cause that waiting does not cure.
    while True:
        left = deadline - time.monotonic()
        try:
            probe(max(0.05, min(left, 5.0)))
            return
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            details = (e.details() if hasattr(e, "details") else str(e)) or ""
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return  # It answered: the calls themselves will say what the caller may do.
            if code == grpc.StatusCode.UNAVAILABLE:
                cause = details
                # One failure can be a connection that broke (a server restarted on the
                # port): try again at once. The same one three times is the answer.
                repeats = 0 if any(c in details.lower() for c in _NOT_UP_YET) else repeats + 1
                if repeats >= _REPEATS:
                    raise errors.error_for(code, _unreachable(target, details)) from None
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                cause = "no answer"
            else:
                raise errors.error_for(code, f"{target}: {details}") from None
        if time.monotonic() >= deadline:
            if cause is not None and cause != "no answer":
                raise errors.error_for(grpc.StatusCode.UNAVAILABLE, _unreachable(
                    target, f"{cause} (still, after {timeout:g} s)"))
            raise errors.error_for(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"the fusedps server at {target} did not answer within "
                                   f"{timeout:g} s")
        time.sleep(min(0.1 if repeats == 0 else 0.02, max(0.0, deadline - time.monotonic())))


def _unreachable(target: str, cause: str) -> str:
    hint = ""
    lower = cause.lower()
    if "refused" in lower:
        hint = "; nothing listens there: is the server up, and is this its port?"
    elif "ssl" in lower or "handshake" in lower or "certificate" in lower:
        hint = "; TLS failed: do the client's tls options match the server's --tls-* flags?"
    elif "socket closed" in lower or "connection reset" in lower:
        hint = ("; the server closed the connection: a TLS server reached without tls=True, "
                "or a mutual-TLS server without a client certificate?")
    return f"cannot reach the fusedps server at {target}: {cause}{hint}"
