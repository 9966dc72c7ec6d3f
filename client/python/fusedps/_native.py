"""The native transport: the C++ client (libfusedps_c, client/capi/fusedps_c.h) through ctypes.

Internal module; fusedps.client.Client uses it for pushes and pulls when the library is found
(transport="auto" or "native"). Why: grpcio copies every message under the GIL and moves one
call at about 1.3-1.6 GB/s, while the C++ client sends a push as several concurrent calls at
several GB/s (docs/benchmarks.md). ctypes releases the GIL for the whole foreign call.

The library is looked for in $FUSEDPS_NATIVE_LIB (a path), then beside this file (where the
build and the wheel put it). It links the C++ gRPC libraries it was built against (Debian's),
which must be on the loader's path.

Lifetimes: a NativeClient owns one fusedps_client from __init__ to close(). The tensors given to
push()/pull()/pull_raw() are held by the caller's frame for the whole call; the C side reads (or
writes) them only during the call. A NativePush reads the memory of its writes until its
commit() or cancel() returns; the caller keeps it alive until then.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import List, Optional, Sequence, Tuple

import grpc

from fusedps import _dtypes, errors
from fusedps._lazy import LazyModule
from fusedps.results import PulledTensors

torch = LazyModule("torch")

_LIBRARY_NAME = "libfusedps_c.so"
C_API_VERSION = 11  # FUSEDPS_C_API_VERSION of the header this module mirrors.

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Error(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("local", ctypes.c_int32),
                ("message", ctypes.c_char * 1024)]


class _ClientOptions(ctypes.Structure):
    _fields_ = [("max_chunk_bytes", ctypes.c_uint64), ("streams", ctypes.c_int32),
                ("timeout_seconds", ctypes.c_double),
                ("min_bytes_per_second", ctypes.c_double), ("tls", ctypes.c_int32),
                ("tls_ca_file", ctypes.c_char_p), ("tls_cert_file", ctypes.c_char_p),
                ("tls_key_file", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("model", ctypes.c_char_p)]


class _PushHeader(ctypes.Structure):
    _fields_ = [("client_id", ctypes.c_char_p), ("sequence_number", ctypes.c_uint64),
                ("grad_dtype", ctypes.c_int32), ("grad_scale", ctypes.c_float),
                ("base_version", ctypes.c_uint64), ("plan_hash", ctypes.c_char_p),
                ("max_parts", ctypes.c_uint32)]


class _PushResult(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint64), ("step_skipped", ctypes.c_int32),
                ("skip_reason", ctypes.c_char * 64), ("tensors_updated", ctypes.c_uint32),
                ("grad_bytes", ctypes.c_uint64), ("duplicate", ctypes.c_int32),
                ("round_workers", ctypes.c_uint32), ("round_timed_out", ctypes.c_int32),
                ("missing_replicas", ctypes.c_char * 1024), ("pulled_version", ctypes.c_uint64)]


_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_load_error: Optional[str] = None


def _declare(lib: ctypes.CDLL) -> None:
    p = ctypes.POINTER
    lib.fusedps_c_api_version.restype = ctypes.c_int32
    lib.fusedps_client_create.restype = ctypes.c_void_p
    lib.fusedps_client_create.argtypes = [ctypes.c_char_p, p(_ClientOptions), p(_Error)]
    lib.fusedps_client_destroy.restype = None
    lib.fusedps_client_destroy.argtypes = [ctypes.c_void_p]
    lib.fusedps_push_gradients.restype = ctypes.c_int32
    lib.fusedps_push_gradients.argtypes = [
        ctypes.c_void_p, p(_PushHeader), ctypes.c_size_t, p(ctypes.c_char_p),
        p(ctypes.c_void_p), p(ctypes.c_uint64), p(_PushResult), p(_Error)]
    lib.fusedps_client_wait_ready.restype = ctypes.c_int32
    lib.fusedps_client_wait_ready.argtypes = [ctypes.c_void_p, ctypes.c_double, p(_Error)]
    lib.fusedps_client_set_workspace.restype = ctypes.c_int32
    lib.fusedps_client_set_workspace.argtypes = [ctypes.c_void_p, ctypes.c_char_p,
                                                 ctypes.c_void_p, ctypes.c_uint64, p(_Error)]
    lib.fusedps_push_begin.restype = ctypes.c_void_p
    lib.fusedps_push_begin.argtypes = [
        ctypes.c_void_p, p(_PushHeader), ctypes.c_size_t, p(ctypes.c_char_p), p(ctypes.c_uint64),
        p(_Error)]
    lib.fusedps_push_write.restype = ctypes.c_int32
    lib.fusedps_push_write.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, p(ctypes.c_uint64), p(ctypes.c_uint64),
        p(ctypes.c_uint64), p(ctypes.c_void_p), p(_Error)]
    lib.fusedps_push_commit.restype = ctypes.c_int32
    lib.fusedps_push_commit.argtypes = [ctypes.c_void_p, ctypes.c_float, p(_PushResult),
                                        p(_Error)]
    lib.fusedps_push_commit_pull.restype = ctypes.c_int32
    lib.fusedps_push_commit_pull.argtypes = [
        ctypes.c_void_p, ctypes.c_float, ctypes.c_int32, ctypes.c_size_t, p(ctypes.c_char_p),
        p(ctypes.c_void_p), p(ctypes.c_uint64), p(_PushResult), p(_Error)]
    lib.fusedps_push_cancel.restype = None
    lib.fusedps_push_cancel.argtypes = [ctypes.c_void_p]
    lib.fusedps_push_destroy.restype = None
    lib.fusedps_push_destroy.argtypes = [ctypes.c_void_p]
    lib.fusedps_pull_into.restype = ctypes.c_int32
    lib.fusedps_pull_into.argtypes = [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_size_t,
        p(ctypes.c_char_p), p(ctypes.c_void_p), p(ctypes.c_uint64), p(ctypes.c_uint64),
        p(ctypes.c_int64), p(_Error)]
    lib.fusedps_pipelined_pull_start.restype = ctypes.c_void_p
    lib.fusedps_pipelined_pull_start.argtypes = [
        p(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
        ctypes.c_size_t, ctypes.c_size_t, p(ctypes.c_uint64), p(ctypes.c_uint64),
        p(ctypes.c_char_p), p(ctypes.c_void_p), p(ctypes.c_uint64), p(_Error)]
    lib.fusedps_pipelined_pull_wait.restype = ctypes.c_int32
    lib.fusedps_pipelined_pull_wait.argtypes = [ctypes.c_void_p, ctypes.c_int64, p(_Error)]
    lib.fusedps_pipelined_pull_landed.restype = ctypes.c_int64
    lib.fusedps_pipelined_pull_landed.argtypes = [ctypes.c_void_p]
    lib.fusedps_pipelined_pull_version.restype = ctypes.c_uint64
    lib.fusedps_pipelined_pull_version.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.fusedps_pipelined_pull_seconds.restype = ctypes.c_double
    lib.fusedps_pipelined_pull_seconds.argtypes = [ctypes.c_void_p]
    lib.fusedps_pipelined_pull_destroy.restype = None
    lib.fusedps_pipelined_pull_destroy.argtypes = [ctypes.c_void_p]
    lib.fusedps_pull.restype = ctypes.c_int32
    lib.fusedps_pull.argtypes = [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_size_t, p(ctypes.c_char_p),
        p(ctypes.c_void_p), p(ctypes.c_uint64), p(ctypes.c_int64), p(ctypes.c_uint64),
        p(ctypes.c_int64), p(_Error)]


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, or None when it is not there or does not load (load_error() says
    why). Loaded once per process."""
    global _library, _load_error
    with _lock:
        if _library is not None or _load_error is not None:
            return _library
        path = os.environ.get("FUSEDPS_NATIVE_LIB") or os.path.join(
            os.path.dirname(os.path.abspath(__file__)), _LIBRARY_NAME)
        try:
            lib = ctypes.CDLL(path)
            _declare(lib)
            version = lib.fusedps_c_api_version()
            if version != C_API_VERSION:
                raise OSError(f"C API version {version}, this package needs {C_API_VERSION}")
        except OSError as e:
            _load_error = f"{path}: {e}"
            return None
        _library = lib
        return lib


def load_error() -> Optional[str]:
    """Why library() returned None (None when it loaded or was not tried)."""
    return _load_error


def _raise(error: _Error) -> None:
    """A mistake in the caller's arguments that the library found itself raises ValueError,
    as the Python client's own checks do; a call's status raises its FusedPSError."""
    message = error.message.decode("utf-8", "replace")
    if error.local:
        raise ValueError(message)
    raise errors.error_for(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), message)


def _pointers(tensors: Sequence) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def _names(names: Sequence[str]) -> ctypes.Array:
    return (ctypes.c_char_p * len(names))(*[n.encode("utf-8") for n in names])


class NativeClient:
    """One fusedps_client: pushes and pulls of float32 host tensors through the C++ client.

    Args mirror fusedps.client.Client's: timeout None means no deadline; tls_ca, tls_cert and
    tls_key are paths (the C++ client reads them), token the token itself (a token file is
    read by the caller).
    Raises:
      RuntimeError: the library is not available (load_error() says why).
      ValueError: options the C++ client refuses, TLS files it cannot read.
    """

    def __init__(self, target: str, *, streams: int, max_chunk_bytes: int,
                 timeout: Optional[float], min_bytes_per_second: float, tls: bool = False,
                 tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, token: Optional[str] = None,
                 model: str = ""):
        lib = library()
        if lib is None:
            raise RuntimeError(f"the native transport is not available: {load_error()}")
        self._lib = lib

        def c_string(value: Optional[str]) -> Optional[bytes]:
            return None if value is None else os.fsencode(value)

        options = _ClientOptions(max_chunk_bytes, streams,
                                 -1.0 if timeout is None else float(timeout),
                                 float(min_bytes_per_second), 1 if tls else 0,
                                 c_string(tls_ca), c_string(tls_cert), c_string(tls_key),
                                 None if token is None else token.encode("utf-8"),
                                 model.encode("utf-8"))
        error = _Error()
        handle = lib.fusedps_client_create(target.encode("utf-8"), ctypes.byref(options),
                                           ctypes.byref(error))
        if not handle:
            _raise(error)
        self._handle = handle

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle:
            self._lib.fusedps_client_destroy(handle)

    def push(self, *, client_id: str, sequence_number: int, grad_dtype: int,
             grad_scale: Optional[float], base_version: int, plan_hash: str,
             names: Sequence[str], grads: Sequence) -> _PushResult:
        """One push; ``grads`` are contiguous float32 CPU tensors, one per name. Returns the
        reply (fields as fusedps_push_result). Raises FusedPSError with the call's status."""
        header = _PushHeader(client_id.encode("utf-8"), sequence_number, grad_dtype,
                             -1.0 if grad_scale is None else grad_scale, base_version,
                             plan_hash.encode("utf-8"))
        numels = (ctypes.c_uint64 * len(grads))(*[g.numel() for g in grads])
        result = _PushResult()
        error = _Error()
        code = self._lib.fusedps_push_gradients(
            self._handle, ctypes.byref(header), len(names), _names(names), _pointers(grads),
            numels, ctypes.byref(result), ctypes.byref(error))
        if code:
            _raise(error)
        return result

    def pull(self, names: Sequence[str], dst: Sequence, *, dtype: int,
             field: int) -> Tuple[int, List[int]]:
        """Pulls one field of ``names`` into ``dst`` (contiguous float32 CPU tensors shaped as
        registered), all at one version. Returns (version, steps). Raises ValueError naming the
        tensor for a shape that differs from the server's, FusedPSError for the call's; dst
        may then be partly written."""
        ranks = (ctypes.c_uint64 * len(dst))(*[t.dim() for t in dst])
        flat_dims = [d for t in dst for d in t.shape]
        dims = (ctypes.c_int64 * max(len(flat_dims), 1))(*flat_dims)
        steps = (ctypes.c_int64 * len(dst))()
        version = ctypes.c_uint64()
        error = _Error()
        code = self._lib.fusedps_pull(self._handle, dtype, field, len(names), _names(names),
                                      _pointers(dst), ranks, dims, ctypes.byref(version), steps,
                                      ctypes.byref(error))
        if code:
            _raise(error)
        return int(version.value), list(steps)


    def wait_ready(self, timeout: float) -> None:
        """Connects every stream's channel within ``timeout`` seconds. Raises
        DeadlineExceeded (FusedPSError) when they have not all connected."""
        error = _Error()
        if self._lib.fusedps_client_wait_ready(self._handle, float(timeout),
                                               ctypes.byref(error)):
            _raise(error)

    def set_workspace(self, workspace_id: Optional[str], address: int = 0,
                      size: int = 0) -> None:
        """Pushes begun and pulls made from now on go through the workspace mapped at
        [address, address + size) (fusedps._workspace): pieces and targets inside it travel as
        their places. None stops that."""
        error = _Error()
        if self._lib.fusedps_client_set_workspace(
                self._handle, workspace_id.encode("utf-8") if workspace_id else None,
                ctypes.c_void_p(address or None), int(size), ctypes.byref(error)):
            _raise(error)

    def begin_push(self, *, client_id: str, sequence_number: int, grad_dtype: int,
                   base_version: int, plan_hash: str, names: Sequence[str],
                   numels: Sequence[int], max_parts: int = 0) -> "NativePush":
        """Begins a push of ``names`` (numels[i] elements each), committed at the end
        (fusedps_push_begin), as at most ``max_parts`` calls (0: one per stream). Raises
        ValueError for arguments the library refuses."""
        header = _PushHeader(client_id.encode("utf-8"), sequence_number, grad_dtype, -1.0,
                             base_version, plan_hash.encode("utf-8"), max_parts)
        counts = (ctypes.c_uint64 * len(numels))(*numels)
        error = _Error()
        handle = self._lib.fusedps_push_begin(self._handle, ctypes.byref(header), len(names),
                                              _names(names), counts, ctypes.byref(error))
        if not handle:
            _raise(error)
        return NativePush(self._lib, handle)

    def pull_raw(self, names: Sequence[str], pointers: Sequence[int], numels: Sequence[int], *,
                 dtype: int, field: int, stream: int = 0) -> Tuple[int, List[int]]:
        """Pulls one field of ``names`` over one call on ``stream``, writing numels[i] raw
        elements of ``dtype`` at pointers[i] (host memory the caller keeps alive). Returns
        (version, steps). Raises ValueError naming a tensor of another size, FusedPSError for
        the call's status."""
        n = len(names)
        dst = (ctypes.c_void_p * n)(*pointers)
        counts = (ctypes.c_uint64 * n)(*numels)
        steps = (ctypes.c_int64 * n)()
        version = ctypes.c_uint64()
        error = _Error()
        code = self._lib.fusedps_pull_into(self._handle, stream, dtype, field, n, _names(names),
                                           dst, counts, ctypes.byref(version), steps,
                                           ctypes.byref(error))
        if code:
            _raise(error)
        return int(version.value), list(steps)


class PieceArrays:
    """A push's pieces as the C arrays fusedps_push_write takes (NativePush.write_arrays)."""

    __slots__ = ("count", "tensors", "offsets", "counts", "pointers")

    def __init__(self, tensors: Sequence[int], offsets: Sequence[int], counts: Sequence[int],
                 pointers: Sequence[int]):
        n = self.count = len(tensors)
        self.tensors = (ctypes.c_uint64 * n)(*tensors)
        self.offsets = (ctypes.c_uint64 * n)(*offsets)
        self.counts = (ctypes.c_uint64 * n)(*counts)
        self.pointers = (ctypes.c_void_p * n)(*pointers)


class NativePush:
    """One fusedps_push: a push written a piece at a time and committed at the end.

    Lifetimes: the memory each write() points at is read until commit() or cancel() returns;
    close() (or commit/cancel, then close) frees the handle. One thread at a time.
    """

    def __init__(self, lib: ctypes.CDLL, handle: int):
        self._lib = lib
        self._handle: Optional[int] = handle  # None once closed.

    def write(self, tensors: Sequence[int], offsets: Sequence[int], counts: Sequence[int],
              pointers: Sequence[int]) -> None:
        """Queues pieces: elements [offsets[i], + counts[i]) of tensor number tensors[i], raw
        wire-dtype elements at pointers[i]. Raises ValueError for a piece outside its tensor,
        FusedPSError when a part of the push has failed."""
        self.write_arrays(PieceArrays(tensors, offsets, counts, pointers))

    def write_arrays(self, pieces: "PieceArrays") -> None:
        """write() of pieces already in C arrays (made once, written every step)."""
        error = _Error()
        if self._lib.fusedps_push_write(self._handle, pieces.count, pieces.tensors,
                                        pieces.offsets, pieces.counts, pieces.pointers,
                                        ctypes.byref(error)):
            _raise(error)

    def commit(self, grad_scale: Optional[float],
               then_pull: Optional["CommitPull"] = None) -> _PushResult:
        """Commits with grad_scale (None: none) and returns the reply; with then_pull, the
        commit carries that pull into the push's workspace (fusedps_push_commit_pull). Raises
        FusedPSError."""
        result = _PushResult()
        error = _Error()
        scale = -1.0 if grad_scale is None else grad_scale
        if then_pull is None:
            code = self._lib.fusedps_push_commit(self._handle, scale, ctypes.byref(result),
                                                 ctypes.byref(error))
        else:
            code = self._lib.fusedps_push_commit_pull(
                self._handle, scale, then_pull.dtype, then_pull.count, then_pull.names,
                then_pull.addresses, then_pull.numels, ctypes.byref(result), ctypes.byref(error))
        if code:
            _raise(error)
        return result

    def cancel(self) -> None:
        if self._handle:
            self._lib.fusedps_push_cancel(self._handle)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle:
            self._lib.fusedps_push_destroy(handle)


class CommitPull:
    """The pull a push's commit carries (fusedps_push_commit_pull), as C arrays made once per
    layout: each entry (name, address, numel) is written at address, inside the push's
    workspace, in the wire dtype ``dtype`` (a fusedps._dtypes.WIRE_CODES value). ``entries``
    keeps the Python form (the grpcio transport's)."""

    __slots__ = ("dtype", "entries", "count", "names", "addresses", "numels")

    def __init__(self, dtype: int, entries: Sequence[Tuple[str, int, int]]):
        self.dtype = int(dtype)
        self.entries = [(str(n), int(a), int(k)) for n, a, k in entries]
        self.count = len(self.entries)
        self.names = (ctypes.c_char_p * self.count)(*[n.encode("utf-8") for n, _, _ in
                                                      self.entries])
        self.addresses = (ctypes.c_void_p * self.count)(*[a for _, a, _ in self.entries])
        self.numels = (ctypes.c_uint64 * self.count)(*[k for _, _, k in self.entries])


class PullGroups:
    """A pipelined pull's groups as the C arrays fusedps_pipelined_pull_start takes: made once
    per layout, started every step (PipelinedPull).

    Args:
      groups: per group, (client index, name, address, numel) entries: numel raw elements of
        the pull's dtype are written at address (host memory the caller keeps alive until each
        pull of these groups is closed).
    """

    __slots__ = ("groups", "count", "group", "client", "names", "addresses", "numels")

    def __init__(self, groups: Sequence[Sequence[tuple]]):
        entries = [(g, c, n, a, k) for g, group in enumerate(groups) for c, n, a, k in group]
        self.groups = len(groups)
        n = self.count = len(entries)
        u64 = ctypes.c_uint64 * n
        self.group = u64(*[e[0] for e in entries])
        self.client = u64(*[e[1] for e in entries])
        self.names = _names([e[2] for e in entries])
        self.addresses = (ctypes.c_void_p * n)(*[e[3] for e in entries])
        self.numels = u64(*[e[4] for e in entries])


class PipelinedPull:
    """One fusedps_pipelined_pull: groups of tensors pulled over the clients' streams on the C++
    client's threads (no Python thread, no GIL while they run), waited for group by group.

    Args:
      clients: NativeClients (one per shard); they outlive the pull.
      groups: what lands where (PullGroups).
      dtype, field: proto enum numbers (fusedps_c.h); threads: groups in flight at once.
    Raises:
      ValueError: arguments the library refuses.
    Lifetimes: close() waits for the groups in flight and frees the handle.
    """

    def __init__(self, clients: Sequence[NativeClient], groups: "PullGroups", *,
                 dtype: int, field: int, threads: int):
        self._lib = clients[0]._lib
        handles = (ctypes.c_void_p * len(clients))(*[c._handle for c in clients])
        error = _Error()
        handle = self._lib.fusedps_pipelined_pull_start(
            handles, len(clients), dtype, field, threads, groups.groups, groups.count,
            groups.group, groups.client, groups.names, groups.addresses, groups.numels,
            ctypes.byref(error))
        if not handle:
            _raise(error)
        self._handle = handle
        self.groups = groups.groups

    def wait(self, group: int) -> None:
        """Blocks until groups 0..group have landed. Raises the first one's error (ValueError
        for a tensor of another size, FusedPSError for a call's status)."""
        error = _Error()
        if self._lib.fusedps_pipelined_pull_wait(self._handle, int(group), ctypes.byref(error)):
            _raise(error)

    def landed(self) -> int:
        """How many leading groups have landed, without waiting."""
        return int(self._lib.fusedps_pipelined_pull_landed(self._handle))

    def version(self, client: int) -> int:
        return int(self._lib.fusedps_pipelined_pull_version(self._handle, client))

    def seconds(self) -> float:
        """Seconds from the start to the last group landed so far."""
        return float(self._lib.fusedps_pipelined_pull_seconds(self._handle))

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle:
            self._lib.fusedps_pipelined_pull_destroy(handle)


def pull_into(native: NativeClient, targets: Sequence, wire: str, field: int) -> PulledTensors:
    """Pulls one field of the tensors of ``targets`` ((name, tensor) pairs) into them, at one
    version: straight into a contiguous float32 CPU tensor, through a float32 CPU buffer and
    one copy_ into any other. Returns the values as fusedps.client.Client.pull_parameters
    does (``wire``'s dtype; the target itself where it was written in place).

    Raises:
      ValueError: a target whose shape differs from the server's.
      FusedPSError: the call's status. The targets may then be partly written.
    """
    dst = []
    for _, t in targets:
        if t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32:
            dst.append(t.detach())
        else:
            dst.append(torch.empty(t.shape, dtype=torch.float32))
    names = [n for n, _ in targets]
    version, steps = native.pull(names, dst, dtype=_dtypes.WIRE_CODES[wire], field=field)
    with torch.no_grad():
        for (_, t), d in zip(targets, dst):
            if d.data_ptr() != t.data_ptr():
                t.copy_(d)
    wire_dtype = _dtypes.torch_dtype(wire)
    return PulledTensors(
        ((n, d if d.dtype == wire_dtype else d.to(wire_dtype)) for n, d in zip(names, dst)),
        version=version, steps=dict(zip(names, steps)), dtype=wire)
