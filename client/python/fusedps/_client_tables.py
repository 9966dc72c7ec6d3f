"""fusedps.Client's embedding tables (docs/api.md, "Embedding tables"): register_table,
register_hashed_table, push_rows and lookup_rows. Internal module: Client (fusedps/client.py) inherits them; their
docstrings are Client's documentation.

A dense-id embedding table is a registered tensor of shape [rows, dim] (TensorSpec.table in
proto/fusedps/v1/parameter_service.proto) whose rows are pushed by key
(PushGradientsRequest.table_rows) and read by key (LookupRows). A key is a row index in
[0, rows). A hashed table's keys are any int64s; its rows are made on first use from a seeded
initializer, and evicted least recently updated first. A push steps a table with
torch.optim.SparseAdam's math on the rows it names only.

Both calls that move rows go over grpcio (the native transport does not carry table rows): a
push as one PushGradients call, its TableRows serialized here with one copy of each byte (as
fusedps._chunks serializes TensorChunks); a lookup as one LookupRows call.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import grpc

from fusedps import _chunks, _deadlines, _dtypes, _transport, errors
from fusedps._lazy import LazyModule
from fusedps._requests import _check_sendable, _named_tensors
from fusedps.results import PushResult, RegisterResult
from fusedps.v1 import parameter_service_pb2 as pb

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = LazyModule("numpy")
    torch = LazyModule("torch")

__all__ = ["LookedUpRows", "TableCalls"]

# The wire dtypes of table gradients (push_rows' grad_dtype) and of looked-up rows.
ROW_GRAD_DTYPES = ("float32", "bfloat16")
LOOKUP_DTYPES = ("float32", "bfloat16")
# The fields LookupRows reads.
LOOKUP_FIELDS = ("param", "exp_avg", "exp_avg_sq")

_KEY_BYTES = 8  # A key on the wire: a little-endian int64.
# `repeated TableRows table_rows = 4` of PushGradientsRequest; TableRows' table = 1, keys = 2,
# grads = 3.
_TABLE_ROWS_FIELD = 4
# The largest max_chunk_bytes a LookupRowsRequest may ask for (proto: 16 bytes to 4 MiB).
_MAX_LOOKUP_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class LookedUpRows:
    """Rows of an embedding table read by Client.lookup_rows.

    Attributes:
      rows: a CPU tensor of shape [n, dim], torch.float32 or torch.bfloat16 (the lookup's
        dtype): row i is keys[i]'s, in the order the keys were given (repeats included).
      version: the shard version every row was read at.
      step: the table's step count at that version (the pushes that named the table).
    """

    rows: "torch.Tensor"
    version: int
    step: int


def _keys_tensor(keys, what: str) -> "torch.Tensor":
    """``keys`` (a 1-D integer tensor on any device, a 1-D integer numpy array, or a sequence
    of ints) as a contiguous 1-D torch.int64 CPU tensor.

    Raises:
      TypeError: a tensor of a floating, complex or bool dtype, or a sequence of non-ints.
      ValueError: a tensor that is not 1-D.
    """
    if isinstance(keys, np.ndarray):
        keys = torch.from_numpy(np.ascontiguousarray(keys))
    if isinstance(keys, torch.Tensor):
        if keys.is_floating_point() or keys.is_complex() or keys.dtype == torch.bool:
            raise TypeError(f"{what}: keys must be an integer tensor, got {keys.dtype}")
        if keys.dim() != 1:
            raise ValueError(f"{what}: keys must be 1-D, got shape {tuple(keys.shape)}")
        return keys.detach().to(device="cpu", dtype=torch.int64).contiguous()
    values = []
    for k in keys:
        # ints, and numpy's and torch's integer scalars (operator.index takes them), not bools.
        try:
            if isinstance(k, bool):
                raise TypeError
            values.append(operator.index(k))
        except TypeError:
            raise TypeError(f"{what}: keys must be ints, got {k!r:.40}") from None
    return torch.tensor(values, dtype=torch.int64).reshape(-1)


def _key_bytes(keys: "torch.Tensor"):
    """The little-endian int64 bytes of a contiguous 1-D int64 CPU tensor, as a uint8 numpy
    array (a view of the tensor where the machine is little-endian)."""
    return keys.numpy().astype("<i8", copy=False).view(np.uint8)


def _table_gradient(name: str, value) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """(keys, grads) of one entry of push_rows' ``rows``: a (keys, grads) pair or a sparse COO
    gradient (torch.nn.Embedding(sparse=True)'s: keys its indices, grads its values, not
    coalesced). keys: 1-D int64 CPU tensor; grads: [n, dim] dense floating tensor.

    Raises:
      TypeError / ValueError: anything else (see push_rows).
    """
    if isinstance(value, torch.Tensor):
        if value.layout != torch.sparse_coo:
            raise TypeError(f"{name}: a table's gradient is a (keys, grads) pair or a sparse "
                            f"COO tensor, got a tensor of layout {value.layout}")
        if value.sparse_dim() != 1 or value.dense_dim() != 1:
            raise ValueError(f"{name}: a sparse gradient must have 1 sparse and 1 dense "
                             f"dimension (as nn.Embedding(sparse=True) makes), got "
                             f"{value.sparse_dim()} and {value.dense_dim()}")
        # _indices() / _values(): an uncoalesced tensor's own entries (indices() would ask for
        # coalesce()); the server sums duplicate keys.
        keys, grads = value._indices()[0], value._values()
    else:
        try:
            keys, grads = value
        except (TypeError, ValueError):
            raise TypeError(f"{name}: a table's gradient is a (keys, grads) pair or a sparse "
                            f"COO tensor, got {type(value).__name__}") from None
        if not isinstance(grads, torch.Tensor):
            raise TypeError(f"{name}: grads must be a torch.Tensor, got {type(grads).__name__}")
    keys = _keys_tensor(keys, name)
    _check_sendable(name, grads)
    n = keys.shape[0]
    if grads.dim() != 2 or grads.shape[0] != n:
        if not (n == 0 and grads.numel() == 0):
            raise ValueError(f"{name}: grads must have shape [n, dim] for {n} keys, got "
                             f"{tuple(grads.shape)}")
    if n and grads.shape[1] < 1:
        raise ValueError(f"{name}: grads must have dim >= 1, got shape {tuple(grads.shape)}")
    return keys, grads


def _encode_table_rows(name: bytes, keys, grads) -> List[Any]:
    """The pieces (bytes and memoryviews, to join) of one `table_rows` entry of a
    PushGradientsRequest: TableRows(table=name, keys=keys, grads=grads), keys and grads given
    as uint8 numpy arrays, in protobuf's wire format and canonical field order."""
    tag, varint, wire_len = _chunks._tag, _chunks._varint, _chunks._WIRETYPE_LEN
    head = tag(1, wire_len) + varint(len(name)) + name
    keys_head = tag(2, wire_len) + varint(len(keys))
    grads_head = tag(3, wire_len) + varint(len(grads))
    size = len(head) + len(keys_head) + len(keys) + len(grads_head) + len(grads)
    return [tag(_TABLE_ROWS_FIELD, wire_len) + varint(size) + head, keys_head, keys.data,
            grads_head, grads.data]


def _check_rows_fit(tables: Sequence[Tuple[str, Any, Any, int]], max_message_bytes: int) -> None:
    """ValueError when one row of a table (its key and its gradient) does not fit in a message
    of ``max_message_bytes`` (see _row_messages)."""
    for name, _, _, row_bytes in tables:
        if _row_framing(name) + _KEY_BYTES + row_bytes > max_message_bytes:
            raise ValueError(f"{name}: one row ({_KEY_BYTES + row_bytes} bytes with its key) "
                             f"does not fit in a message of max_chunk_bytes={max_message_bytes}")


def _row_framing(name: str) -> int:
    """Bytes reserved for the framing of one TableRows of table ``name``: its tags and length
    varints (as a TensorChunk's, _chunks.CHUNK_FRAMING_BYTES covers them) and the name."""
    return _chunks.CHUNK_FRAMING_BYTES + len(name.encode("utf-8"))


def _row_messages(tables: Sequence[Tuple[str, Any, Any, int]],
                  max_message_bytes: int) -> Iterator[bytes]:
    """Serialized PushGradientsRequest messages carrying every row of ``tables`` ((name, key
    bytes, grad bytes, bytes per gradient row) with the bytes as uint8 numpy arrays), each
    message at or under ``max_message_bytes``: a table's rows are split over several TableRows
    where they do not fit in one, and the TableRows of small tables share a message.

    Each row must fit in a message (_check_rows_fit).
    """
    parts: List[Any] = []
    used = 0
    for name, keys, grads, row_bytes in tables:
        encoded = name.encode("utf-8")
        framing = _row_framing(name)
        per_row = _KEY_BYTES + row_bytes
        n = len(keys) // _KEY_BYTES
        start = 0
        while start < n:
            room = (max_message_bytes - used - framing) // per_row
            if parts and (room <= 0 or (room < n - start and room * per_row < 1024)):
                # The rest of this message would hold a small fragment only: start a new one.
                yield b"".join(parts)
                parts, used = [], 0
                continue
            stop = min(n, start + room)
            parts += _encode_table_rows(
                encoded, keys[start * _KEY_BYTES:stop * _KEY_BYTES],
                grads[start * row_bytes:stop * row_bytes])
            used += framing + (stop - start) * per_row
            start = stop
    if parts:
        yield b"".join(parts)


@errors.translate_public_methods
class TableCalls:
    """Client's embedding table calls: register_table, register_hashed_table, push_rows,
    lookup_rows."""

    if TYPE_CHECKING:  # Client's, set by its __init__ or defined there.
        model: str
        client_id: str
        max_chunk_bytes: int
        timeout: Optional[float]
        min_bytes_per_second: float
        last_pulled_version: int
        _stub: Any
        _channel: Any
        _register_tensors: Any

        def _timeout(self, payload_bytes: int = 0) -> Optional[float]: ...

        def _observe_version(self, version: int) -> None: ...

    def register_table(self, name: str, init: "torch.Tensor", *, param_group: str = "default",
                       prefix: str = "", plan_hash: str = "") -> RegisterResult:
        """Registers a dense-id embedding table (docs/api.md, "Embedding tables"): a tensor of
        shape [rows, dim] whose rows are pushed by key (push_rows) and read by key
        (lookup_rows); a key is a row index in [0, rows).

        Args:
          name: the table's name (with ``prefix`` prepended), 1..256 bytes, unique in the
            shard like any tensor's.
          init: the initial values, a 2-D floating tensor [rows, dim] with dim >= 1, any dtype
            and device (e.g. an nn.Embedding's weight); sent as float32, as register_model
            sends its tensors (the server keeps the fp32 master copy).
          param_group: a registered group (register_param_group). Its lr, betas, eps and
            weight_decay apply; it must store fp32 params (params_dtype "fp32"), without
            amsgrad, with decoupled weight decay (the default). Any state_dtype: "fp32",
            "bf16" (bf16 moments, rounded to nearest even after each update) or "int8" (each
            moment as 8-bit codes with one fp32 scale per row, so that a push re-quantizes
            its own rows only: a pushed row's moments are dequantized with its scales,
            updated in fp32, and quantized against the row's new scales (max |exp_avg|,
            max exp_avg_sq of the row); a table under 4096 elements keeps fp32 state, as
            TensorInfo.state_dtype says). Pulls and lookups of the moments return them as
            fp32 (bf16 widened, int8 dequantized with the row's scale).
          prefix: prepended to ``name``.
          plan_hash: the shard's sharding plan (docs/sharding.md); ShardedClient sets it.

        The table is a tensor to every other call: list_tensors lists it, pull_parameters and
        pull_state read it whole, load_state and checkpoints keep it. It is never stepped by
        push_gradients (a push that names it there is INVALID_ARGUMENT; one that names no
        tensor leaves it out). Registering the same table (name, shape and group) again is a
        no-op that keeps the server's values.

        Returns:
          RegisterResult (created / existing counts, version).
        Raises:
          ValueError: ``init`` not 2-D, or dim < 1. TypeError: ``init`` not a dense floating
            tensor.
          fusedps.errors.NotFound: an unknown param group.
          fusedps.errors.InvalidArgument: a group a table cannot have (bf16 params,
            amsgrad, L2 weight decay; the message names param_group), a bad name.
          fusedps.errors.AlreadyExists: the name is registered with another shape or group, or
            as a tensor that is not a table.
        """
        full = prefix + name
        if not isinstance(init, torch.Tensor):
            raise TypeError(f"{full}: init must be a torch.Tensor, got {type(init).__name__}")
        _check_sendable(full, init)
        if init.dim() != 2:
            raise ValueError(f"{full}: a table's init must be 2-D [rows, dim], got shape "
                             f"{tuple(init.shape)}")
        if init.shape[1] < 1:
            raise ValueError(f"{full}: a table needs dim >= 1, got shape {tuple(init.shape)}")
        spec = pb.TensorSpec(name=full, shape=list(init.shape), param_group=param_group)
        spec.table.SetInParent()  # An empty TableOptions, present: the tensor is a table.

        def requests():
            yield pb.RegisterTensorsRequest(header=pb.RegisterTensorsHeader(
                tensors=[spec], model=self.model, plan_hash=plan_hash)).SerializeToString()
            yield from _chunks.chunk_messages([(full, init)], "float32", self.max_chunk_bytes)

        resp = self._register_tensors(requests(), timeout=self._timeout(init.numel() * 4))
        return RegisterResult(int(resp.tensors_created), int(resp.tensors_existing),
                              int(resp.version))

    def register_hashed_table(self, name: str, capacity: int, dim: int, *, seed: int = 0,
                              init_std: float = 1.0, param_group: str = "default",
                              prefix: str = "", plan_hash: str = "") -> RegisterResult:
        """Registers a hashed embedding table (docs/api.md, "Embedding tables"): any int64 is a
        key (a feature id), and the table holds the rows of at most ``capacity`` keys.

        A key's row is created the first time an applied push names it: params
        normal(0, init_std) from an initializer that depends only on (seed, key, column)
        (kernels/row_init.h: the same bits on any shard, backend or restart), moments zero.
        When the table is full, a push's new keys evict the least recently updated rows (the
        smallest step at which a row was created or updated; ties to the smaller slot), never a
        row the push itself names; an evicted row's state is gone, and its key starts over from
        the initializer if it comes back. lookup_rows of a key the table does not hold returns
        the initializer's row (zeros for exp_avg and exp_avg_sq) and creates nothing.

        Args:
          name: the table's name (with ``prefix`` prepended), 1..256 bytes.
          capacity: the most rows the table holds, >= 0; the server keeps [capacity, dim] fp32
            params and moments.
          dim: the row width, >= 1.
          seed: the initializer's seed, an unsigned 64-bit int.
          init_std: the initial rows' standard deviation, finite and >= 0 (stored as fp32).
          param_group: as register_table's (fp32 params, any state_dtype (int8: a scale per
            row), no amsgrad, decoupled weight decay).
          prefix: prepended to ``name``.
          plan_hash: the shard's sharding plan (docs/sharding.md); ShardedClient sets it.

        No values are sent. pull_parameters reads the table's slots (a free slot as zeros);
        checkpoints keep its slots with their keys, and restore them bit for bit. load_state
        refuses it. A push with more unique keys than ``capacity`` is InvalidArgument.

        Returns:
          RegisterResult (created / existing counts, version).
        Raises:
          ValueError: capacity < 0, dim < 1, a seed outside [0, 2^64), an init_std that is
            not finite or below 0.
          fusedps.errors.NotFound / InvalidArgument / AlreadyExists: as register_table's (a
            table of this name with another capacity, dim, seed or init_std exists).
        """
        full = prefix + name
        capacity, dim, seed = operator.index(capacity), operator.index(dim), operator.index(seed)
        if capacity < 0 or dim < 1:
            raise ValueError(f"{full}: a hashed table needs capacity >= 0 and dim >= 1, got "
                             f"capacity={capacity}, dim={dim}")
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"{full}: seed={seed} is outside [0, 2^64)")
        init_std = float(init_std)
        if not math.isfinite(init_std) or init_std < 0:
            raise ValueError(f"{full}: init_std={init_std} is not finite and >= 0")
        spec = pb.TensorSpec(name=full, shape=[capacity, dim], param_group=param_group)
        spec.table.hashed = True
        spec.table.seed = seed
        # The server keeps an fp32 std: send that value, so that registering again matches.
        spec.table.init_std = float(np.float32(init_std))

        def requests():
            yield pb.RegisterTensorsRequest(header=pb.RegisterTensorsHeader(
                tensors=[spec], model=self.model, plan_hash=plan_hash)).SerializeToString()

        resp = self._register_tensors(requests(), timeout=self._timeout())
        return RegisterResult(int(resp.tensors_created), int(resp.tensors_existing),
                              int(resp.version))

    def push_rows(self, rows: Mapping[str, Any], *, dense=None, grad_dtype="float32",
                  grad_scale: Optional[float] = None, prefix: str = "",
                  client_id: Optional[str] = None, sequence_number: int = 0,
                  base_version: Optional[int] = None, plan_hash: str = "") -> PushResult:
        """Pushes gradient rows of embedding tables, and optionally dense gradients, as one
        atomic step: all of it or none of it.

        Each table named is stepped with torch.optim.SparseAdam's math on the rows pushed
        only: the gradients of duplicate keys are summed (as SparseAdam's coalesce() sums
        them), the table's one step count advances by one (also for a table given no rows,
        as SparseAdam steps a param whose sparse gradient is empty), and then, for each key k
        pushed, with g its summed gradient row and t the table's step:
          param[k] -= lr * weight_decay * param[k]     (only when the group's weight_decay > 0:
                                                        ours, decoupled as AdamW's;
                                                        SparseAdam has no weight decay)
          exp_avg[k] = beta1 * exp_avg[k] + (1 - beta1) * g
          exp_avg_sq[k] = beta2 * exp_avg_sq[k] + (1 - beta2) * g * g
          param[k] -= lr * sqrt(1 - beta2^t) / (1 - beta1^t)
                      * exp_avg[k] / (sqrt(exp_avg_sq[k]) + eps)
        Rows not pushed keep their params and moments. ``dense`` tensors get the AdamW step of
        push_gradients (their group's hyperparameters) in the same step.

        Args:
          rows: table name (without ``prefix``) -> its gradient, either
            * (keys, grads): keys a 1-D integer tensor (any device) or numpy array, or ints, n
              row indices in [0, rows) (any int64 for a hashed table), repeats allowed;
              grads a dense floating tensor
              [n, dim] (any dtype and device), grads[i] the gradient of row keys[i]; or
            * a sparse COO tensor [rows, dim] with 1 sparse and 1 dense dimension, as
              nn.Embedding(sparse=True) leaves in weight.grad: its entries are sent as they
              are, uncoalesced (the server sums the duplicates).
          dense: optional gradients of dense tensors stepped in the same push, as
            push_gradients takes them: a mapping name -> gradient (an nn.Parameter stands for
            its ``.grad``), an nn.Module or (name, param) pairs (each parameter's ``.grad``;
            those without one are left out). Names get ``prefix`` too.
          grad_dtype: the wire dtype of every gradient, "float32" (default) or "bfloat16"
            ("fp32", "bf16" or torch dtypes too); bfloat16 rounds to nearest even, as
            tensor.to() does, and halves the bytes. The server computes in fp32.
          grad_scale: if given (> 0, finite), the server divides every gradient by it (undoing
            loss scaling).
          prefix: prepended to every table and dense name.
          client_id, sequence_number: retry detection, as push_gradients (None: the client's
            ``client_id``; 0: none).
          base_version: the version the gradients were computed from (bounded mode refuses a
            push too far behind; sync mode adds the push to the round of that version, which
            steps the mean of its pushers' rows and dense gradients, a row some pusher left
            out counting as zero for it); None sends the version of this client's last
            pull_parameters (lookup_rows does not change it: pass its ``version`` where a
            trainer reads tables only).
          plan_hash: the shard's sharding plan (docs/sharding.md); ShardedClient sets it.

        The push is one PushGradients call over grpcio (whatever the client's transport): the
        header, the dense chunks, then the rows, split over as many TableRows as keep each
        message at or under max_chunk_bytes (a table's TableRows add up on the server). A
        non-finite gradient anywhere (after grad_scale) skips the whole step.

        Returns:
          PushResult, as push_gradients: the new version (one more than before: the push is
          one step), step_skipped and why, tensors_updated (tables and dense tensors stepped),
          the gradient bytes received.
        Raises:
          ValueError / TypeError (before any call): nothing to push; a name twice (among the
            tables, or a table also in ``dense``); keys that are not a 1-D integer tensor or
            ints; grads that are not a dense floating [n, dim] tensor; a dense gradient that is
            not a dense floating tensor or missing; a bad grad_dtype or grad_scale; one row
            larger than max_chunk_bytes.
          fusedps.errors.InvalidArgument: a key outside [0, rows) (the message names it:
            "table_rows[i].keys[j] = k is outside [0, rows)"), grads of another dim than the
            table's, a table named in ``rows`` that is a dense tensor, a table in ``dense``,
            more unique keys of a hashed table than its capacity (in sync mode: the round's
            pushes together). Nothing of the push is applied.
          fusedps.errors.NotFound: an unknown table or tensor.
          fusedps.errors.Aborted: a stale sequence_number, or a base_version bounded or sync
            mode refuses. fusedps.errors.ResourceExhausted: rows beyond the server's staging pool.
        """
        wire = _dtypes.wire_dtype(grad_dtype, "grad_dtype", ROW_GRAD_DTYPES)
        if grad_scale is not None:
            grad_scale = float(grad_scale)
            if not (grad_scale > 0 and math.isfinite(grad_scale)):
                raise ValueError(f"grad_scale must be > 0 and finite, got {grad_scale}")
        if not isinstance(rows, Mapping):
            raise TypeError(f"rows must be a mapping table name -> gradient, got "
                            f"{type(rows).__name__}")
        itemsize = _dtypes.element_size(wire)
        tables: List[Tuple[str, Any, Any, int]] = []
        for name, value in rows.items():
            full = prefix + str(name)
            if any(full == t[0] for t in tables):
                raise ValueError(f"table {full!r} appears twice")
            keys, grads = _table_gradient(full, value)
            key_bytes = _key_bytes(keys)
            grad_bytes = _chunks.to_wire_array(grads, wire).view(np.uint8)
            row_bytes = grads.shape[1] * itemsize if keys.shape[0] else 0
            tables.append((full, key_bytes, grad_bytes, row_bytes))
        dense_items = self._dense_gradients(dense, prefix)
        table_names = [t[0] for t in tables]
        for name, _ in dense_items:
            if name in table_names:
                raise ValueError(f"{name!r} is both a table in rows and a dense tensor")
        if not tables and not dense_items:
            raise ValueError("nothing to push (no tables in rows, no dense gradients)")

        header = pb.PushHeader(
            client_id=self.client_id if client_id is None else client_id,
            sequence_number=int(sequence_number),
            grad_dtype=_dtypes.WIRE_CODES[wire],
            base_version=self.last_pulled_version if base_version is None else int(base_version),
            # Explicit: with `tables` set an empty list means no dense tensor; without tables
            # the dense names are there (a dense-only push is push_gradients').
            tensors=[n for n, _ in dense_items],
            tables=table_names,
            model=self.model,
            plan_hash=plan_hash,
        )
        if grad_scale is not None:
            header.grad_scale = grad_scale
        dense_views = {n: _chunks.to_wire_array(g, wire).view(np.uint8) for n, g in dense_items}
        payload = (sum(len(v) for v in dense_views.values())
                   + sum(len(k) + len(g) for _, k, g, _ in tables))
        max_bytes = self.max_chunk_bytes

        def requests():
            yield pb.PushGradientsRequest(header=header).SerializeToString()
            plan = _chunks.plan_messages([(n, g.numel()) for n, g in dense_items], itemsize,
                                         max_bytes)
            yield from _chunks.encode_messages(plan, dense_views, itemsize)
            yield from _row_messages(tables, max_bytes)

        _check_rows_fit(tables, max_bytes)  # Before the call: requests() raises too late.
        if self._channel is None:
            raise ValueError("the client is closed")
        call = _transport.raw_stream_unary(self._channel, "PushGradients",
                                           pb.PushGradientsResponse)
        return PushResult._from_pb(call(requests(), timeout=self._timeout(payload)))

    def lookup_rows(self, table: str, keys, *, dtype="float32", field: str = "param",
                    prefix: str = "") -> LookedUpRows:
        """Reads rows of an embedding table by key, all at one version (LookupRows).

        Args:
          table: the table's name (``prefix`` is prepended).
          keys: a 1-D integer tensor (any device) or numpy array, or ints: n row indices in
            [0, rows) (any int64 for a hashed table), in any order, repeats allowed.
          dtype: "float32" (the server's fp32 values exactly) or "bfloat16" (rounded to nearest
            even, as tensor.to(torch.bfloat16) rounds); "fp32", "bf16" or torch dtypes too.
          field: "param" (default), "exp_avg" or "exp_avg_sq" (SparseAdam's moments: zero for
            rows never pushed; as fp32: bf16 state widened, int8 state dequantized with the
            row's scale).
          prefix: prepended to ``table``.

        All the keys travel in one request message, which must fit in max_chunk_bytes (8 bytes
        a key: 131,000 keys with the default 1 MiB); the reply streams its rows in messages of
        at most max_chunk_bytes (4 MiB at most). The call's deadline grows with the rows the
        reply announces (``timeout`` plus the rows at ``min_bytes_per_second``).

        Returns:
          LookedUpRows: ``rows``, a CPU tensor [n, dim] of torch.float32 or torch.bfloat16, row i
          keys[i]'s; ``version``, the shard version they were read at; ``step``, the table's
          step count at that version.
        Raises:
          ValueError / TypeError (before any call): keys not a 1-D integer tensor or ints; a
            bad dtype or field; more keys than fit in max_chunk_bytes.
          fusedps.errors.NotFound: an unknown table.
          fusedps.errors.InvalidArgument: a key outside [0, rows) (the message names it), a
            tensor that is not a table.
          fusedps.errors.VersionRegression: the version read is below one this client pulled
            before (see Client's allow_version_regression); raised after the lookup.
          RuntimeError: a malformed reply (another row count or size than announced).
        """
        wire = _dtypes.wire_dtype(dtype, "dtype", LOOKUP_DTYPES)
        if field not in LOOKUP_FIELDS:
            raise ValueError(f"field must be one of {list(LOOKUP_FIELDS)}, got {field!r}")
        full = prefix + table
        key_tensor = _keys_tensor(keys, full)
        n = int(key_tensor.shape[0])
        request = pb.LookupRowsRequest(
            table=full, keys=_key_bytes(key_tensor).tobytes(), dtype=_dtypes.WIRE_CODES[wire],
            field=_dtypes.TENSOR_FIELDS[field], model=self.model,
            max_chunk_bytes=min(self.max_chunk_bytes, _MAX_LOOKUP_CHUNK_BYTES))
        if request.ByteSize() > self.max_chunk_bytes:
            raise ValueError(f"{n} keys ({request.ByteSize()} bytes) do not fit in one "
                             f"request of max_chunk_bytes={self.max_chunk_bytes}: look them "
                             "up in several calls, or raise max_chunk_bytes")
        itemsize = _dtypes.element_size(wire)
        call = self._stub.LookupRows(request)
        out = None
        filled = 0
        version = step = dim = 0
        with _deadlines.GrowingDeadline(call, self.timeout, self.min_bytes_per_second) \
                as deadline:
            try:
                for i, response in enumerate(call):
                    if i == 0:
                        version, step = int(response.version), int(response.step)
                        dim, count = int(response.dim), int(response.count)
                        if count != n:
                            raise RuntimeError(f"malformed LookupRows reply: {count} rows "
                                               f"for {n} keys")
                        out = _chunks.empty_wire_array(n * dim, wire)
                        deadline.set_payload(n * dim * itemsize)
                    data = response.rows
                    if data:
                        filled += _chunks.decode_into(out, filled, data)
            except grpc.RpcError:
                if deadline.expired:
                    raise deadline.error() from None
                raise
            except (RuntimeError, ValueError) as e:
                call.cancel()
                if isinstance(e, ValueError):  # decode_into: past the announced rows.
                    raise RuntimeError(f"malformed LookupRows reply: {e}") from None
                raise
        if out is None:
            raise RuntimeError("malformed LookupRows reply: no message")
        if filled != n * dim:
            raise RuntimeError(f"malformed LookupRows reply: {filled} elements of the "
                               f"{n} x {dim} announced")
        self._observe_version(version)
        return LookedUpRows(_chunks.from_wire_array(out, wire, (n, dim)), version, step)

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _dense_gradients(dense, prefix: str) -> List[Tuple[str, "torch.Tensor"]]:
        """push_rows' ``dense`` as (name, gradient) pairs, as push_gradients reads its
        argument: a mapping's values are the gradients (an nn.Parameter's .grad is), a
        module's or pairs' parameters give their .grad (those without one are left out).

        Raises:
          ValueError: a mapping's nn.Parameter without .grad. TypeError: a gradient that is not
            a dense floating tensor.
        """
        if dense is None:
            return []
        pairs = _named_tensors(dense, prefix)
        as_grads = isinstance(dense, Mapping)
        out: List[Tuple[str, "torch.Tensor"]] = []
        for name, t in pairs:
            if as_grads and not isinstance(t, torch.nn.Parameter):
                g: Optional["torch.Tensor"] = t
            else:
                g = t.grad
                if g is None:
                    if as_grads:
                        raise ValueError(f"dense tensor {name!r} has no .grad")
                    continue
            _check_sendable(name, g)
            out.append((name, g))
        return out

