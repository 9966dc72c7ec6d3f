"""PushTransaction: a push written a piece at a time and committed at the end.

Made by fusedps.Client.begin_push. The gradients of a step are sent as a backward pass makes
them (fusedps.torch.RemoteAdamW(overlap=True) writes each bucket as it is ready), and the
step's grad_scale is given at the end, once clipping and loss scaling are decided
(PushHeader.commit_at_end in proto/fusedps/v1/parameter_service.proto). The server stages each
piece as it arrives and applies the push as one atomic step at the commit; a cancelled push
applies nothing.

Two implementations with one interface: over the native transport (the C++ client; each
piece's payload is sent straight from the caller's memory, without a copy) and over grpcio
(each message serialized in Python; slower, for installs without the native library).

Lifetimes: the memory a piece points at must stay alive and unchanged until commit() or
cancel() has returned. Thread safety: one thread at a time per transaction.
"""

from __future__ import annotations

import ctypes
import queue
from typing import Any, List, Optional, Sequence, Tuple

import grpc

from fusedps import _chunks, _dtypes, _native, _transport, errors
from fusedps.results import PushResult
from fusedps.v1 import parameter_service_pb2 as pb

__all__ = ["PushTransaction"]

# (tensor index, first element, element count, address of the raw wire-dtype elements)
Piece = Tuple[int, int, int, int]


class PreparedPieces:
    """Pieces checked once against a push's tensors and laid out for its transport
    (PushTransaction.prepare): written by write_prepared to any push of the same tensors over
    the same transport, without the per-piece Python work of write() (a training step writes the
    same pieces every step)."""

    __slots__ = ("numels", "payload", "bytes")

    def __init__(self, numels: Tuple[int, ...], payload: Any, nbytes: int):
        self.numels = numels  # The element counts of the push's tensors it was checked against.
        self.payload = payload  # The transport's own form (the impl's prepare()).
        self.bytes = nbytes


class PushTransaction:
    """A push begun by Client.begin_push; see the module docstring.

    Use it as a context manager (an exception, or leaving without commit, cancels it), or call
    commit() or cancel() yourself.
    """

    def __init__(self, impl, tensors: Sequence[Tuple[str, int]], itemsize: int):
        self._impl = impl
        self._numels = tuple(int(n) for _, n in tensors)
        self._names = [n for n, _ in tensors]
        self._itemsize = itemsize
        self._ended = False
        self._keep: List[object] = []  # Tensors given to write_tensor, alive until the end.
        self.bytes_written = 0

    @property
    def tensors(self) -> List[str]:
        """The names of the push's tensors, in the order pieces index them."""
        return list(self._names)

    def write(self, pieces: Sequence[Piece]) -> None:
        """Queues pieces for sending and returns without waiting for them.

        Each piece is (tensor index, first element, element count, address): raw little-endian
        elements of the push's grad_dtype in host memory, alive until commit() or cancel()
        returns. Every element of every tensor must be written exactly once before commit().

        Raises:
          ValueError: a tensor index out of range or a piece past its tensor's end.
          RuntimeError: after commit() or cancel().
          FusedPSError: a part of the push has failed already (cancel it).
        """
        if self._ended:
            raise RuntimeError("the push was committed or cancelled")
        self._check(pieces)
        if pieces:
            self._impl.write(pieces)
            self.bytes_written += sum(p[2] for p in pieces) * self._itemsize

    def prepare(self, pieces: Sequence[Piece]) -> PreparedPieces:
        """Checks pieces (as write() does) and lays them out for this push's transport, once:
        write_prepared then queues them on this push or on any later one of the same tensors
        (a training step's buckets are the same every step). Raises ValueError as write()."""
        self._check(pieces)
        return PreparedPieces(self._numels, self._impl.prepare(list(pieces)),
                              sum(p[2] for p in pieces) * self._itemsize)

    def write_prepared(self, prepared: PreparedPieces) -> None:
        """write() of prepared pieces (prepare()), the same lifetimes. Raises ValueError when
        they were prepared for a push of other tensors, RuntimeError after commit() or cancel(),
        FusedPSError when a part of the push has failed."""
        if self._ended:
            raise RuntimeError("the push was committed or cancelled")
        if prepared.numels != self._numels:
            raise ValueError("pieces prepared for a push of other tensors")
        if prepared.bytes:
            self._impl.write_prepared(prepared.payload)
            self.bytes_written += prepared.bytes

    def _check(self, pieces: Sequence[Piece]) -> None:
        for t, offset, count, address in pieces:
            if not 0 <= t < len(self._numels):
                raise ValueError(f"piece of tensor number {t}; the push has {len(self._numels)}")
            if offset < 0 or count < 0 or offset + count > self._numels[t] or (
                    count and not address):
                raise ValueError(f"piece [{offset}, {offset + count}) of tensor "
                                 f"{self._names[t]!r} ({self._numels[t]} elements)")

    def write_tensor(self, index: int, tensor, offset: int = 0) -> None:
        """Queues a contiguous CPU tensor of the wire dtype as elements [offset, offset +
        numel) of tensor number ``index``; the transaction keeps it alive until it ends."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("write_tensor takes a contiguous CPU tensor")
        if tensor.element_size() != self._itemsize:
            raise ValueError(f"write_tensor takes {self._itemsize}-byte elements (the push's "
                             f"grad_dtype), got {tensor.dtype}")
        self._keep.append(tensor)
        self.write([(index, offset, tensor.numel(), tensor.data_ptr())])

    def commit(self, grad_scale: Optional[float] = None,
               then_pull: Optional[_native.CommitPull] = None) -> PushResult:
        """Commits the push: the server divides the gradients by ``grad_scale`` (None: none)
        and applies them as one step. Waits for the reply.

        ``then_pull`` (a push through a workspace only): the commit carries that pull
        (PushCommit.pull): once the step is applied, the server writes each entry's values,
        params in the pull's wire dtype (the server's stored one), at the entry's address in
        the workspace, and only then replies; the reply's pulled_version is the version read
        (0: a duplicate's reply from the retry table, nothing written).

        Raises:
          FusedPSError: as Client.push_gradients (INVALID_ARGUMENT when pieces are missing, or
            a then_pull entry lies outside the workspace); nothing was applied.
          RuntimeError: committed or cancelled already.
        """
        if self._ended:
            raise RuntimeError("the push was committed or cancelled")
        self._ended = True
        try:
            if then_pull is None:
                return self._impl.commit(grad_scale)
            return self._impl.commit(grad_scale, then_pull)
        finally:
            self._keep.clear()

    def cancel(self) -> None:
        """Cancels the push (the server applies nothing) and waits until its memory is no
        longer read. Does nothing once committed or cancelled."""
        if not self._ended:
            self._ended = True
            self._impl.cancel()
            self._keep.clear()

    def close(self) -> None:
        """Cancels unless committed; frees the transport's resources. Idempotent."""
        self.cancel()
        self._impl.close()

    def __enter__(self) -> "PushTransaction":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NativeTransactionImpl:
    """Over _native.NativePush: pieces go out from the caller's memory."""

    def __init__(self, native_push):
        self._push = native_push

    def write(self, pieces: Sequence[Piece]) -> None:
        self.write_prepared(self.prepare(list(pieces)))

    @staticmethod
    def prepare(pieces: List[Piece]):
        return _native.PieceArrays([p[0] for p in pieces], [p[1] for p in pieces],
                                   [p[2] for p in pieces], [p[3] for p in pieces])

    def write_prepared(self, arrays) -> None:
        self._push.write_arrays(arrays)

    def commit(self, grad_scale: Optional[float],
               then_pull: Optional[_native.CommitPull] = None) -> PushResult:
        r = self._push.commit(grad_scale, then_pull)
        return PushResult._from_native(r)

    def cancel(self) -> None:
        self._push.cancel()

    def close(self) -> None:
        self._push.close()


_END = object()  # Ends a part's request stream.


class GrpcioTransactionImpl:
    """Over grpcio: one PushGradients call per channel, each fed its messages from a queue by
    grpcio's own thread. Each message is serialized in Python (one copy of the payload)."""

    def __init__(self, calls: Sequence[Any], header: "pb.PushHeader", names: Sequence[str],
                 itemsize: int, max_message_bytes: int, timeout: Optional[float]):
        self._names = [n.encode("utf-8") for n in names]
        self._itemsize = itemsize
        self._max_message_bytes = max_message_bytes
        self._queues: List[queue.Queue] = []
        self._futures: List[Any] = []  # grpc futures, one per call.
        self._next = 0
        parts = len(calls)
        for p, call in enumerate(calls):
            first = pb.PushGradientsRequest(header=header)
            if parts > 1:
                first.header.part_index = p
                first.header.part_count = parts
            q: queue.Queue = queue.Queue()
            q.put(first.SerializeToString())
            self._queues.append(q)
            self._futures.append(call.future(self._requests(q), timeout=timeout))

    @staticmethod
    def _requests(q: queue.Queue):
        while True:
            item = q.get()
            if item is _END:
                return
            yield item

    @staticmethod
    def prepare(pieces: List[Piece]) -> List[Piece]:
        return pieces

    def write_prepared(self, pieces: List[Piece]) -> None:
        self.write(pieces)

    def _send(self, message: bytes) -> None:
        self._queues[self._next].put(message)
        self._next = (self._next + 1) % len(self._queues)

    def write(self, pieces: Sequence[Piece]) -> None:
        budget = self._max_message_bytes - 64 - 256  # Framing and the longest name.
        per_chunk = max(1, budget // self._itemsize)
        parts: List[bytes] = []
        size = 0
        for t, offset, count, address in pieces:
            done = 0
            while done < count:
                n = min(count - done, per_chunk)
                nbytes = n * self._itemsize
                if parts and size + nbytes > budget:
                    self._send(b"".join(parts))
                    parts, size = [], 0
                prefix, _ = _chunks.chunk_framing(self._names[t], offset + done, nbytes)
                parts.append(prefix)
                parts.append(ctypes.string_at(address + done * self._itemsize, nbytes))
                size += nbytes + len(prefix)
                done += n
        if parts:
            self._send(b"".join(parts))

    def _pull_request(self, then_pull: _native.CommitPull) -> "pb.PullParametersRequest":
        raise errors.InvalidArgument(
            "a commit's pull writes into the push's workspace; this push was begun without one")

    def commit(self, grad_scale: Optional[float],
               then_pull: Optional[_native.CommitPull] = None) -> PushResult:
        commit = pb.PushGradientsRequest(commit=pb.PushCommit())
        if grad_scale is not None:
            commit.commit.grad_scale = grad_scale
        if then_pull is not None:
            try:
                commit.commit.pull.CopyFrom(self._pull_request(then_pull))
            except BaseException:
                self.cancel()
                raise
        self._queues[0].put(commit.SerializeToString())
        for q in self._queues:
            q.put(_END)
        outcomes: List[object] = []
        for f in self._futures:
            try:
                outcomes.append(f.result())
            except grpc.RpcError as e:
                outcomes.append(errors.from_rpc_error(e))
        failures = [o for o in outcomes if isinstance(o, errors.FusedPSError)]
        for failure in failures:  # The root cause: the others are ABORTED.
            if not isinstance(failure, errors.Aborted):
                raise failure
        if failures:
            raise failures[0]
        r = outcomes[0]
        return PushResult._from_pb(r)

    def cancel(self) -> None:
        for f in self._futures:
            f.cancel()
        for q in self._queues:
            q.put(_END)
        for f in self._futures:
            try:
                f.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                pass

    def close(self) -> None:
        pass


class WorkspaceTransactionImpl(GrpcioTransactionImpl):
    """Over a same-host workspace (fusedps._workspace): a piece inside the workspace travels as
    its place in it (TensorChunk.workspace_offset_bytes, workspace_bytes), which the server
    copies out; a piece elsewhere travels as bytes, as over grpcio. Each write is spread over
    the parts in equal shares, so that the server copies it out on several threads at once."""

    def __init__(self, workspace, *args):
        super().__init__(*args)
        self._workspace = workspace

    def _pull_request(self, then_pull: _native.CommitPull) -> "pb.PullParametersRequest":
        itemsize = _dtypes.element_size(_dtypes.WIRE_NAMES[then_pull.dtype])
        request = pb.PullParametersRequest(dtype=then_pull.dtype,
                                           field=_dtypes.TENSOR_FIELDS["param"])
        for name, address, numel in then_pull.entries:
            at = self._workspace.offset_of(address, numel * itemsize) if numel else None
            if at is None:
                raise errors.InvalidArgument(f"the commit's pull target {name} ({numel} "
                                             "elements) does not lie in the push's workspace")
            request.tensors.append(name)
            request.workspace_offsets_bytes.append(at)
        return request

    def write(self, pieces: Sequence[Piece]) -> None:
        """One message per part, each naming about an equal share of the pieces' bytes (a
        piece split where it must), so that the server copies them out on as many threads."""
        inline = []
        refs = []  # (tensor, first element, count, workspace offset)
        total = 0
        for t, offset, count, address in pieces:
            nbytes = count * self._itemsize
            at = self._workspace.offset_of(address, nbytes) if count else None
            if at is None:
                inline.append((t, offset, count, address))
            else:
                refs.append((t, offset, count, at))
                total += nbytes
        parts = len(self._queues)
        share = max(self._itemsize, -(-total // parts))  # Bytes per message, about.
        messages: List[list] = [[]]
        room = share
        for t, offset, count, at in refs:
            done = 0
            while done < count:
                n = min(count - done, max(1, room // self._itemsize))
                messages[-1].append(pb.TensorChunk(
                    tensor=self._names[t].decode("utf-8"), offset=offset + done,
                    workspace_offset_bytes=at + done * self._itemsize,
                    workspace_bytes=n * self._itemsize))
                done += n
                room -= n * self._itemsize
                if room <= 0:
                    messages.append([])
                    room = share
        # A message of references is small: about 300 bytes per chunk at most.
        per_message = max(1, (self._max_message_bytes - 1024) // 320)
        for chunks in messages:
            for k in range(0, len(chunks), per_message):
                self._send(pb.PushGradientsRequest(
                    chunks=chunks[k:k + per_message]).SerializeToString())
        if inline:
            super().write(inline)


def begin(client, tensors: Sequence[Tuple[str, int]], grad_dtype: str, base_version: int,
          plan_hash: str, client_id: str, sequence_number: int,
          workspace=None, max_parts: int = 0) -> PushTransaction:
    """Client.begin_push: a transaction over the client's native transport when it has one (its
    C++ side sends pieces inside the client's workspace, if one is open, as places), else
    through ``workspace`` when given (fusedps._workspace; client.streams parts over the
    client's first channel), else over its grpcio channels (one part per channel); in each case
    at most ``max_parts`` parts when it is not 0."""
    itemsize = _dtypes.element_size(grad_dtype)
    names = [n for n, _ in tensors]
    if client._native is not None:
        native = client._native.begin_push(
            client_id=client_id, sequence_number=sequence_number,
            grad_dtype=_dtypes.WIRE_CODES[grad_dtype], base_version=base_version,
            plan_hash=plan_hash, names=names, numels=[int(n) for _, n in tensors],
            max_parts=max_parts)
        return PushTransaction(NativeTransactionImpl(native), tensors, itemsize)
    header = pb.PushHeader(client_id=client_id, sequence_number=sequence_number,
                           grad_dtype=_dtypes.WIRE_CODES[grad_dtype],
                           base_version=base_version, tensors=names, plan_hash=plan_hash,
                           commit_at_end=True, model=client.model,
                           workspace="" if workspace is None else workspace.id)
    args = (header, names, itemsize, client.max_chunk_bytes, client.timeout)
    if workspace is None:
        calls = client._pusher._calls
        return PushTransaction(GrpcioTransactionImpl(calls[:max_parts or len(calls)], *args),
                               tensors, itemsize)
    # Messages of places are small: client.streams parts over the first channel.
    call = _transport.raw_stream_unary(client._channel, "PushGradients",
                                       pb.PushGradientsResponse)
    parts = min(client.streams, max_parts or client.streams)
    return PushTransaction(WorkspaceTransactionImpl(workspace, [call] * parts, *args),
                           tensors, itemsize)

