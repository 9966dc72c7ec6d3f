"""A server GPU's memory opened in this process through CUDA IPC (device workspaces).

Internal module of fusedps._workspace. The server shares a cudaMalloc'd range as a
cudaIpcMemHandle_t (64 bytes, proto OpenWorkspaceResponse.cuda_ipc_handle); open_handle() maps it
here with the CUDA driver API (libcuda.so.1 through ctypes, so that neither torch's version nor
a CUDA toolkit matters) in torch's primary context of the trainer's device, and wraps it as a
uint8 CUDA tensor without a copy (__cuda_array_interface__). The GPU must be the server's own:
a range of another GPU would be a tensor of that device here, which the trainer's copies would
reach only across devices (refused, with the reason).

Lifetimes: the mapping lives until close_handle() (cuIpcCloseMemHandle); every tensor made
from it must be unused by then (no queued kernel or copy reading or writing it), and the
exporter (the server) must not free the memory before. Thread safety: open_handle() and
close_handle() from any one thread at a time; the tensor, as any CUDA tensor, from any thread
of the process (the mapping is the primary context's, which every thread shares).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional, Tuple

import torch

__all__ = ["IpcError", "open_handle", "close_handle"]

HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_SUCCESS = 0

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


class IpcError(Exception):
    """The handle cannot be used here; str() says why."""


class _Handle(ctypes.Structure):  # CUipcMemHandle: 64 raw bytes, passed by value.
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class _Uuid(ctypes.Structure):  # CUuuid
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _Array:
    """A device range as numba's __cuda_array_interface__ (version 2: no stream), for
    torch.as_tensor. The tensor made from it holds it (and nothing else) while it lives."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "version": 2, "typestr": "|u1", "shape": (int(nbytes),), "strides": None,
            "data": (int(ptr), False)}


def _driver() -> ctypes.CDLL:
    """libcuda, its functions' signatures set once. Raises IpcError when it is not here."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise IpcError(f"no CUDA driver here (libcuda.so.1: {e})") from None
        ptr, uint, res = ctypes.c_uint64, ctypes.c_uint, ctypes.c_int
        signatures = {
            "cuInit": [uint],
            "cuGetErrorString": [res, ctypes.POINTER(ctypes.c_char_p)],
            "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
            "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
            "cuDeviceGetUuid": [ctypes.POINTER(_Uuid), ctypes.c_int],
            "cuDeviceGetUuid_v2": [ctypes.POINTER(_Uuid), ctypes.c_int],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(ptr), _Handle, uint],
            "cuIpcOpenMemHandle": [ctypes.POINTER(ptr), _Handle, uint],
            "cuIpcCloseMemHandle": [ptr],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = res
        _lib = lib
        return lib


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code == _SUCCESS:
        return
    text = ctypes.c_char_p()
    fn = getattr(lib, "cuGetErrorString", None)
    name = ""
    if fn is not None and fn(code, ctypes.byref(text)) == _SUCCESS and text.value:
        name = f": {text.value.decode(errors='replace')}"
    raise IpcError(f"{what} failed (CUDA error {code}{name})")


def _format_uuid(uuid: _Uuid) -> str:
    h = bytes(uuid.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _uuids(lib: ctypes.CDLL, device: int) -> Tuple[str, ...]:
    """The UUIDs the driver gives the device (the GPU's; under MIG the instance's too)."""
    found = []
    for name in ("cuDeviceGetUuid", "cuDeviceGetUuid_v2"):
        fn = getattr(lib, name, None)
        uuid = _Uuid()
        if fn is not None and fn(ctypes.byref(uuid), device) == _SUCCESS:
            found.append(_format_uuid(uuid))
    return tuple(found)


def _enter_context(lib: ctypes.CDLL, device: torch.device) -> int:
    """Makes torch's primary context of ``device`` current on this thread (a tiny allocation
    creates it if nothing has, and a synchronize, a runtime call, binds it to this thread);
    returns the driver's device. Call under torch.cuda.device(device)."""
    torch.cuda.current_stream(device)
    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
    _check(lib, lib.cuInit(0), "cuInit")
    context = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    if not context.value:
        raise IpcError(f"no CUDA context is current for {device}")
    ordinal = ctypes.c_int()
    _check(lib, lib.cuCtxGetDevice(ctypes.byref(ordinal)), "cuCtxGetDevice")
    return ordinal.value


def open_handle(handle: bytes, nbytes: int, device: torch.device, server_uuid: str
                ) -> Tuple[int, torch.Tensor]:
    """Maps the server's range (``handle``, ``nbytes``) on ``device`` (a CUDA torch.device:
    the trainer's). Returns (address, uint8 CUDA tensor of nbytes on device, viewing it).
    Raises IpcError when it cannot be used here: no CUDA, no driver, a malformed handle,
    another GPU than ``server_uuid``'s (when both are known), a failed cuIpcOpenMemHandle (the
    handle is another host's, or the process's MPS or container settings forbid it)."""
    if device.type != "cuda":
        raise IpcError(f"the trainer's params are on {device}, not a CUDA device")
    if not torch.cuda.is_available():
        raise IpcError("torch has no CUDA here")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if len(handle) != HANDLE_BYTES:
        raise IpcError(f"the server's cuda_ipc_handle has {len(handle)} bytes, not "
                       f"{HANDLE_BYTES}")
    lib = _driver()
    if getattr(lib, "cuIpcOpenMemHandle_v2", None) is None and getattr(
            lib, "cuIpcOpenMemHandle", None) is None:
        raise IpcError("the CUDA driver has no cuIpcOpenMemHandle")
    with torch.cuda.device(device):
        ordinal = _enter_context(lib, device)
        mine = _uuids(lib, ordinal)
        if server_uuid and mine and server_uuid.lower() not in (u.lower() for u in mine):
            raise IpcError(f"the server's GPU ({server_uuid}) is not the trainer's {device} "
                           f"({mine[0]}): a device workspace is used from the server's GPU")
        opener = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        ptr = ctypes.c_uint64()
        _check(lib, opener(ctypes.byref(ptr), _Handle.from_buffer_copy(handle),
                           _LAZY_ENABLE_PEER_ACCESS),
               "cuIpcOpenMemHandle")
        address = int(ptr.value)
        try:
            # No device argument: where torch sees the memory (a pointer of another GPU
            # would otherwise be copied to this one).
            tensor = torch.as_tensor(_Array(address, nbytes))
            if tensor.device != device or tensor.data_ptr() != address:
                raise IpcError(f"the server's memory shows here as on {tensor.device}, the "
                               f"trainer's params are on {device}")
        except BaseException:
            close_handle(address, device)
            raise
    return address, tensor


def close_handle(address: int, device: torch.device) -> None:
    """Unmaps what open_handle() mapped at ``address`` (cuIpcCloseMemHandle). Raises IpcError when
    the driver fails."""
    lib = _driver()
    with torch.cuda.device(device):
        _enter_context(lib, device)
        _check(lib, lib.cuIpcCloseMemHandle(int(address)), "cuIpcCloseMemHandle")
