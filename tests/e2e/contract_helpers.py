"""Raw wire-API helpers for the contract tests: build and send PushGradients, RegisterTensors
and PullParameters streams by hand, so that the tests say exactly what goes over the wire and
run against any fusedps-server binary ($FUSEDPS_SERVER), old or new."""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from fusedps.v1 import parameter_service_pb2 as pb
from fusedps.v1 import parameter_service_pb2_grpc as pb_grpc

CHUNK = 1 << 20  # Payload bytes per message.
MAX_MESSAGE = 64 << 20


@contextlib.contextmanager
def stub(target: str) -> Iterator[pb_grpc.ParameterServiceStub]:
    channel = grpc.insecure_channel(target, options=[
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_receive_message_length", MAX_MESSAGE)])
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
        yield pb_grpc.ParameterServiceStub(channel)
    finally:
        channel.close()


def chunks_of(name: str, values: np.ndarray, chunk_bytes: int = CHUNK) -> List[pb.TensorChunk]:
    data = np.ascontiguousarray(values).tobytes()
    size = values.dtype.itemsize
    step = max(size, chunk_bytes // size * size)
    return [pb.TensorChunk(tensor=name, offset=at // size, data=data[at:at + step])
            for at in range(0, len(data), step)] or [pb.TensorChunk(tensor=name)]


def register(s, tensors: Dict[str, np.ndarray], timeout: float = 60) -> pb.RegisterTensorsResponse:
    """Registers fp32 tensors (flat shapes) with their values."""
    def messages():
        yield pb.RegisterTensorsRequest(header=pb.RegisterTensorsHeader(tensors=[
            pb.TensorSpec(name=n, shape=list(v.shape)) for n, v in tensors.items()]))
        for n, v in tensors.items():
            for c in chunks_of(n, v.astype(np.float32)):
                yield pb.RegisterTensorsRequest(chunks=[c])
    return s.RegisterTensors(messages(), timeout=timeout)


def push_messages(grads: Dict[str, np.ndarray], *, client_id: str = "", sequence_number: int = 0,
                  grad_scale: Optional[float] = None, part: Tuple[int, int] = (0, 1),
                  names: Optional[Sequence[str]] = None, with_chunks: bool = True,
                  chunk_bytes: int = CHUNK) -> List[pb.PushGradientsRequest]:
    header = pb.PushHeader(client_id=client_id, sequence_number=sequence_number,
                           grad_dtype=pb.DTYPE_FLOAT32,
                           tensors=list(names if names is not None else grads),
                           part_index=part[0], part_count=part[1])
    if grad_scale is not None:
        header.grad_scale = grad_scale
    messages = [pb.PushGradientsRequest(header=header)]
    if with_chunks:
        for n, g in grads.items():
            for c in chunks_of(n, g.astype(np.float32), chunk_bytes):
                messages.append(pb.PushGradientsRequest(chunks=[c]))
    return messages


def push(s, grads: Dict[str, np.ndarray], timeout: float = 60, **kwargs
         ) -> pb.PushGradientsResponse:
    return s.PushGradients(iter(push_messages(grads, **kwargs)), timeout=timeout)


def pull(s, names: Iterable[str] = (), dtype=pb.DTYPE_FLOAT32, timeout: float = 60
         ) -> Tuple[pb.PullHeader, List[pb.TensorInfo], Dict[str, np.ndarray]]:
    """Pulls and reassembles, accepting tensor infos continued after the header."""
    infos: List[pb.TensorInfo] = []
    header = None
    parts: Dict[str, Dict[int, bytes]] = {}
    for message in s.PullParameters(pb.PullParametersRequest(tensors=list(names), dtype=dtype),
                                    timeout=timeout):
        if message.HasField("header"):
            header = message.header
            infos.extend(header.tensors)
        infos.extend(message.tensors)
        for c in message.chunks:
            parts.setdefault(c.tensor, {})[c.offset] = c.data
    np_dtype = np.float32 if dtype == pb.DTYPE_FLOAT32 else np.uint16
    out = {}
    for info in infos:
        data = b"".join(d for _, d in sorted(parts.get(info.name, {}).items()))
        out[info.name] = np.frombuffer(data, dtype=np_dtype)
    return header, infos, out


class SlowPull:
    """A pull whose client reads one message and then stops reading until released, as a slow
    or stalled reader does. Holds whatever the server holds for an unread pull."""

    def __init__(self, s, names: Sequence[str]):
        self._responses = s.PullParameters(pb.PullParametersRequest(tensors=list(names)),
                                           timeout=120)
        self._first = next(self._responses)
        self.messages = 1

    def drain(self) -> None:
        for _ in self._responses:
            self.messages += 1

    def cancel(self) -> None:
        self._responses.cancel()


def in_thread(fn, *args, **kwargs):
    """Runs fn in a thread; returns a function that joins it and returns its result or raises
    its exception."""
    result: Dict[str, object] = {}

    def run():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the joiner.
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join(timeout: Optional[float] = None):
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError("still running")
        if "error" in result:
            raise result["error"]  # type: ignore[misc]
        return result.get("value")
    return join
