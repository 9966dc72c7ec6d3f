"""The fusedps Python client: push gradients to a fusedps server and pull parameters back.

A fusedps server keeps the fp32 master copy of named tensors and their AdamW state (or, per
param group, bf16 params and bf16 or int8 state: register_param_group); this module wraps its
gRPC API (proto/fusedps/v1/parameter_service.proto) for PyTorch trainers.

Example::

    import torch
    from fusedps import Client

    model = torch.nn.Linear(64, 10)
    with Client("127.0.0.1:50051") as ps:
        ps.register_param_group("mlp", lr=1e-3, weight_decay=0.01)
        ps.register_model(model, param_group="mlp")
        loss = model(torch.randn(8, 64)).square().mean()
        loss.backward()
        result = ps.push_gradients(model)          # one AdamW step on the server
        ps.pull_parameters(model)                  # copies the new params into the model

Conventions:
  * Tensor names are those of ``named_parameters()`` (plus an optional prefix).
  * Everything travels as little-endian chunks; each request message is kept at or under
    ``max_chunk_bytes`` (keep that under the server's ``max_message_bytes``, 8 MiB by default).
  * Server errors raise fusedps.FusedPSError subclasses (fusedps.errors), one per gRPC status
    code, keeping the code and the server's message: NotFound (unknown tensor or param group),
    InvalidArgument (bad sizes, dtypes, values), AlreadyExists (a conflicting
    re-registration), Unavailable (no server, or a server that stopped answering keepalive
    pings), DeadlineExceeded (a call past its deadline), ... FusedPSError is a grpc.RpcError.
    Mistakes the client can see before calling raise ValueError / TypeError / KeyError.
  * Pushes and pulls go through the C++ client (fusedps._native) when its library is present,
    else through grpcio; both send a push as ``streams`` concurrent parts. See Client.
  * torch is imported on the first call that moves tensors, not by ``import fusedps``.
  * Every call has a deadline by default (30 s plus its tensor data at 10 MB/s) and the
    client's channel sends keepalive pings while calls are in flight, so a dead server or a
    network partition raises an error instead of hanging a trainer; see Client.
  * TLS, client certificates and bearer tokens: Client's tls* and token* arguments, on both
    transports (docs/python.md, "Security").

Client's methods live in this module (connection, registration, pushes and pulls) and in the
classes it inherits, one module each: _client_admin.AdminCalls (param groups, server facts,
models, checkpoints, the tensor listing), _client_state.StateCalls (pull_state, load_state,
buffers), _client_pieces.PieceCalls (begin_push, pull_into) and _client_tables.TableCalls
(embedding tables: register_table, push_rows, lookup_rows).
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from typing import (TYPE_CHECKING, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple,
                    Union, cast)

import grpc

from fusedps import _chunks, _connect, _deadlines, _dtypes, _native, _security, _transport, errors
from fusedps._client_admin import AdminCalls
from fusedps._client_pieces import PieceCalls
from fusedps._client_state import StateCalls
from fusedps._client_tables import TableCalls
from fusedps._lazy import LazyModule
from fusedps._requests import ModelLike, _check_sendable, _named_tensors
from fusedps.results import (Consistency, ModelDeleted, ModelInfo, ParamGroup, PulledTensors,
                             PushResult, RegisterResult, ServerInfo, TensorInfo, TensorList)
from fusedps.v1 import parameter_service_pb2 as pb, parameter_service_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

__all__ = [
    "Client",
    "ParamGroup",
    "PushResult",
    "RegisterResult",
    "TensorInfo",
    "TensorList",
    "PulledTensors",
    "ServerInfo",
    "Consistency",
    "ModelInfo",
    "ModelDeleted",
]

DEFAULT_TIMEOUT = _deadlines.DEFAULT_TIMEOUT
DEFAULT_MIN_BYTES_PER_SECOND = _deadlines.DEFAULT_MIN_BYTES_PER_SECOND

TRANSPORTS = ("auto", "native", "grpcio")


# ----------------------------------------------------------------------------------------------
# Client
# ----------------------------------------------------------------------------------------------

@errors.translate_public_methods
class Client(AdminCalls, StateCalls, PieceCalls, TableCalls):
    """A connection to one fusedps server (one shard).

    Args:
      target: "host:port" of the server (any gRPC target string).
      max_chunk_bytes: upper bound, in bytes, of every request message the client sends (chunk
        payloads plus framing) and the chunk size it asks for in pulls (capped at 4 MiB).
        Default 1 MiB; at least 2048. Must not exceed the server's max_message_bytes.
      client_id: default client id of pushes ("" disables retry detection; at most 256 bytes).
      timeout: seconds; each call must finish within ``timeout`` plus its tensor data at
        ``min_bytes_per_second``, counted from its start, or it raises
        fusedps.errors.DeadlineExceeded. The data is what the call sends (register_model,
        push_gradients) or, for a pull, what the server announces in its reply, so a pull's
        deadline grows as the reply describes its tensors; other calls (info, each page of
        list_tensors, ...) get ``timeout`` alone. None: no deadline at all.
      min_bytes_per_second: the slowest transfer a call is allowed (0: ``timeout`` for every
        call, whatever its size).
      channel: an existing grpc.Channel to use instead of creating one from ``target`` (the
        client then does not close it, nor set its options or credentials; a token is still
        added to its calls).
      options: extra grpc channel options, as for grpc.insecure_channel; they override the
        client's own (no message size limits, and keepalive, below).
      streams: concurrent calls, each on its own connection, 1..64. A push goes as that many
        parts at once (PushHeader.part_count; the server still applies it as one step; parts
        need a client_id and a sequence_number, so a push without them gets this client's
        own: a random client id, and a counter started from the clock; with a token, give
        ``client_id``, as the server refuses any other than the token's principal) and a pull
        of several tensors is split across them (native transport).
      transport: how pushes and pulls travel:
        * "native": the C++ client (libfusedps_c through ctypes, fusedps._native): the fastest,
          several GB/s with a few streams; raises RuntimeError when the library is missing;
        * "grpcio": grpcio alone (each gradient byte copied once into its request, parts over
          ``streams`` channels, pulls decoded straight into the destination tensors);
        * "auto" (default): "native" for streams > 1 when its library loads and neither
          ``channel`` nor ``options`` was given (the C++ client makes its own channels), else
          "grpcio", which moves one stream faster (docs/benchmarks.md, "The Python client").
        Every other call (registration, info, ...) uses grpcio. ``transport_in_use`` says
        which was picked.
      tls: connect with TLS, checking the server's certificate against gRPC's default roots
        (or ``tls_ca``) and the target's host name. Implied by tls_ca and tls_cert. The
        server must serve TLS (its --tls-cert); a plaintext client cannot talk to it, nor a
        TLS client to a plaintext server (both fail with fusedps.errors.Unavailable).
      tls_ca: path of the PEM roots the server's certificate must chain to (the CA of the
        server's --tls-cert), e.g. a private CA.
      tls_cert, tls_key: paths of a PEM client certificate and its private key, both or
        neither: for a server with --tls-client-ca (mutual TLS), which refuses clients
        without one.
      token: a bearer token of the server's --auth-tokens file, sent as ``authorization:
        Bearer TOKEN`` on every call (both transports, every channel). The server refuses a
        call without a known token (fusedps.errors.Unauthenticated) or one its role may not
        make (fusedps.errors.PermissionDenied), and a push whose client_id is not the
        token's principal (PermissionDenied): give ``client_id`` = the principal. Sent in
        the clear without TLS.
      token_file: path of a file holding the token (surrounding whitespace ignored; e.g. a
        mounted Kubernetes Secret), read once here. Exclusive with ``token``.
      model: the model (a server namespace; docs/api.md, "Models") every call of this client
        is about; "" (default): "default", the model every server has. It must exist on the
        server (create_model), else calls raise fusedps.errors.NotFound naming it.
      allow_version_regression: False (default): a pull that finds the server's version below
        the highest this client has pulled (the server was restored from a checkpoint and the
        steps after it are lost) raises fusedps.errors.VersionRegression, after the pull.
        True: go on from the restored values.

    The defaults, 30 s plus 10 MB/s, are the C++ client's (its ClientOptions says why): room
    for connecting, back-pressure and a large step, yet a small call left unanswered fails in
    30 s; a
    bf16 push of GPT-2 small (248 MB) gets 30 + 25 s. While calls are in flight the channel
    pings the server every 30 s and drops the connection (UNAVAILABLE) when a ping goes
    unanswered for 10 s, so a dead server or a partition is found in about 40 s instead of
    TCP's two hours ("grpc.keepalive_time_ms" and "grpc.keepalive_timeout_ms" in ``options``).

    The client is safe to use from one thread at a time; use one Client per thread otherwise.
    Use it as a context manager, or call close().

    Raises (construction):
      ValueError: an option out of range; tls_cert without tls_key (or the reverse); token
        and token_file both; a TLS or token file that cannot be read, or an empty token;
        tls* options with ``channel`` (its credentials are the caller's).
      RuntimeError: transport="native" without the native library.
    """

    def __init__(self, target: str, max_chunk_bytes: int = 1 << 20, *, client_id: str = "",
                 timeout: Optional[float] = DEFAULT_TIMEOUT,
                 min_bytes_per_second: float = DEFAULT_MIN_BYTES_PER_SECOND,
                 channel: Optional[grpc.Channel] = None,
                 options: Sequence[Tuple[str, object]] = (), streams: int = 1,
                 transport: str = "auto", tls: bool = False, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 token: Optional[str] = None, token_file: Optional[str] = None,
                 model: str = "", allow_version_regression: bool = False):
        if int(max_chunk_bytes) < _chunks.MIN_MESSAGE_BYTES:
            raise ValueError(
                f"max_chunk_bytes must be >= {_chunks.MIN_MESSAGE_BYTES}, got {max_chunk_bytes}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        if not min_bytes_per_second >= 0:
            raise ValueError(f"min_bytes_per_second must be >= 0, got {min_bytes_per_second}")
        if not 1 <= int(streams) <= 64:
            raise ValueError(f"streams must be in [1, 64], got {streams}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        security = _security.check_security(tls, tls_ca, tls_cert, tls_key, token, token_file)
        if channel is not None and security.tls:
            raise ValueError("tls, tls_ca, tls_cert and tls_key are for the channels the "
                             "client makes; a given channel has its own credentials")
        self.target = target if channel is not None else _connect.check_target(target)
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.client_id = client_id
        self.model = str(model)
        self.timeout = timeout
        self.min_bytes_per_second = min_bytes_per_second
        self._owns_channel = channel is None
        if channel is None:
            channel = _security.make_channel(target, _deadlines.channel_options(options),
                                             security)
        else:
            channel = _security.with_token(channel, security.token)
        self._channel = channel
        self._stub = pb_grpc.ParameterServiceStub(channel)
        # The streams whose chunks are serialized by _chunks (one copy of the data).
        self._register_tensors = _transport.raw_stream_unary(channel, "RegisterTensors",
                                                              pb.RegisterTensorsResponse)
        self._load_state = _transport.raw_stream_unary(channel, "LoadState",
                                                       pb.LoadStateResponse)
        # The version of the most recent pull_parameters; the default base_version of pushes.
        self.last_pulled_version = 0
        self.allow_version_regression = bool(allow_version_regression)
        self.highest_pulled_version = 0  # Over every pull (see _observe_version).
        self._version_lock = threading.Lock()  # Pulls may come from several threads.
        self.streams = int(streams)
        # The names of pushes in parts that came without one (see streams). Sequence numbers
        # count on from the clock at creation, as the C++ client's do, so that a restarted
        # trainer with the same client_id (with a token: its principal) is not stale.
        self._own_client_id = f"fusedps-py-{uuid.uuid4().hex[:16]}"
        self._last_sequence_number = time.time_ns() // 1000
        self._native: Optional[_native.NativeClient] = None
        self._extra_channels: List[grpc.Channel] = []
        # "auto": grpcio moves one stream faster than the C++ client (torch rounds to bf16 in
        # bulk, then grpcio writes), the C++ client several (docs/benchmarks.md).
        if transport == "native" or (transport == "auto" and self.streams > 1
                                     and self._owns_channel and not options
                                     and _native.library() is not None):
            self._native = _native.NativeClient(
                target, streams=self.streams, max_chunk_bytes=self.max_chunk_bytes,
                timeout=timeout, min_bytes_per_second=min_bytes_per_second, tls=security.tls,
                tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=security.token,
                model=self.model)
            self._pusher = None
        else:
            # Channels beyond the first, each its own connection (a local subchannel pool).
            self._extra_channels = [
                _security.make_channel(target, _deadlines.channel_options(
                    list(options) + [("grpc.use_local_subchannel_pool", 1)]), security)
                for _ in range(self.streams - 1)]
            self._pusher = _transport.GrpcioPusher([channel] + self._extra_channels)
        self.transport_in_use = "native" if self._native is not None else "grpcio"

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the channels (the given ``channel`` excepted) and the native client.
        Idempotent."""
        if self._native is not None:
            self._native.close()
            self._native = None
        if self._pusher is not None:
            self._pusher.close()
        for extra in self._extra_channels:
            extra.close()
        self._extra_channels = []
        if self._owns_channel and self._channel is not None:
            self._channel.close()
        self._channel = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the server answers, and every stream's connection (the native
        transport's too) is made, so that the first pushes and pulls do not fail on a
        connection still being made. A refused connection (the server not up yet) is tried
        again until ``timeout`` seconds have passed; any other failure is raised at once.

        Raises:
          fusedps.errors.Unavailable: the server cannot be reached; the message names the
            target and the cause (refused, a TLS mismatch, no client certificate).
          fusedps.errors.DeadlineExceeded: no answer within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        _connect.wait_answering(
            self.target, lambda seconds: self._stub.ListModels(pb.ListModelsRequest(),
                                                               timeout=seconds), timeout)
        try:
            for channel in self._extra_channels:
                grpc.channel_ready_future(channel).result(
                    timeout=max(0.0, deadline - time.monotonic()))
        except grpc.FutureTimeoutError:
            raise errors.error_for(grpc.StatusCode.DEADLINE_EXCEEDED, (
                f"the fusedps server at {self.target} answered, but not every stream's "
                f"connection was made within {timeout:g} s")) from None
        if self._native is not None:
            self._native.wait_ready(max(0.0, deadline - time.monotonic()))

    # -- tensors --------------------------------------------------------------------------------

    def register_model(self, model_or_named_params: ModelLike,
                       param_group: Union[str, Mapping[str, str]] = "default",
                       prefix: str = "", *, plan_hash: str = "") -> RegisterResult:
        """Registers tensors and streams their initial values (as float32) to the server.

        Args:
          model_or_named_params: an nn.Module (its named_parameters()), a mapping
            name -> tensor, or an iterable of (name, tensor) pairs. Tensors may have any
            floating dtype and device; they are sent as float32 (fp32 master copy on the server).
          param_group: the (registered) group of every tensor given, or a mapping name -> group
            (names with ``prefix``; names it lacks: "default"), as ShardedClient.register_model
            takes it: the tensors are then registered group by group, the groups in the order
            their first tensors come.
          prefix: prepended to every name (e.g. "encoder." to share one server among models).
          plan_hash: the sharding plan's hash when this server is one shard of a model
            (fusedps.plan, docs/sharding.md); "" for an unsharded server.

        Tensors already registered with the same shape and group are left as they are on the
        server (the values sent are ignored), so re-registering after a trainer restart is safe.
        Large models are registered in several calls, each keeping its header under
        max_chunk_bytes; each call is atomic on its own.

        Returns:
          RegisterResult (created / existing counts, version).
        Raises:
          FusedPSError: NOT_FOUND for an unknown param group; ALREADY_EXISTS when a name is
            registered with another shape or group; INVALID_ARGUMENT for a bad name;
            FAILED_PRECONDITION when the shard belongs to another plan_hash.
          TypeError / ValueError: for non-float or sparse tensors, repeated names.
        """
        items = _named_tensors(model_or_named_params, prefix)
        if not items:
            raise ValueError("no tensors to register")
        for name, t in items:
            _check_sendable(name, t)
        if isinstance(param_group, str):
            runs = [(param_group, items)]
        else:
            by_group: Dict[str, List[Tuple[str, "torch.Tensor"]]] = {}
            for name, t in items:
                by_group.setdefault(param_group.get(name, "default"), []).append((name, t))
            runs = list(by_group.items())
        tensors = dict(items)
        created = existing = 0
        version = 0
        batches = [batch for group, run in runs for batch in _chunks.group_specs(
            [pb.TensorSpec(name=name, shape=list(t.shape), param_group=group) for name, t in run],
            self.max_chunk_bytes - 64)]
        for batch in batches:
            batch_items = [(s.name, tensors[s.name]) for s in batch]
            payload = sum(t.numel() for _, t in batch_items) * 4

            def requests(batch=batch, batch_items=batch_items):
                yield pb.RegisterTensorsRequest(header=pb.RegisterTensorsHeader(
                    tensors=batch, plan_hash=plan_hash, model=self.model)).SerializeToString()
                yield from _chunks.chunk_messages(batch_items, "float32", self.max_chunk_bytes)

            resp = self._register_tensors(requests(), timeout=self._timeout(payload))
            created += resp.tensors_created
            existing += resp.tensors_existing
            version = resp.version
        return RegisterResult(created, existing, version)

    def push_gradients(self, model_or_dict: ModelLike, grad_dtype=None,
                       grad_scale: Optional[float] = None,
                       tensors: Optional[Iterable[str]] = None, *,
                       client_id: Optional[str] = None, sequence_number: int = 0,
                       base_version: Optional[int] = None, prefix: str = "",
                       plan_hash: str = "") -> PushResult:
        """Pushes gradients: the server applies them as one AdamW step, atomically.

        Args:
          model_or_dict: where the gradients come from:
            * an nn.Module or (name, param) pairs: each parameter's ``.grad``;
            * a mapping name -> tensor: the tensors ARE the gradients (a value that is an
              nn.Parameter is taken as the parameter, and its ``.grad`` is sent).
            Gradients must have the registered shape (any floating dtype, any device).
          grad_dtype: wire dtype of the gradients: "float32", "bfloat16" or "float16" (or
            "fp32", "bf16", "fp16", or a torch dtype). Narrower dtypes round to nearest even,
            as tensor.to() does; fp16 overflows to inf (and so the step is skipped). The
            server computes in fp32.
            None (the default) sends bfloat16 (half the bytes of float32, the same exponent
            range), except when every gradient is float16 (fp16 mixed precision): then
            float16, which loses nothing. Pass "float32" where the model needs gradients at
            full precision.
          grad_scale: if given (> 0, finite), the server divides the gradients by it (undoing
            loss scaling).
          tensors: names (including prefix) to push; None means every parameter that has a
            ``.grad`` (every entry of a mapping). Tensors not pushed keep their step count, as
            in torch when ``p.grad is None``.
          client_id: identifies the trainer for retry detection; None uses the client's
            ``client_id``; "" disables it.
          sequence_number: increasing per client_id. A push whose number is not above the
            highest the server has taken for its client_id is never applied: a retry of a push
            the server remembers returns that push's result with duplicate=True, any other
            raises ABORTED. 0 disables retry detection.
          base_version: the model version the gradients were computed from; None sends the
            version of this client's last pull_parameters.
          prefix: prepended to the names taken from a module/pairs/mapping.
          plan_hash: the shard's sharding plan hash, as given to register_model.

        Returns:
          PushResult: the new version, whether the step was skipped (non-finite gradient: then
          nothing at all changed) and why, counts.
        Raises:
          ValueError: no gradients to push, a named tensor without ``.grad``, bad grad_scale or
            grad_dtype. KeyError: a name in ``tensors`` that the model does not have.
          FusedPSError: NOT_FOUND for a tensor the server does not have; INVALID_ARGUMENT for a
            wrong size; ABORTED for a stale sequence_number (above) or a base_version the
            consistency mode refuses; FAILED_PRECONDITION for another plan_hash.
        """
        if grad_dtype is not None:
            wire = _dtypes.wire_dtype(grad_dtype, "grad_dtype")
        if grad_scale is not None:
            grad_scale = float(grad_scale)
            if not (grad_scale > 0 and math.isfinite(grad_scale)):
                raise ValueError(f"grad_scale must be > 0 and finite, got {grad_scale}")
        pairs = _named_tensors(model_or_dict, prefix)
        as_grads = isinstance(model_or_dict, Mapping)
        grads: Dict[str, Optional[torch.Tensor]] = {}
        for name, t in pairs:
            if as_grads and not isinstance(t, torch.nn.Parameter):
                grads[name] = t
            else:
                grads[name] = t.grad
        if tensors is None:
            names = [n for n, g in grads.items() if g is not None]
        else:
            if isinstance(tensors, str):
                tensors = [tensors]
            names = list(tensors)
            if len(set(names)) != len(names):
                raise ValueError("a tensor is named twice in tensors")
            for n in names:
                if n not in grads:
                    raise KeyError(f"no tensor named {n!r} (prefix {prefix!r})")
                if grads[n] is None:
                    raise ValueError(f"tensor {n!r} has no .grad")
        if not names:
            raise ValueError("no gradients to push (no parameter has .grad)")
        items = [(n, cast("torch.Tensor", grads[n])) for n in names]  # Each has one (above).
        for name, g in items:
            _check_sendable(name, g)
        if grad_dtype is None:
            all_fp16 = all(g.dtype == torch.float16 for _, g in items)
            wire = "float16" if all_fp16 else "bfloat16"

        header = pb.PushHeader(
            client_id=self.client_id if client_id is None else client_id,
            sequence_number=int(sequence_number),
            grad_dtype=_dtypes.WIRE_CODES[wire],
            base_version=self.last_pulled_version if base_version is None else int(base_version),
            tensors=names,  # always explicit: an empty list would mean "every tensor"
            plan_hash=plan_hash,
            model=self.model,
        )
        if grad_scale is not None:
            header.grad_scale = grad_scale

        if self._native is not None:
            r = self._native.push(
                client_id=header.client_id, sequence_number=header.sequence_number,
                grad_dtype=header.grad_dtype, grad_scale=grad_scale,
                base_version=header.base_version, plan_hash=plan_hash, names=names,
                grads=[g.detach().to(device="cpu", dtype=torch.float32).contiguous()
                       for _, g in items])
            return PushResult._from_native(r)
        pusher = cast(_transport.GrpcioPusher, self._pusher)  # grpcio's, without _native.
        r = pusher.push(header, items, wire, self.max_chunk_bytes, self._timeout,
                        self._name_push)
        return PushResult._from_pb(r)

    def pull_parameters(self, model_or_names=None, dtype="float32", *,
                        prefix: str = "") -> PulledTensors:
        """Pulls parameters (the server's fp32 master, or a bfloat16 rendering of it; the bf16
        params of a group with params_dtype "bf16", exactly, in either dtype).

        Args:
          model_or_names: one of
            * an nn.Module, a mapping name -> tensor or (name, tensor) pairs: the tensors are
              pulled and copied into them in place (converted to their dtype and device; shapes
              must match);
            * a list of names, or one name: those tensors are returned only;
            * None: every tensor of the shard is returned.
            An empty list or a module without parameters is a ValueError.
          dtype: "float32" (exact master values) or "bfloat16" (rounded to nearest even, or the
            server's bf16 copy when it keeps one); "fp32", "bf16" and torch dtypes too.
          prefix: prepended to the names taken from a module/mapping/pairs.

        Returns:
          PulledTensors: name -> CPU tensor (torch.float32 or torch.bfloat16) with the
          registered shape, plus ``.version`` and ``.steps``. Every tensor was read at the
          same version.
        Raises:
          FusedPSError: NOT_FOUND for an unknown name; INVALID_ARGUMENT for a bad dtype.
          ValueError: a local tensor whose shape differs from the server's.
          RuntimeError: the server's reply was malformed (it did not cover every element
            exactly, or described its tensors wrongly).
        """
        wire = _dtypes.wire_dtype(dtype, "dtype", _dtypes.PULL_DTYPES)
        targets, names = self._targets_and_names(model_or_names, prefix)
        out = self._pull(names, wire, pb.TENSOR_FIELD_PARAM, targets)
        self.last_pulled_version = out.version
        self._observe_version(out.version)
        return out

    def _observe_version(self, version: int) -> None:
        """Records a version a pull read; raises errors.VersionRegression when it is below the
        highest one pulled before (see allow_version_regression)."""
        with self._version_lock:
            seen = self.highest_pulled_version
            self.highest_pulled_version = max(seen, int(version))
        if int(version) < seen and not self.allow_version_regression:
            raise errors.VersionRegression(self.target, seen, int(version))

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _targets_and_names(obj, prefix: str):
        """(targets to copy into, names to request) for the accepted 'what to pull' forms."""
        if obj is None:
            return [], []
        if isinstance(obj, str):
            return [], [obj]
        if isinstance(obj, (torch.nn.Module, Mapping)):
            targets = _named_tensors(obj, prefix)
        else:
            items = list(obj)
            if items and all(isinstance(x, str) for x in items):
                if len(set(items)) != len(items):
                    raise ValueError("a tensor is named twice")
                return [], items
            targets = _named_tensors(items, prefix)
        if not targets:
            # An empty request would mean "every tensor of the shard"; None says that.
            raise ValueError("nothing to pull (use None for every tensor)")
        return targets, [n for n, _ in targets]

    def _timeout(self, payload_bytes: int = 0) -> Optional[float]:
        """The deadline, in seconds, of a call that moves payload_bytes of tensor data."""
        return _deadlines.call_timeout(self.timeout, self.min_bytes_per_second, payload_bytes)

    def _name_push(self, header: "pb.PushHeader") -> None:
        """Gives a push in parts the name parts need: this client's own client id and the next
        of its sequence numbers, where the caller gave none."""
        if not header.client_id:
            header.client_id = self._own_client_id
        if header.sequence_number == 0:
            self._last_sequence_number += 1
            header.sequence_number = self._last_sequence_number

    def _pull(self, names: List[str], wire: str, field: int,
              targets: Sequence[Tuple[str, "torch.Tensor"]] = ()) -> PulledTensors:
        """Pulls ``names`` and, when ``targets`` ((name, tensor) pairs covering the names) are
        given, writes the values into them: straight into a tensor that can take the wire's
        bytes (contiguous, on the CPU, of the wire dtype; float32 for the native transport), else
        through a CPU buffer and one copy_ (a dtype conversion or a copy to its device). A
        failed pull may leave the targets partly written.

        Raises:
          ValueError: a target whose shape differs from the server's.
        """
        if targets and self._native is not None:
            return _native.pull_into(self._native, targets, wire, field)
        direct = {}
        for name, t in targets:
            if (t.device.type == "cpu" and t.is_contiguous()
                    and t.dtype == _dtypes.torch_dtype(wire)):
                direct[name] = (_chunks.tensor_as_wire_array(t.detach().view(-1), wire),
                                tuple(t.shape))
        out = _transport.pull(self._stub, names, wire, field, direct, model=self.model,
                              max_chunk_bytes=self.max_chunk_bytes, timeout=self.timeout,
                              min_bytes_per_second=self.min_bytes_per_second)
        with torch.no_grad():
            for name, t in targets:
                src = out[name]
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: server shape {tuple(src.shape)} != local "
                                     f"shape {tuple(t.shape)}")
                if name not in direct:
                    t.copy_(src)
        return out
