"""Tensor <-> wire-bytes conversion and chunk planning for the fusedps Python client.

Internal module: the public API is in fusedps.client. Nothing here talks to the network.

Wire rules (proto/fusedps/v1/parameter_service.proto):
  * element data is little-endian; float32, bfloat16 (the high 16 bits of a binary32) or
    IEEE float16;
  * a TensorChunk carries elements [offset, offset + n) of one tensor, offset in elements;
  * every request message must stay under the server's max receive size, so the client keeps
    each message (header excluded, it travels alone) at or under ``max_message_bytes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from fusedps._dtypes import element_size, torch_dtype
from fusedps._lazy import LazyModule

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = LazyModule("numpy")
    torch = LazyModule("torch")

# Bytes reserved per TensorChunk for protobuf framing: field tags, length varints (<= 5 bytes
# each) and the offset varint (<= 10 bytes). 32 covers the worst case with room to spare; the
# tensor name is counted separately.
CHUNK_FRAMING_BYTES = 32

# The smallest max_message_bytes the client accepts: enough for framing, a 256-byte name (the
# longest the server allows) and some payload.
MIN_MESSAGE_BYTES = 2048


def numpy_dtype(wire_name: str):
    """The little-endian numpy dtype that holds a wire dtype's raw elements (numpy has no
    bfloat16: its raw bits, as uint16, converted through torch)."""
    kind = "u" if wire_name == "bfloat16" else "f"
    return np.dtype(f"<{kind}{element_size(wire_name)}")


def to_wire_array(tensor: torch.Tensor, wire_name: str) -> np.ndarray:
    """Flattens a tensor into a 1-D little-endian numpy array of the wire dtype.

    The tensor may be on any device, any floating dtype, any layout (strided only); it is
    copied to the CPU and rounded to nearest-even where the wire dtype is narrower, exactly as
    ``tensor.to(dtype)`` rounds. The result may share memory with ``tensor`` when no conversion
    is needed, so it must be used before the tensor is modified.

    Raises:
      TypeError: for sparse tensors or non-floating dtypes.
    """
    if tensor.layout != torch.strided:
        raise TypeError(f"only dense tensors can be sent, got layout {tensor.layout}")
    if not (tensor.is_floating_point()):
        raise TypeError(f"expected a floating point tensor, got {tensor.dtype}")
    # Convert on the tensor's device first (a GPU rounds as the CPU does), so that only the
    # wire bytes are copied to host memory.
    t = tensor.detach().to(torch_dtype(wire_name)).to("cpu").contiguous().reshape(-1)
    return tensor_as_wire_array(t, wire_name)


def tensor_as_wire_array(flat, wire_name: str):
    """A 1-D numpy view of a contiguous 1-D CPU tensor of the wire dtype (bfloat16 as its raw
    uint16 bits): writes through it land in the tensor."""
    if wire_name == "bfloat16":
        arr = flat.view(torch.int16).numpy().view(np.uint16)
    else:
        arr = flat.numpy()
    return arr.astype(numpy_dtype(wire_name), copy=False)


def from_wire_array(arr: np.ndarray, wire_name: str, shape: Sequence[int]) -> torch.Tensor:
    """Turns a filled 1-D wire array into a torch tensor of ``shape``.

    float32 -> torch.float32, bfloat16 -> torch.bfloat16, float16 -> torch.float16. The tensor
    shares memory with ``arr`` (native byte order is little-endian on every platform torch
    supports here; a byte swap is done otherwise).
    """
    arr = arr.astype(arr.dtype.newbyteorder("="), copy=False)
    if wire_name == "bfloat16":
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(arr)
    return t.reshape(tuple(shape))


def empty_wire_array(numel: int, wire_name: str) -> np.ndarray:
    """An uninitialized 1-D little-endian array for ``numel`` elements of a wire dtype."""
    return np.empty(numel, dtype=numpy_dtype(wire_name))


def decode_into(dst: np.ndarray, offset: int, data: bytes) -> int:
    """Copies a chunk's raw little-endian bytes into ``dst[offset:]``; returns the element count.

    Raises:
      ValueError: when the payload is not a whole number of elements or runs past the end.
    """
    itemsize = dst.dtype.itemsize
    if len(data) % itemsize:
        raise ValueError(f"chunk of {len(data)} bytes is not a multiple of {itemsize}")
    n = len(data) // itemsize
    if offset < 0 or offset + n > dst.shape[0]:
        raise ValueError(
            f"chunk [{offset}, {offset + n}) is out of bounds for {dst.shape[0]} elements")
    if n:
        dst[offset:offset + n] = np.frombuffer(data, dtype=dst.dtype)
    return n


def elements_per_chunk(name: str, itemsize: int, max_message_bytes: int) -> int:
    """The most elements of tensor ``name`` that fit in one chunk of a message of the given size.

    Always >= 1 for max_message_bytes >= MIN_MESSAGE_BYTES and names of <= 256 bytes.
    """
    budget = max_message_bytes - CHUNK_FRAMING_BYTES - len(name.encode("utf-8"))
    return max(1, budget // itemsize)


def chunk_size_bytes(name: str, nbytes: int) -> int:
    """Upper bound of the serialized size of one TensorChunk with ``nbytes`` of payload."""
    return CHUNK_FRAMING_BYTES + len(name.encode("utf-8")) + nbytes


def plan_messages(
    tensors: Sequence[Tuple[str, int]], itemsize: int, max_message_bytes: int
) -> Iterator[List[Tuple[str, int, int]]]:
    """Splits tensors into chunks and packs chunks into messages.

    Args:
      tensors: (name, numel) pairs, in the order they are sent.
      itemsize: bytes per element on the wire.
      max_message_bytes: the bound for one request message (its chunks' serialized size).

    Yields:
      Lists of (name, start, stop) element ranges, one list per request message. Large tensors
      are split across messages; small ones share a message. A tensor with 0 elements gets no
      chunk at all (there is nothing to cover).
    """
    batch: List[Tuple[str, int, int]] = []
    used = 0
    for name, numel in tensors:
        per_chunk = elements_per_chunk(name, itemsize, max_message_bytes)
        start = 0
        while start < numel:
            free = max_message_bytes - used - CHUNK_FRAMING_BYTES - len(name.encode("utf-8"))
            room = free // itemsize
            if batch and (room <= 0 or (room < min(per_chunk, numel - start) and room < 1024)):
                # The rest of this message would hold only a small fragment: start a new one.
                yield batch
                batch, used = [], 0
                continue
            stop = min(numel, start + min(per_chunk, room))
            batch.append((name, start, stop))
            used += chunk_size_bytes(name, (stop - start) * itemsize)
            start = stop
    if batch:
        yield batch


def group_specs(specs: Sequence, max_message_bytes: int) -> Iterator[list]:
    """Splits protobuf specs into batches whose summed serialized size stays under the bound."""
    batch: list = []
    used = 0
    for spec in specs:
        size = spec.ByteSize() + 8
        if batch and used + size > max_message_bytes:
            yield batch
            batch, used = [], 0
        batch.append(spec)
        used += size
    if batch:
        yield batch



# -- raw encoding of request messages ----------------------------------------------------------
# Pushes are serialized here rather than through protobuf objects so that each gradient byte is
# copied once on its way out: from the tensor (a memoryview) into the request's bytes. Building
# TensorChunk objects would copy every payload three times (tobytes, the message's field, the
# serialization). The layout is protobuf's wire format, for any message whose field 2 is
# `repeated TensorChunk chunks` (PushGradientsRequest, RegisterTensorsRequest).

CHUNKS_FIELD = 2  # `repeated TensorChunk chunks = 2` of the request messages.
_WIRETYPE_VARINT = 0
_WIRETYPE_LEN = 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def chunk_framing(name: bytes, offset: int, nbytes: int, field: int = 0) -> Tuple[bytes, bytes]:
    """The bytes of one `chunks` entry (a TensorChunk: tensor = 1, offset = 2, data = 3,
    field = 4) that come before and after its ``nbytes`` of data, in a message whose field 2 is
    the chunks, in protobuf's canonical order. ``field`` (a TensorField, LoadState only) is
    left out when 0."""
    body = _tag(1, _WIRETYPE_LEN) + _varint(len(name)) + name
    if offset:
        body += _tag(2, _WIRETYPE_VARINT) + _varint(offset)
    body += _tag(3, _WIRETYPE_LEN) + _varint(nbytes)
    suffix = _tag(4, _WIRETYPE_VARINT) + _varint(field) if field else b""
    size = len(body) + nbytes + len(suffix)
    return _tag(CHUNKS_FIELD, _WIRETYPE_LEN) + _varint(size) + body, suffix


def encode_messages(plan: Iterable[List[Tuple[str, int, int]]], wire_views,
                    itemsize: int, field: int = 0) -> Iterator[bytes]:
    """Serialized request messages carrying the chunks of ``plan`` (plan_messages' lists of
    (name, start, stop)), the data read from ``wire_views[name]``: the tensor's wire bytes as a
    1-D uint8 numpy array (element ranges are scaled by ``itemsize``). ``field``: as
    chunk_framing. Each message is one bytes object, made by one join: the data's only copy."""
    names: Dict[str, bytes] = {}
    for message in plan:
        parts = []
        for name, start, stop in message:
            encoded = names.get(name)
            if encoded is None:
                encoded = names[name] = name.encode("utf-8")
            prefix, suffix = chunk_framing(encoded, start, (stop - start) * itemsize, field)
            parts.append(prefix)
            parts.append(wire_views[name][start * itemsize:stop * itemsize].data)
            if suffix:
                parts.append(suffix)
        yield b"".join(parts)


class _OneTensorAtATime:
    """wire_views for encode_messages that converts a tensor when its first chunk is read and
    keeps only the latest one: a plan reads each tensor's chunks in a row, so at most one
    tensor's wire copy is alive."""

    def __init__(self, tensors, wire: str):
        self._tensors = tensors
        self._wire = wire
        self._name: Optional[str] = None
        self._view = None

    def __getitem__(self, name: str):
        if name != self._name:
            self._view = None  # Drop the previous tensor's copy before making the next.
            self._view = to_wire_array(self._tensors[name], self._wire).view(np.uint8)
            self._name = name
        return self._view


def chunk_messages(items: Sequence[Tuple[str, "torch.Tensor"]], wire: str, max_message_bytes: int,
                   field: int = 0) -> Iterator[bytes]:
    """Serialized request messages (of any request whose field 2 is its chunks) carrying every
    element of every tensor of ``items`` ((name, tensor) pairs) as ``wire``-dtype chunks, each
    message within ``max_message_bytes``; one tensor converted at a time."""
    itemsize = element_size(wire)
    plan = plan_messages([(name, t.numel()) for name, t in items], itemsize, max_message_bytes)
    yield from encode_messages(plan, _OneTensorAtATime(dict(items), wire), itemsize, field)
