"""Replies that span several messages: a pull's stream and ListTensors' pages.

Internal module: the public API is in fusedps.client. Nothing here talks to the network; the
functions take the messages (or a function that fetches a page), so that they can be tested
with messages built by hand.

Wire rules (proto/fusedps/v1/parameter_service.proto):
  * a pull's stream is the header first, then the TensorInfo that did not fit in it (in the
    ``tensors`` of the next messages, in order), then chunks; a tensor's TensorInfo always
    arrives before its first chunk. header.tensor_count is how many tensors the pull returns
    in all; 0 (servers that predate it) means the header holds them all;
  * ListTensors returns tensors a page at a time; next_page_token is empty on the last page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from fusedps import _chunks, _dtypes
from fusedps.v1 import parameter_service_pb2 as pb

if TYPE_CHECKING:
    import torch

# Where a pulled tensor's elements go: (1-D numpy array of the wire dtype, the local shape, or
# None for any shape of the array's element count). See PullAssembler.
Destination = Tuple[Any, Optional[Tuple[int, ...]]]


def _malformed(what: str) -> RuntimeError:
    return RuntimeError(f"malformed pull reply: {what}")


@dataclass
class PullReply:
    """A whole pull: the version it read, its TensorInfo in the server's order, and
    name -> CPU tensor of the wire dtype, shaped as registered."""

    version: int
    infos: List["pb.TensorInfo"]
    tensors: Dict[str, "torch.Tensor"]


class PullAssembler:
    """Collects a pull's PullParametersResponse messages, in order, and checks them.

    Usage::

        assembler = PullAssembler("float32")
        for response in call:
            assembler.add(response)
        reply = assembler.finish(requested_names)

    Every failed check raises RuntimeError("malformed pull reply: ...").
    """

    def __init__(self, wire: str, destinations: Optional[Mapping[str, Destination]] = None):
        """``destinations``: name -> (1-D numpy array of the wire dtype, the local shape): that
        tensor's elements are decoded straight into the array (a view of the caller's tensor),
        once its TensorInfo has the same shape (None: any shape of the array's element count,
        as Client.pull_into writes raw elements); another raises ValueError."""
        self._wire = wire
        self._destinations = destinations or {}
        self._version: Optional[int] = None
        self._tensor_count = 0
        self._infos: List[pb.TensorInfo] = []
        self._arrays: Dict[str, Any] = {}  # name -> 1-D numpy array of the wire dtype.
        self._received: Dict[str, int] = {}
        self.announced_bytes = 0
        """Bytes of tensor data the reply has announced so far (what a pull's deadline grows
        with)."""

    def add(self, response: "pb.PullParametersResponse") -> None:
        """Takes one message: its header, then its tensors, then its chunks."""
        if response.HasField("header"):
            self._add_header(response.header)
        if self._version is None and (len(response.tensors) or len(response.chunks)):
            raise _malformed("data before its header")
        if len(response.tensors) and self._tensor_count == 0:
            raise _malformed("TensorInfo past the header, whose tensor_count of 0 says it "
                             "holds them all")
        for info in response.tensors:
            self._add_info(info)
        for chunk in response.chunks:
            self._add_chunk(chunk)

    def finish(self, requested: Sequence[str] = ()) -> PullReply:
        """Checks that the reply is complete and holds every name of ``requested``."""
        if self._version is None:
            raise _malformed("no header")
        if self._tensor_count and len(self._infos) != self._tensor_count:
            raise _malformed(f"{len(self._infos)} TensorInfo, not its tensor_count of "
                             f"{self._tensor_count}")
        for info in self._infos:
            numel = self._arrays[info.name].shape[0]
            if self._received[info.name] != numel:
                raise _malformed(f"{self._received[info.name]} elements of {info.name!r}, "
                                 f"not {numel}")
        missing = [name for name in requested if name not in self._arrays]
        if missing:
            raise _malformed(f"requested tensors {missing[:5]} are missing")
        tensors = {
            info.name: _chunks.from_wire_array(self._arrays[info.name], self._wire,
                                               tuple(info.shape))
            for info in self._infos
        }
        return PullReply(self._version, list(self._infos), tensors)

    def _add_header(self, header: "pb.PullHeader") -> None:
        if self._version is not None:
            raise _malformed("a second header")
        if header.dtype not in (pb.DTYPE_UNSPECIFIED, _dtypes.WIRE_CODES[self._wire]):
            raise _malformed(f"asked for {self._wire}, the server sent dtype {header.dtype}")
        self._version = int(header.version)
        self._tensor_count = int(header.tensor_count)
        for info in header.tensors:
            self._add_info(info)

    def _add_info(self, info: "pb.TensorInfo") -> None:
        if self._tensor_count and len(self._infos) == self._tensor_count:
            raise _malformed(f"more TensorInfo than its tensor_count of {self._tensor_count}")
        if any(d < 0 for d in info.shape):
            raise _malformed(f"tensor {info.name!r} has a negative dim in {list(info.shape)}")
        # numel is redundant with the shape; a server may leave it 0.
        numel = math.prod(info.shape)
        if info.numel not in (0, numel):
            raise _malformed(f"tensor {info.name!r} has numel {info.numel} that does not "
                             f"match its shape")
        if info.name in self._arrays:
            raise _malformed(f"tensor {info.name!r} is described twice")
        destination = self._destinations.get(info.name)
        if destination is not None and destination[1] is None:
            if len(destination[0]) != numel:
                raise ValueError(f"{info.name}: the server has {numel} elements; its target "
                                 f"has {len(destination[0])}")
        elif destination is not None and tuple(info.shape) != destination[1]:
            raise ValueError(f"{info.name}: server shape {tuple(info.shape)} != local shape "
                             f"{destination[1]}")
        self._infos.append(info)
        self._arrays[info.name] = (destination[0] if destination is not None
                                   else _chunks.empty_wire_array(numel, self._wire))
        self._received[info.name] = 0
        self.announced_bytes += numel * _dtypes.element_size(self._wire)

    def _add_chunk(self, chunk: "pb.TensorChunk") -> None:
        array = self._arrays.get(chunk.tensor)
        if array is None:
            raise _malformed(f"a chunk of {chunk.tensor!r} before its TensorInfo")
        try:
            self._received[chunk.tensor] += _chunks.decode_into(array, int(chunk.offset),
                                                               chunk.data)
        except ValueError as e:
            raise _malformed(f"tensor {chunk.tensor!r}: {e}") from None


def list_pages(fetch_page: Callable[["pb.ListTensorsRequest"], "pb.ListTensorsResponse"],
               page_size: int = 0, model: str = "") -> Tuple[int, List["pb.TensorInfo"]]:
    """Every tensor of a ListTensors listing, page after page.

    Args:
      fetch_page: makes one ListTensors call (each with a deadline of its own).
      page_size: tensors per page to ask for; 0: as many as fit in one reply.
      model: the model listed ("": "default").

    Returns:
      (the version of the first page, every TensorInfo in the server's order).
    Raises:
      RuntimeError: the server repeated a page token (a listing that would never end).
    """
    request = pb.ListTensorsRequest(page_size=page_size, model=model)
    version: Optional[int] = None
    infos: List[pb.TensorInfo] = []
    while True:
        response = fetch_page(request)
        if version is None:
            version = int(response.version)
        infos.extend(response.tensors)
        if not response.next_page_token:
            return version, infos
        if response.next_page_token == request.page_token:
            raise RuntimeError(f"ListTensors reply repeats its page token after "
                               f"{len(infos)} tensors")
        request = pb.ListTensorsRequest(page_size=page_size, model=model,
                                        page_token=response.next_page_token)
