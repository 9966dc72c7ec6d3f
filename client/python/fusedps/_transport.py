"""Pushes and pulls over grpcio: a push serialized with one copy per byte, sent as parts over
channels; a pull decoded into its destinations.

Internal module; fusedps.client.Client uses it when the native transport (fusedps._native) is
not in use. A push of M request messages with ``streams`` channels travels as
min(streams, M) concurrent PushGradients calls (PushHeader.part_index / part_count), messages
p, p + parts, ... going to part p, as the C++ client does (client/client.cc); the server
applies the push once, when every part has arrived.

Lifetimes: GrpcioPusher owns its thread pool (one thread per channel beyond the first) until
close(); the channels belong to the Client.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, List, Mapping, Optional, Sequence, Tuple, cast

import grpc

from fusedps import _chunks, _deadlines, _dtypes, _replies, errors
from fusedps.results import PulledTensors
from fusedps.v1 import parameter_service_pb2 as pb

if TYPE_CHECKING:
    import torch

# The largest max_chunk_bytes a PullParametersRequest may ask for (proto: at most 4 MiB).
_MAX_PULL_CHUNK_BYTES = 4 << 20


def raw_stream_unary(channel: grpc.Channel, method: str, response_class):
    """A client-streaming ParameterService method (e.g. "PushGradients") whose requests are
    given already serialized (bytes), as _chunks.encode_messages makes them."""
    return channel.stream_unary(f"/fusedps.v1.ParameterService/{method}",
                                request_serializer=None,
                                response_deserializer=response_class.FromString)


class GrpcioPusher:
    """Sends pushes over ``channels`` (one call per channel and part)."""

    def __init__(self, channels: Sequence[grpc.Channel]):
        self._calls = [raw_stream_unary(channel, "PushGradients", pb.PushGradientsResponse)
                       for channel in channels]
        self._pool: Optional[ThreadPoolExecutor] = None
        if len(channels) > 1:
            self._pool = ThreadPoolExecutor(max_workers=len(channels) - 1,
                                            thread_name_prefix="fusedps-push")

    @property
    def streams(self) -> int:
        return len(self._calls)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def push(self, header: "pb.PushHeader", items: Sequence[Tuple[str, "torch.Tensor"]], wire: str,
             max_message_bytes: int, timeout: Callable[[int], Optional[float]],
             name_push: Callable[["pb.PushHeader"], None]) -> "pb.PushGradientsResponse":
        """Sends one push of ``items`` ((name, tensor) pairs) in ``wire`` dtype.

        ``header`` names the tensors; when the push goes as several parts, ``name_push`` is
        called first to give it a client_id and sequence_number (parts need them) and part_count
        is set. ``timeout(payload_bytes)`` gives each part's deadline from its own share.

        Raises:
          FusedPSError: the root cause when a part fails (the other parts then fail ABORTED).
        """
        itemsize = _dtypes.element_size(wire)
        np = _chunks.np
        views = {name: _chunks.to_wire_array(t, wire).view(np.uint8) for name, t in items}
        plan = list(_chunks.plan_messages([(n, t.numel()) for n, t in items], itemsize,
                                          max_message_bytes))
        parts = min(len(self._calls), max(len(plan), 1))
        if parts > 1:
            name_push(header)
            header.part_count = parts

        def send(p: int) -> "pb.PushGradientsResponse":
            share = plan[p::parts]
            first = pb.PushGradientsRequest(header=header)
            if parts > 1:
                first.header.part_index = p
            payload = sum(stop - start for m in share for _, start, stop in m) * itemsize

            def requests():
                yield first.SerializeToString()
                yield from _chunks.encode_messages(share, views, itemsize)

            return self._calls[p](requests(), timeout=timeout(payload))

        if parts == 1:
            return send(0)
        pool = cast(ThreadPoolExecutor, self._pool)  # Made with the channels beyond the first.
        futures = [pool.submit(send, p) for p in range(1, parts)]
        outcomes: List[object] = []
        for run in [lambda: send(0)] + [f.result for f in futures]:
            try:
                outcomes.append(run())
            except grpc.RpcError as e:
                outcomes.append(errors.from_rpc_error(e))
        # The root cause of a failed push: the parts that did not fail themselves are ABORTED.
        failures = [o for o in outcomes if isinstance(o, errors.FusedPSError)]
        for failure in failures:
            if not isinstance(failure, errors.Aborted):
                raise failure
        if failures:
            raise failures[0]
        return outcomes[0]


def pull(stub, names: Sequence[str], wire: str, field: int,
         destinations: Mapping[str, _replies.Destination],
         *, max_chunk_bytes: int, timeout: Optional[float],
         min_bytes_per_second: float, model: str = "") -> PulledTensors:
    """One PullParameters call of ``names`` (one field, ``wire`` dtype). Tensors named in
    ``destinations`` (name -> (1-D wire-dtype numpy view of the caller's tensor, its shape))
    are decoded straight into them; the others into new CPU tensors. The call's deadline grows
    as the reply announces its tensors (_deadlines.GrowingDeadline).

    Raises:
      FusedPSError (DeadlineExceeded past the deadline), RuntimeError for a malformed reply,
      ValueError for a destination whose shape differs from the server's (the call is then
      cancelled).
    """
    request = pb.PullParametersRequest(
        tensors=names, dtype=_dtypes.WIRE_CODES[wire], field=field, model=model,
        max_chunk_bytes=min(max_chunk_bytes, _MAX_PULL_CHUNK_BYTES))
    assembler = _replies.PullAssembler(wire, destinations)
    call = stub.PullParameters(request)
    with _deadlines.GrowingDeadline(call, timeout, min_bytes_per_second) as deadline:
        try:
            for response in call:
                assembler.add(response)
                deadline.set_payload(assembler.announced_bytes)
        except grpc.RpcError:
            if deadline.expired:
                raise deadline.error() from None
            raise
        except (RuntimeError, ValueError):
            call.cancel()
            raise
    reply = assembler.finish(names)
    return PulledTensors(reply.tensors.items(), version=reply.version,
                         steps={i.name: int(i.step) for i in reply.infos}, dtype=wire)
