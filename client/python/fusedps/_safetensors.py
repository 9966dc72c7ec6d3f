"""The safetensors codec of fusedps checkpoints (fusedps.checkpoint; docs/checkpoints.md).

The format: a u64 little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets"}} with an optional "__metadata__", then the data.
Files are written here as the server writes them (common/safetensors.cc): header keys sorted,
the data in registration order, the header padded with spaces so the data starts 8-byte
aligned. They are read with the ``safetensors`` package when it is importable, else with the
small decoder here (F32, BF16, F16, U8, and the dtypes of a model's buffers: F64, I64, I32,
I16, I8, BOOL).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import zlib
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

try:  # Optional: not in Debian 12. The decoder below is the fallback.
    import safetensors.torch as _safetensors_torch
except ImportError:  # pragma: no cover - depends on the environment
    _safetensors_torch = None

__all__ = ["decode_safetensors", "read_safetensors", "write_safetensors", "tensor_bytes",
           "dtype_name", "tensor_of_bytes"]

_MAX_HEADER_BYTES = 100 << 20  # The safetensors package's limit.

# safetensors dtype -> (torch dtype, element size); the integer type of the same size is used to
# move raw bits through numpy, which has no bfloat16.
# The server's table is common/safetensors.cc's kDTypes: the same names, in the same order.
_DTYPES = {"F32": (torch.float32, 4), "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2),
           "U8": (torch.uint8, 1), "F64": (torch.float64, 8), "I64": (torch.int64, 8),
           "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
           "BOOL": (torch.bool, 1)}
_TORCH_TO_ST = {dt: name for name, (dt, _) in _DTYPES.items()}
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
DTYPE_NAMES = ", ".join(_DTYPES)


def _check_little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover - no such host in use
        raise RuntimeError("fusedps.checkpoint supports little-endian hosts only")


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("F32", "I64", ...). TypeError for a dtype the
    format (and the server) does not have."""
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise TypeError(f"{dtype} is not one of the dtypes {DTYPE_NAMES}") from None


def tensor_of_bytes(data: bytes, dtype_name_: str, shape) -> torch.Tensor:
    """A CPU tensor of safetensors dtype ``dtype_name_`` and ``shape`` from its little-endian
    row-major bytes (copied). ValueError for an unknown dtype or a size that disagrees."""
    if dtype_name_ not in _DTYPES:
        raise ValueError(f"dtype {dtype_name_!r} is not one of {DTYPE_NAMES}")
    dtype, itemsize = _DTYPES[dtype_name_]
    shape = tuple(int(d) for d in shape)
    if len(data) != math.prod(shape) * itemsize:
        raise ValueError(f"{len(data)} bytes are not {shape} of {dtype_name_}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The little-endian row-major bytes of a tensor of a dtype the format has (any device)."""
    dtype_name(t.dtype)
    return _raw_bytes(t)


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The little-endian bytes of a CPU tensor of a _DTYPES dtype, row-major."""
    if t.numel() == 0:
        return b""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(_BITS[flat.element_size()]).numpy().tobytes()


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor],
                      metadata: Optional[Mapping[str, str]] = None, *,
                      fsync: bool = True) -> Tuple[int, int]:
    """Writes ``tensors`` (name -> tensor of a dtype of DTYPE_NAMES: float32, bfloat16, float16,
    uint8, float64, int64, int32, int16, int8 or bool; any shape, any device) to a safetensors file at ``path``, the data in the mapping's order, and
    returns ``(size in bytes, CRC-32 of the whole file)``: the CRC as ``zlib.crc32`` computes
    it over the file's bytes (an int in 0..2**32-1), the checksum a checkpoint manifest lists.

    The layout is the server's (common/safetensors.cc): the header JSON with sorted keys and
    no spaces, padded with spaces so that the data starts at a multiple of 8 bytes; readable by
    ``safetensors.torch.load_file``. ``fsync``: flush the file to disk before returning.

    Raises:
      TypeError: a value that is not a tensor, or of another dtype.
      ValueError: an empty name, or "__metadata__".
      OSError: the file cannot be written.
    """
    _check_little_endian()
    header: Dict[str, Any] = {}
    blobs: List[bytes] = []
    offset = 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"safetensors tensor name {name!r} is empty or reserved")
        if not isinstance(t, torch.Tensor) or t.dtype not in _TORCH_TO_ST:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}: expected a tensor of one of the dtypes {DTYPE_NAMES}, "
                            f"got {got}")
        blob = _raw_bytes(t)
        header[name] = {"dtype": _TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    head = text.encode("utf-8")
    head += b" " * ((8 - len(head) % 8) % 8)
    crc = 0
    size = 0
    with open(path, "wb") as f:
        for part in [struct.pack("<Q", len(head)), head, *blobs]:
            f.write(part)
            crc = zlib.crc32(part, crc)
            size += len(part)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return size, crc


def _decode_builtin(data: bytes, what: str) -> Dict[str, torch.Tensor]:
    def bad(why: str) -> ValueError:
        return ValueError(f"{what} is not a valid safetensors file: {why}")

    _check_little_endian()
    if len(data) < 8:
        raise bad(f"only {len(data)} bytes")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > _MAX_HEADER_BYTES or n > len(data) - 8:
        raise bad(f"a header of {n} bytes in a file of {len(data)}")
    try:
        header = json.loads(bytes(data[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ is not an object of strings")
    start, size = 8 + n, len(data) - 8 - n
    entries = []
    for name, entry in header.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and isinstance(entry.get("data_offsets"), list)
                and len(entry["data_offsets"]) == 2):
            raise bad(f"{name}: needs dtype, shape and data_offsets [begin, end]")
        if entry.get("dtype") not in _DTYPES:
            raise bad(f"{name}: dtype {entry.get('dtype')!r} is not one of {DTYPE_NAMES}")
        dims = entry["shape"] + entry["data_offsets"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise bad(f"{name}: a dimension or offset is not a non-negative integer")
        begin, end = entry["data_offsets"]
        dtype, itemsize = _DTYPES[entry["dtype"]]
        if end < begin or end - begin != math.prod(entry["shape"]) * itemsize:
            raise bad(f"{name}: data_offsets disagree with the shape and dtype")
        entries.append((begin, end, name, dtype, tuple(entry["shape"])))
    entries.sort(key=lambda x: (x[0], x[1]))
    covered = 0
    for begin, end, name, _, _ in entries:
        if begin != covered:
            raise bad(f"{name} leaves a gap or overlaps")
        covered = end
    if covered != size:
        raise bad(f"the tensors cover {covered} bytes of data, the file has {size}")
    view = memoryview(data)
    out: Dict[str, torch.Tensor] = {}
    for begin, end, name, dtype, shape in entries:
        if begin == end:
            out[name] = torch.empty(shape, dtype=dtype)
        else:  # A buffer of its own (aligned, writable) that the tensor keeps alive.
            buf = bytearray(view[start + begin:start + end])
            out[name] = torch.frombuffer(buf, dtype=dtype).reshape(shape)
    return out


def decode_safetensors(data: bytes, what: str = "<bytes>", *,
                       use_package: Optional[bool] = None) -> Dict[str, torch.Tensor]:
    """The tensors (name -> CPU tensor, shapes as stored) of safetensors file contents.

    ``use_package``: None uses the ``safetensors`` package when importable, else the codec
    here; True requires the package; False always uses the codec here (which accepts the
    dtypes of DTYPE_NAMES and checks that the data offsets cover the data exactly). ``what``
    names the data in errors.

    Raises:
      ValueError: the data is not a valid safetensors file (naming ``what``).
      ImportError: use_package=True without the package.
    """
    if use_package is None:
        use_package = _safetensors_torch is not None
    if not use_package:
        return _decode_builtin(data, what)
    if _safetensors_torch is None:
        raise ImportError("the safetensors package is not installed")
    try:
        return dict(_safetensors_torch.load(bytes(data)))
    except Exception as e:  # The package raises its own SafetensorError.
        raise ValueError(f"{what} is not a valid safetensors file: {e}") from None


def read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """The tensors of the safetensors file at ``path`` (see decode_safetensors)."""
    with open(path, "rb") as f:
        return decode_safetensors(f.read(), path)
