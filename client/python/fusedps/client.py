"""The fusedps Python client: push gradients to a fusedps server and pull parameters back.

A fusedps server keeps the fp32 master copy of named tensors and their AdamW state; this module
wraps its gRPC API (proto/fusedps/v1/parameter_service.proto) for PyTorch trainers.

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
  * Server errors surface as ``grpc.RpcError`` with the server's ``grpc.StatusCode``:
    NOT_FOUND (unknown tensor or param group), INVALID_ARGUMENT (bad sizes, dtypes, values),
    ALREADY_EXISTS (a conflicting re-registration), UNAVAILABLE (no server, or a server that
    stopped answering keepalive pings), DEADLINE_EXCEEDED (a call past its deadline), ...
    Mistakes the client can see before calling raise ValueError / TypeError / KeyError.
  * Every call has a deadline by default (30 s plus its tensor data at 10 MB/s) and the
    client's channel sends keepalive pings while calls are in flight, so a dead server or a
    network partition raises an error instead of hanging a trainer; see Client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import torch

from fusedps import _chunks, _deadlines, _replies
from fusedps.v1 import parameter_service_pb2 as pb, parameter_service_pb2_grpc as pb_grpc

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
]

# The largest max_chunk_bytes a PullParametersRequest may ask for (proto: at most 4 MiB).
_MAX_PULL_CHUNK_BYTES = 4 << 20

DEFAULT_TIMEOUT = _deadlines.DEFAULT_TIMEOUT
DEFAULT_MIN_BYTES_PER_SECOND = _deadlines.DEFAULT_MIN_BYTES_PER_SECOND

_DTYPE_TO_PB = _replies._WIRE_TO_PB  # Wire dtype name -> proto enum, one table.
_PB_TO_DTYPE = {v: k for k, v in _DTYPE_TO_PB.items()}

_FIELDS = {
    "param": pb.TENSOR_FIELD_PARAM,
    "exp_avg": pb.TENSOR_FIELD_EXP_AVG,
    "exp_avg_sq": pb.TENSOR_FIELD_EXP_AVG_SQ,
    "max_exp_avg_sq": pb.TENSOR_FIELD_MAX_EXP_AVG_SQ,
}

ModelLike = Union[torch.nn.Module, Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]


# ----------------------------------------------------------------------------------------------
# Result types
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamGroup:
    """AdamW hyperparameters of a param group, as stored by the server.

    Attributes:
      name: the group's name.
      lr: learning rate (>= 0).
      betas: (beta1, beta2), each in [0, 1).
      eps: added to the denominator (>= 0).
      weight_decay: decay coefficient (>= 0).
      amsgrad: whether max_exp_avg_sq is kept (fixed at registration).
      maximize: whether the objective is maximized (gradients negated).
      decoupled_weight_decay: True: AdamW's decoupled decay (param -= lr * wd * param);
        False: L2, as torch.optim.Adam (grad += wd * param).
    A field the server left unset is None.
    """

    name: str
    lr: Optional[float]
    betas: Tuple[Optional[float], Optional[float]]
    eps: Optional[float]
    weight_decay: Optional[float]
    amsgrad: Optional[bool]
    maximize: Optional[bool]
    decoupled_weight_decay: Optional[bool]

    @classmethod
    def _from_pb(cls, g: "pb.ParamGroup") -> "ParamGroup":
        h = g.hyperparameters

        def opt(field):
            return getattr(h, field) if h.HasField(field) else None

        mode = opt("weight_decay_mode")
        return cls(
            name=g.name,
            lr=opt("lr"),
            betas=(opt("beta1"), opt("beta2")),
            eps=opt("eps"),
            weight_decay=opt("weight_decay"),
            amsgrad=opt("amsgrad"),
            maximize=opt("maximize"),
            decoupled_weight_decay=None if mode is None else mode != pb.WEIGHT_DECAY_MODE_L2,
        )


@dataclass(frozen=True)
class RegisterResult:
    """Outcome of register_model.

    Attributes:
      tensors_created: tensors that were new to the server.
      tensors_existing: tensors already registered with an identical spec (left unchanged:
        their values on the server were kept, not overwritten).
      version: the shard version after registration.
    """

    tensors_created: int
    tensors_existing: int
    version: int


@dataclass(frozen=True)
class PushResult:
    """Acknowledgement of one push (one AdamW step of the pushed tensors, or none).

    Attributes:
      version: the shard version after the push (unchanged when skipped or a duplicate).
      step_skipped: True when nothing was updated (e.g. a non-finite gradient).
      skip_reason: "non_finite_grad" when step_skipped, else "".
      tensors_updated: number of tensors whose step advanced.
      grad_bytes: gradient payload bytes the server received.
      duplicate: True when the server recognized a retry of a push it took (same client_id
        and sequence_number) and applied nothing more; the other fields repeat that push's.
      round_workers: sync mode: the pushes (distinct client_ids) the round's step averaged;
        0 in the other modes.
    """

    version: int
    step_skipped: bool
    skip_reason: str
    tensors_updated: int
    grad_bytes: int
    duplicate: bool
    round_workers: int = 0


@dataclass(frozen=True)
class TensorInfo:
    """One registered tensor: name, shape (tuple of ints; () for 0-dim), param group, the number
    of optimizer steps applied to it, and its element count."""

    name: str
    shape: Tuple[int, ...]
    param_group: str
    step: int
    numel: int

    @classmethod
    def _from_pb(cls, t: "pb.TensorInfo") -> "TensorInfo":
        return cls(t.name, tuple(int(d) for d in t.shape), t.param_group, int(t.step),
                   int(t.numel))


class TensorList(list):
    """A list of TensorInfo in the server's order, plus ``.version`` (the shard version when
    the first page was read; a push applied between pages shows in the later pages' steps)."""

    def __init__(self, items: Iterable[TensorInfo] = (), version: int = 0):
        super().__init__(items)
        self.version = version


class PulledTensors(dict):
    """name -> torch.Tensor (CPU, shaped as registered), in the server's order.

    Attributes:
      version: the shard version every tensor was read at.
      steps: name -> optimizer steps applied to that tensor (int).
      dtype: the wire dtype name ("float32" or "bfloat16"); tensors have the matching torch dtype.
    """

    def __init__(self, items=(), version: int = 0, steps: Optional[Dict[str, int]] = None,
                 dtype: str = "float32"):
        super().__init__(items)
        self.version = version
        self.steps = dict(steps or {})
        self.dtype = dtype


@dataclass(frozen=True)
class Consistency:
    """How a shard turns pushes into steps (docs/consistency.md): mode "async", "sync" (K of N
    rounds: replicas_to_aggregate K, total_replicas N, round_timeout_seconds, 0 for none) or
    "bounded" (max_staleness, staleness_lr_scaling); "unspecified" from a server that left it
    unset."""

    mode: str
    replicas_to_aggregate: int
    total_replicas: int
    round_timeout_seconds: float
    max_staleness: int
    staleness_lr_scaling: bool

    @classmethod
    def _from_pb(cls, c: "pb.Consistency") -> "Consistency":
        mode = {pb.CONSISTENCY_MODE_ASYNC: "async", pb.CONSISTENCY_MODE_SYNC: "sync",
                pb.CONSISTENCY_MODE_BOUNDED: "bounded"}.get(c.mode, "unspecified")
        return cls(mode, int(c.replicas_to_aggregate), int(c.total_replicas),
                   float(c.round_timeout_seconds), int(c.max_staleness),
                   bool(c.staleness_lr_scaling))


@dataclass(frozen=True)
class ServerInfo:
    """What GetInfo reports.

    Attributes:
      version: shard version (applied pushes).
      backend: "cpu" or "cuda".
      device: e.g. "cpu (16 threads)" or "cuda:0 NVIDIA H100".
      tensor_count, parameter_count: registered tensors and their total elements.
      param_groups: list of ParamGroup.
      server_version: the server's build version string.
      max_message_bytes: the server's max receive message size in bytes.
      param_copy_dtype: "bfloat16" / "float16" when the server keeps a low-precision copy of
        the params for pulls, else None.
      consistency: the shard's Consistency, or None from a server that does not report it.
      plan_hash: the hash of the sharding plan the shard belongs to ("" when unsharded).
    """

    version: int
    backend: str
    device: str
    tensor_count: int
    parameter_count: int
    param_groups: Tuple[ParamGroup, ...]
    server_version: str
    max_message_bytes: int
    param_copy_dtype: Optional[str]
    consistency: Optional[Consistency] = None
    plan_hash: str = ""


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

def _named_tensors(obj: ModelLike, prefix: str = "") -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module (named_parameters), a mapping or an iterable of pairs.

    Raises:
      TypeError: for anything else. ValueError: for repeated names.
    """
    if isinstance(obj, torch.nn.Module):
        pairs = list(obj.named_parameters())
    elif isinstance(obj, Mapping):
        pairs = list(obj.items())
    else:
        try:
            pairs = [tuple(p) for p in obj]
        except TypeError:
            raise TypeError(
                "expected an nn.Module, a mapping name -> tensor or (name, tensor) pairs, got "
                f"{type(obj).__name__}") from None
    out = []
    seen = set()
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str) or not isinstance(pair[1], torch.Tensor):
            raise TypeError(f"expected (str, torch.Tensor) pairs, got {pair!r:.80}")
        name = prefix + pair[0]
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        out.append((name, pair[1]))
    return out


def _check_sendable(name: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"{name}: only dense tensors can be sent, got layout {t.layout}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating point tensor, got {t.dtype}")


def _hyperparameters(lr=None, betas=None, eps=None, weight_decay=None, amsgrad=None,
                     maximize=None, decoupled_weight_decay=None) -> "pb.Hyperparameters":
    h = pb.Hyperparameters()
    if lr is not None:
        h.lr = float(lr)
    if betas is not None:
        b1, b2 = betas
        if b1 is not None:
            h.beta1 = float(b1)
        if b2 is not None:
            h.beta2 = float(b2)
    if eps is not None:
        h.eps = float(eps)
    if weight_decay is not None:
        h.weight_decay = float(weight_decay)
    if amsgrad is not None:
        h.amsgrad = bool(amsgrad)
    if maximize is not None:
        h.maximize = bool(maximize)
    if decoupled_weight_decay is not None:
        h.weight_decay_mode = (pb.WEIGHT_DECAY_MODE_DECOUPLED if decoupled_weight_decay
                               else pb.WEIGHT_DECAY_MODE_L2)
    return h


def _chunk_messages(message_cls, items: Sequence[Tuple[str, torch.Tensor]], wire: str,
                    max_message_bytes: int) -> Iterator:
    """Request messages (of ``message_cls``, using its ``chunks`` field) carrying every element
    of every tensor in ``items`` as ``wire``-dtype chunks. Converts one tensor at a time."""
    numels = [(name, t.numel()) for name, t in items]
    tensors = dict(items)
    arrays: Dict[str, object] = {}
    itemsize = _chunks.element_size(wire)
    for plan in _chunks.plan_messages(numels, itemsize, max_message_bytes):
        msg = message_cls()
        for name, start, stop in plan:
            arr = arrays.get(name)
            if arr is None:
                arr = arrays[name] = _chunks.to_wire_array(tensors[name], wire)
            msg.chunks.add(tensor=name, offset=start, data=arr[start:stop].tobytes())
            if stop == arr.shape[0]:
                del arrays[name]
        yield msg


# ----------------------------------------------------------------------------------------------
# Client
# ----------------------------------------------------------------------------------------------

class Client:
    """A connection to one fusedps server (one shard).

    Args:
      target: "host:port" of the server (any gRPC target string).
      max_chunk_bytes: upper bound, in bytes, of every request message the client sends (chunk
        payloads plus framing) and the chunk size it asks for in pulls (capped at 4 MiB).
        Default 1 MiB; at least 2048. Must not exceed the server's max_message_bytes.
      client_id: default client id of pushes ("" disables retry detection; at most 256 bytes).
      timeout: seconds; each call must finish within ``timeout`` plus its tensor data at
        ``min_bytes_per_second``, counted from its start, or it raises grpc.RpcError with
        DEADLINE_EXCEEDED. The data is what the call sends (register_model, push_gradients)
        or, for a pull, what the server announces in its reply, so a pull's deadline grows
        as the reply describes its tensors; other calls (info, each page of list_tensors, ...)
        get ``timeout`` alone. None: no deadline at all.
      min_bytes_per_second: the slowest transfer a call is allowed (0: ``timeout`` for every
        call, whatever its size).
      channel: an existing grpc.Channel to use instead of creating one from ``target`` (the
        client then does not close it, nor set its options).
      options: extra grpc channel options, as for grpc.insecure_channel; they override the
        client's own (no message size limits, and keepalive, below).

    The defaults, 30 s plus 10 MB/s, are the C++ client's (its ClientOptions says why): room
    for connecting, back-pressure and a large step, yet a small call left unanswered fails in
    30 s; a
    bf16 push of GPT-2 small (248 MB) gets 30 + 25 s. While calls are in flight the channel
    pings the server every 30 s and drops the connection (UNAVAILABLE) when a ping goes
    unanswered for 10 s, so a dead server or a partition is found in about 40 s instead of
    TCP's two hours ("grpc.keepalive_time_ms" and "grpc.keepalive_timeout_ms" in ``options``).

    The client is safe to use from one thread at a time; use one Client per thread otherwise.
    Use it as a context manager, or call close().
    """

    def __init__(self, target: str, max_chunk_bytes: int = 1 << 20, *, client_id: str = "",
                 timeout: Optional[float] = DEFAULT_TIMEOUT,
                 min_bytes_per_second: float = DEFAULT_MIN_BYTES_PER_SECOND,
                 channel: Optional[grpc.Channel] = None,
                 options: Sequence[Tuple[str, object]] = ()):
        if int(max_chunk_bytes) < _chunks.MIN_MESSAGE_BYTES:
            raise ValueError(
                f"max_chunk_bytes must be >= {_chunks.MIN_MESSAGE_BYTES}, got {max_chunk_bytes}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        if not min_bytes_per_second >= 0:
            raise ValueError(f"min_bytes_per_second must be >= 0, got {min_bytes_per_second}")
        self.target = target
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.client_id = client_id
        self.timeout = timeout
        self.min_bytes_per_second = min_bytes_per_second
        self._owns_channel = channel is None
        if channel is None:
            channel = grpc.insecure_channel(target, options=_deadlines.channel_options(options))
        self._channel = channel
        self._stub = pb_grpc.ParameterServiceStub(channel)
        # The version of the most recent pull_parameters; the default base_version of pushes.
        self.last_pulled_version = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the channel (if the client created it). Idempotent."""
        if self._owns_channel and self._channel is not None:
            self._channel.close()
        self._channel = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the channel is connected.

        Raises:
          grpc.FutureTimeoutError: when the server is not reachable within ``timeout`` seconds.
        """
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    # -- param groups ---------------------------------------------------------------------------

    def register_param_group(self, name: str, lr: Optional[float] = None,
                             betas: Optional[Tuple[float, float]] = None,
                             eps: Optional[float] = None, weight_decay: Optional[float] = None,
                             amsgrad: Optional[bool] = None, maximize: Optional[bool] = None,
                             decoupled_weight_decay: bool = True) -> ParamGroup:
        """Registers a param group (a set of AdamW hyperparameters shared by tensors).

        Arguments left None take torch.optim.AdamW's defaults on the server (lr 1e-3,
        betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2, amsgrad False, maximize False).
        decoupled_weight_decay=False selects L2 decay, as torch.optim.Adam's weight_decay.
        Registering an identical group again is a no-op.

        Returns:
          The group as stored, with defaults filled in (ParamGroup).
        Raises:
          grpc.RpcError: INVALID_ARGUMENT for out-of-range values or a bad name (1..128 bytes);
            ALREADY_EXISTS when a different group of that name exists.
        """
        req = pb.RegisterParamGroupRequest(param_group=pb.ParamGroup(
            name=name,
            hyperparameters=_hyperparameters(lr, betas, eps, weight_decay, amsgrad, maximize,
                                             decoupled_weight_decay)))
        resp = self._stub.RegisterParamGroup(req, timeout=self._timeout())
        return ParamGroup._from_pb(resp.param_group)

    def set_hyperparameters(self, group: str, *, lr: Optional[float] = None,
                            betas: Optional[Tuple[float, float]] = None,
                            eps: Optional[float] = None, weight_decay: Optional[float] = None,
                            maximize: Optional[bool] = None,
                            decoupled_weight_decay: Optional[bool] = None) -> ParamGroup:
        """Changes hyperparameters of a group at run time (e.g. an lr schedule).

        Only the arguments given change; the next push uses the new values (like assigning
        ``optimizer.param_groups[i]["lr"]``). amsgrad cannot change.

        Returns:
          The group after the change (ParamGroup).
        Raises:
          grpc.RpcError: NOT_FOUND for an unknown group, INVALID_ARGUMENT for bad values.
        """
        req = pb.SetHyperparametersRequest(
            param_group=group,
            hyperparameters=_hyperparameters(lr, betas, eps, weight_decay, None, maximize,
                                             decoupled_weight_decay))
        resp = self._stub.SetHyperparameters(req, timeout=self._timeout())
        return ParamGroup._from_pb(resp.param_group)

    # -- tensors --------------------------------------------------------------------------------

    def register_model(self, model_or_named_params: ModelLike, param_group: str = "default",
                       prefix: str = "", *, plan_hash: str = "") -> RegisterResult:
        """Registers tensors and streams their initial values (as float32) to the server.

        Args:
          model_or_named_params: an nn.Module (its named_parameters()), a mapping
            name -> tensor, or an iterable of (name, tensor) pairs. Tensors may have any
            floating dtype and device; they are sent as float32 (fp32 master copy on the server).
          param_group: the (registered) group of every tensor given.
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
          grpc.RpcError: NOT_FOUND for an unknown param group; ALREADY_EXISTS when a name is
            registered with another shape or group; INVALID_ARGUMENT for a bad name;
            FAILED_PRECONDITION when the shard belongs to another plan_hash.
          TypeError / ValueError: for non-float or sparse tensors, repeated names.
        """
        items = _named_tensors(model_or_named_params, prefix)
        if not items:
            raise ValueError("no tensors to register")
        for name, t in items:
            _check_sendable(name, t)
        specs = [pb.TensorSpec(name=name, shape=list(t.shape), param_group=param_group)
                 for name, t in items]
        tensors = dict(items)
        created = existing = 0
        version = 0
        for batch in _chunks.group_specs(specs, self.max_chunk_bytes - 64):
            batch_items = [(s.name, tensors[s.name]) for s in batch]
            payload = sum(t.numel() for _, t in batch_items) * 4

            def requests(batch=batch, batch_items=batch_items):
                yield pb.RegisterTensorsRequest(header=pb.RegisterTensorsHeader(
                    tensors=batch, plan_hash=plan_hash))
                yield from _chunk_messages(pb.RegisterTensorsRequest, batch_items, "float32",
                                           self.max_chunk_bytes)

            resp = self._stub.RegisterTensors(requests(), timeout=self._timeout(payload))
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
          grad_dtype: wire dtype of the gradients: "float32", "bfloat16" or "float16"
            (torch dtypes accepted). Narrower dtypes round to nearest even, as tensor.to() does;
            fp16 overflows to inf (and so the step is skipped). The server computes in fp32.
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
          grpc.RpcError: NOT_FOUND for a tensor the server does not have; INVALID_ARGUMENT for a
            wrong size; ABORTED for a stale sequence_number (above) or a base_version the
            consistency mode refuses; FAILED_PRECONDITION for another plan_hash.
        """
        if grad_dtype is not None:
            wire = _chunks.wire_dtype_name(grad_dtype)
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
        items = [(n, grads[n]) for n in names]
        for name, g in items:
            _check_sendable(name, g)
        if grad_dtype is None:
            all_fp16 = all(g.dtype == torch.float16 for _, g in items)
            wire = "float16" if all_fp16 else "bfloat16"

        header = pb.PushHeader(
            client_id=self.client_id if client_id is None else client_id,
            sequence_number=int(sequence_number),
            grad_dtype=_DTYPE_TO_PB[wire],
            base_version=self.last_pulled_version if base_version is None else int(base_version),
            tensors=names,  # always explicit: an empty list would mean "every tensor"
            plan_hash=plan_hash,
        )
        if grad_scale is not None:
            header.grad_scale = grad_scale

        def requests():
            yield pb.PushGradientsRequest(header=header)
            yield from _chunk_messages(pb.PushGradientsRequest, items, wire, self.max_chunk_bytes)

        payload = sum(g.numel() for _, g in items) * _chunks.element_size(wire)
        r = self._stub.PushGradients(requests(), timeout=self._timeout(payload))
        return PushResult(int(r.version), bool(r.step_skipped), r.skip_reason,
                          int(r.tensors_updated), int(r.grad_bytes), bool(r.duplicate),
                          int(r.round_workers))

    def pull_parameters(self, model_or_names=None, dtype="float32", *,
                        prefix: str = "") -> PulledTensors:
        """Pulls parameters (the server's fp32 master, or a bfloat16 rendering of it).

        Args:
          model_or_names: one of
            * an nn.Module, a mapping name -> tensor or (name, tensor) pairs: the tensors are
              pulled and copied into them in place (converted to their dtype and device; shapes
              must match);
            * a list of names, or one name: those tensors are returned only;
            * None: every tensor of the shard is returned.
            An empty list or a module without parameters is a ValueError.
          dtype: "float32" (exact master values) or "bfloat16" (rounded to nearest even, or the
            server's bf16 copy when it keeps one).
          prefix: prepended to the names taken from a module/mapping/pairs.

        Returns:
          PulledTensors: name -> CPU tensor (torch.float32 or torch.bfloat16) with the
          registered shape, plus ``.version`` and ``.steps``. Every tensor was read at the
          same version.
        Raises:
          grpc.RpcError: NOT_FOUND for an unknown name; INVALID_ARGUMENT for a bad dtype.
          ValueError: a local tensor whose shape differs from the server's.
          RuntimeError: the server's reply was malformed (it did not cover every element
            exactly, or described its tensors wrongly).
        """
        wire = _chunks.wire_dtype_name(dtype)
        if wire == "float16":
            raise ValueError("pulls support dtype 'float32' or 'bfloat16'")
        targets, names = self._targets_and_names(model_or_names, prefix)
        out = self._pull(names, wire, pb.TENSOR_FIELD_PARAM)
        if targets:
            with torch.no_grad():
                for name, t in targets:
                    src = out[name]
                    if tuple(src.shape) != tuple(t.shape):
                        raise ValueError(f"{name}: server shape {tuple(src.shape)} != local "
                                         f"shape {tuple(t.shape)}")
                    t.copy_(src)
        self.last_pulled_version = out.version
        return out

    def pull_state(self, field: str = "exp_avg", names=None, *, prefix: str = ""
                   ) -> Tuple[Dict[str, torch.Tensor], int, Dict[str, int]]:
        """Reads one stored fp32 array per tensor (for checkpoints, tests and debugging).

        Args:
          field: "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (amsgrad groups only) or "param".
          names: names, one name, a module/mapping/pairs (their names, with ``prefix``), or
            None for every tensor of the shard.

        Returns:
          (tensors, version, steps): name -> torch.float32 CPU tensor with the registered
          shape; the shard version it was read at; name -> steps applied (int). Names follow
          the server's order. The optimizer state of a tensor that was never stepped is zeros,
          as torch's would be after its first (zero-gradient-free) initialization.
        Raises:
          ValueError: unknown field. grpc.RpcError: NOT_FOUND for unknown names;
          INVALID_ARGUMENT / FAILED_PRECONDITION for max_exp_avg_sq without amsgrad.
        """
        if field not in _FIELDS:
            raise ValueError(f"field must be one of {sorted(_FIELDS)}, got {field!r}")
        _, names = self._targets_and_names(names, prefix)
        out = self._pull(names, "float32", _FIELDS[field])
        return dict(out), out.version, out.steps

    def info(self) -> ServerInfo:
        """Server facts: version, backend, device, counts, param groups, limits (ServerInfo)."""
        r = self._stub.GetInfo(pb.GetInfoRequest(), timeout=self._timeout())
        return ServerInfo(
            version=int(r.version), backend=r.backend, device=r.device,
            tensor_count=int(r.tensor_count), parameter_count=int(r.parameter_count),
            param_groups=tuple(ParamGroup._from_pb(g) for g in r.param_groups),
            server_version=r.server_version, max_message_bytes=int(r.max_message_bytes),
            param_copy_dtype=_PB_TO_DTYPE.get(r.param_copy_dtype),
            consistency=(Consistency._from_pb(r.consistency) if r.HasField("consistency")
                         else None),
            plan_hash=r.plan_hash)

    def checkpoint(self, timeout: Optional[float] = 600.0) -> Tuple[int, str]:
        """Has the server write a checkpoint holding every push acknowledged before this call,
        and returns ``(version, path)``: the shard version it holds and its directory on the
        server. Blocks until the checkpoint is durable (``timeout`` seconds at most).

        Raises:
          grpc.RpcError: FAILED_PRECONDITION (the server has no --checkpoint-dir),
            RESOURCE_EXHAUSTED (its disk is full), UNAVAILABLE, DEADLINE_EXCEEDED.
        """
        r = self._stub.Checkpoint(pb.CheckpointRequest(), timeout=timeout)
        return int(r.version), r.path

    def list_tensors(self) -> TensorList:
        """Every registered tensor (TensorInfo: name, shape, group, step, numel), with
        ``.version``. The server returns a large shard in pages; this reads them all, each page
        a call with a deadline of its own.

        Raises:
          RuntimeError: the server repeated a page token (a listing that would never end).
        """
        version, infos = _replies.list_pages(
            lambda request: self._stub.ListTensors(request, timeout=self._timeout()))
        return TensorList((TensorInfo._from_pb(t) for t in infos), version)

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

    def _pull(self, names: List[str], wire: str, field: int) -> PulledTensors:
        req = pb.PullParametersRequest(
            tensors=names, dtype=_DTYPE_TO_PB[wire], field=field,
            max_chunk_bytes=min(self.max_chunk_bytes, _MAX_PULL_CHUNK_BYTES))
        assembler = _replies.PullAssembler(wire)
        # The size is known from the reply only: the deadline grows as the reply announces it.
        call = self._stub.PullParameters(req)
        with _deadlines.GrowingDeadline(call, self.timeout, self.min_bytes_per_second) as deadline:
            try:
                for resp in call:
                    assembler.add(resp)
                    deadline.set_payload(assembler.announced_bytes)
            except grpc.RpcError:
                if deadline.expired:
                    raise deadline.error() from None
                raise
            except RuntimeError:
                call.cancel()
                raise
        reply = assembler.finish(names)
        return PulledTensors(reply.tensors.items(), version=reply.version,
                             steps={i.name: int(i.step) for i in reply.infos}, dtype=wire)
