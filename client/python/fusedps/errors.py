"""The exceptions of the fusedps client: one class per gRPC status code, under FusedPSError.

Every error a server (or the transport) reports surfaces as a FusedPSError subclass that keeps
the gRPC status code and the server's message::

    try:
        client.push_gradients(model)
    except fusedps.errors.Aborted as e:          # e.g. a stale base_version in sync mode
        print(e.code, e.details)                   # grpc.StatusCode.ABORTED, the server's text
    except fusedps.FusedPSError as e:              # any other status
        ...

FusedPSError derives from grpc.RpcError and keeps its ``code()`` and ``details()`` methods, so
code written against the raw gRPC errors keeps working. Mistakes the client sees before calling
(a bad argument) raise ValueError / TypeError / KeyError instead, as before.
"""

from __future__ import annotations

import functools
import types
from typing import Callable, Dict, Optional, Type, TypeVar

import grpc

__all__ = [
    "FusedPSError",
    "Cancelled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
    "VersionRegression",
    "from_rpc_error",
]


class FusedPSError(grpc.RpcError):
    """A call failed with a gRPC status.

    Attributes:
      code: the grpc.StatusCode (also returned by ``code()``, as grpc.RpcError's).
      details: the server's message (also ``details()``), e.g. "tensor 'w': 10 elements
        pushed, 12 registered".
    """

    status_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str = "", code: Optional[grpc.StatusCode] = None):
        super().__init__(details)
        self._code = code if code is not None else type(self).status_code
        self._details = details

    # The attribute-style and method-style accessors read the same values; grpc.RpcError's
    # contract is the methods.
    def code(self) -> grpc.StatusCode:  # type: ignore[override]
        return self._code

    def details(self) -> str:  # type: ignore[override]
        return self._details

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._details!r})"


# One class per status code that a call can fail with (every grpc.StatusCode but OK), each
# declaring its code as status_code; _BY_CODE below is built from these declarations.


class Cancelled(FusedPSError):
    """The call was cancelled (by the caller, or the server shut down)."""

    status_code = grpc.StatusCode.CANCELLED


class Unknown(FusedPSError):
    """An error of no known status."""

    status_code = grpc.StatusCode.UNKNOWN


class InvalidArgument(FusedPSError):
    """The request was refused as malformed (a size, dtype, name or value out of its limits);
    the message names the field and the limit. Nothing changed on the server."""

    status_code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(FusedPSError):
    """The call did not finish within its deadline (Client's timeout plus its payload at
    min_bytes_per_second)."""

    status_code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(FusedPSError):
    """An unknown tensor or param group."""

    status_code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(FusedPSError):
    """A registration that conflicts with what the server holds (another shape or group)."""

    status_code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(FusedPSError):
    """The caller's identity may not make this call."""

    status_code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(FusedPSError):
    """The server is out of a resource (memory, disk, a message size limit)."""

    status_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(FusedPSError):
    """The server is not in a state that allows the call (another sharding plan, no
    checkpoint directory, a field the group does not keep, ...)."""

    status_code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(FusedPSError):
    """A push refused for its order: a stale sequence_number, or a base_version the
    consistency mode refuses (the message names the shard's version). Pull and retry."""

    status_code = grpc.StatusCode.ABORTED


class OutOfRange(FusedPSError):
    """A value past the end of a valid range."""

    status_code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(FusedPSError):
    """The server does not implement the call (an older server)."""

    status_code = grpc.StatusCode.UNIMPLEMENTED


class Internal(FusedPSError):
    """A broken invariant on the server (e.g. a device fault); the server fails loudly."""

    status_code = grpc.StatusCode.INTERNAL


class Unavailable(FusedPSError):
    """No server answered: not reachable, shutting down, or a dropped connection
    (keepalive)."""

    status_code = grpc.StatusCode.UNAVAILABLE


class DataLoss(FusedPSError):
    """Unrecoverable data loss."""

    status_code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(FusedPSError):
    """The call carried no valid credentials."""

    status_code = grpc.StatusCode.UNAUTHENTICATED


class VersionRegression(RuntimeError):
    """A server's version went backwards between two pulls of one client: the server was
    restored from a checkpoint (or replaced), and the steps after that checkpoint are gone. The
    pull that found it has completed (its values are the restored ones). Raised unless the
    client was made with ``allow_version_regression=True``.

    Attributes:
      target: the server. seen: the highest version this client had pulled. now: the version
        the server reports now.
    """

    def __init__(self, target: str, seen: int, now: int):
        super().__init__(
            f"the fusedps server at {target} went back from version {seen} to {now}: it was "
            f"restored from a checkpoint, and the {seen - now} steps after it are lost. The "
            "pulled values are the restored ones; to train on from them, make the client with "
            "allow_version_regression=True (RemoteAdamW: client_options)")
        self.target, self.seen, self.now = target, seen, now

    def __reduce__(self):
        # Exception's own reduce would call __init__ with the message alone.
        return type(self), (self.target, self.seen, self.now)


# grpc.StatusCode -> its class: the subclasses of FusedPSError declared above, by their
# status_code (classes that users derive later are not in it).
_BY_CODE: Dict[grpc.StatusCode, Type[FusedPSError]] = {
    cls.status_code: cls for cls in FusedPSError.__subclasses__() if cls.__module__ == __name__
}


def error_for(code: grpc.StatusCode, details: str) -> FusedPSError:
    """The FusedPSError subclass instance for a status code and message."""
    return _BY_CODE.get(code, FusedPSError)(details, code)


def from_rpc_error(error: grpc.RpcError) -> FusedPSError:
    """Converts a raw grpc.RpcError (a failed call) to its FusedPSError subclass; a
    FusedPSError is returned as it is."""
    if isinstance(error, FusedPSError):
        return error
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return error_for(code if code is not None else grpc.StatusCode.UNKNOWN, details or "")


F = TypeVar("F", bound=Callable)


def translated(method: F) -> F:
    """Wraps a function so that a raw grpc.RpcError it raises leaves as a FusedPSError (the
    original is kept as __cause__)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except FusedPSError:
            raise
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    return wrapper  # type: ignore[return-value]


def translate_public_methods(cls):
    """Class decorator: every public method defined on ``cls`` raises FusedPSError instead of
    grpc.RpcError."""
    for name, value in list(vars(cls).items()):
        if not name.startswith("_") and isinstance(value, types.FunctionType):
            setattr(cls, name, translated(value))
    return cls
