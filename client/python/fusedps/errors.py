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


def _status_class(name: str, status: grpc.StatusCode, doc: str) -> Type[FusedPSError]:
    cls = type(name, (FusedPSError,), {"status_code": status, "__doc__": doc})
    cls.__module__ = __name__
    return cls


Cancelled = _status_class("Cancelled", grpc.StatusCode.CANCELLED,
                          "The call was cancelled (by the caller, or the server shut down).")
Unknown = _status_class("Unknown", grpc.StatusCode.UNKNOWN, "An error of no known status.")
InvalidArgument = _status_class(
    "InvalidArgument", grpc.StatusCode.INVALID_ARGUMENT,
    "The request was refused as malformed (a size, dtype, name or value out of its limits); "
    "the message names the field and the limit. Nothing changed on the server.")
DeadlineExceeded = _status_class(
    "DeadlineExceeded", grpc.StatusCode.DEADLINE_EXCEEDED,
    "The call did not finish within its deadline (Client's timeout plus its payload at "
    "min_bytes_per_second).")
NotFound = _status_class("NotFound", grpc.StatusCode.NOT_FOUND,
                         "An unknown tensor or param group.")
AlreadyExists = _status_class(
    "AlreadyExists", grpc.StatusCode.ALREADY_EXISTS,
    "A registration that conflicts with what the server holds (another shape or group).")
PermissionDenied = _status_class("PermissionDenied", grpc.StatusCode.PERMISSION_DENIED,
                                 "The caller's identity may not make this call.")
ResourceExhausted = _status_class(
    "ResourceExhausted", grpc.StatusCode.RESOURCE_EXHAUSTED,
    "The server is out of a resource (memory, disk, a message size limit).")
FailedPrecondition = _status_class(
    "FailedPrecondition", grpc.StatusCode.FAILED_PRECONDITION,
    "The server is not in a state that allows the call (another sharding plan, no "
    "checkpoint directory, a field the group does not keep, ...).")
Aborted = _status_class(
    "Aborted", grpc.StatusCode.ABORTED,
    "A push refused for its order: a stale sequence_number, or a base_version the consistency "
    "mode refuses (the message names the shard's version). Pull and retry.")
OutOfRange = _status_class("OutOfRange", grpc.StatusCode.OUT_OF_RANGE,
                           "A value past the end of a valid range.")
Unimplemented = _status_class("Unimplemented", grpc.StatusCode.UNIMPLEMENTED,
                              "The server does not implement the call (an older server).")
Internal = _status_class(
    "Internal", grpc.StatusCode.INTERNAL,
    "A broken invariant on the server (e.g. a device fault); the server fails loudly.")
Unavailable = _status_class(
    "Unavailable", grpc.StatusCode.UNAVAILABLE,
    "No server answered: not reachable, shutting down, or a dropped connection (keepalive).")
DataLoss = _status_class("DataLoss", grpc.StatusCode.DATA_LOSS, "Unrecoverable data loss.")
Unauthenticated = _status_class("Unauthenticated", grpc.StatusCode.UNAUTHENTICATED,
                                "The call carried no valid credentials.")



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


_BY_CODE: Dict[grpc.StatusCode, Type[FusedPSError]] = {
    cls.status_code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
                PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
                Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)
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
