"""The torch peer's store and wire helpers (bench/peers/torch_peer.py, whose docstring says what
the peer does): param groups with their torch optimizer, tensors, and the chunks of a call's
stream copied into tensors. Imported by torch_peer.py from beside it.
"""

from __future__ import annotations

import inspect
import itertools
import math

import grpc
import torch

from fusedps.v1 import parameter_service_pb2 as pb


class RpcError(Exception):
    """An expected error; the handler turns it into the reply's status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _rpc(handler):
    """Wraps a servicer method so that RpcError becomes the call's status."""

    def wrapper(self, request, context):
        try:
            return handler(self, request, context)
        except RpcError as e:
            context.abort(e.code, str(e))

    wrapper.__name__ = handler.__name__
    return wrapper


def _with_defaults(h: pb.Hyperparameters) -> pb.Hyperparameters:
    """A copy of h with torch.optim.AdamW's defaults in every unset field."""
    out = pb.Hyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                             amsgrad=False, maximize=False,
                             weight_decay_mode=pb.WEIGHT_DECAY_MODE_DECOUPLED)
    out.MergeFrom(h)
    if out.weight_decay_mode == pb.WEIGHT_DECAY_MODE_UNSPECIFIED:
        out.weight_decay_mode = pb.WEIGHT_DECAY_MODE_DECOUPLED
    return out


def _check_hyperparameters(h: pb.Hyperparameters) -> None:
    if not (math.isfinite(h.lr) and h.lr >= 0):
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"lr = {h.lr} must be finite and >= 0")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(h, name) < 1:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be in [0, 1)")
    if not (h.eps >= 0 and h.weight_decay >= 0):
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "eps and weight_decay must be >= 0")


class _Group:
    """A param group: its hyperparameters, its tensors and the torch optimizer over them."""

    def __init__(self, name: str, hyperparameters: pb.Hyperparameters, device: torch.device):
        self.name = name
        self.hyperparameters = hyperparameters
        self.device = device
        self.params = []
        self.optimizer = None  # Made with the first tensor: torch refuses an empty list.

    def add_params(self, params) -> None:
        self.params.extend(params)
        if self.optimizer is None:
            self.optimizer = self._make_optimizer(self.params)
        else:
            # Optimizer state is created lazily, at a param's first step.
            self.optimizer.param_groups[0]["params"].extend(params)

    def set_hyperparameters(self, update: pb.Hyperparameters) -> None:
        h = pb.Hyperparameters()
        h.CopyFrom(self.hyperparameters)
        h.MergeFrom(update)
        _check_hyperparameters(h)
        if update.HasField("amsgrad") and update.amsgrad != self.hyperparameters.amsgrad:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "amsgrad cannot change")
        switch_class = h.weight_decay_mode != self.hyperparameters.weight_decay_mode
        self.hyperparameters = h
        if self.optimizer is None:
            return
        if switch_class:  # AdamW <-> Adam: same state, other update rule.
            old = self.optimizer
            self.optimizer = self._make_optimizer(self.params)
            self.optimizer.state.update(old.state)
        else:
            group = self.optimizer.param_groups[0]
            group.update(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                         weight_decay=h.weight_decay, maximize=h.maximize)

    def _make_optimizer(self, params):
        h = self.hyperparameters
        decoupled = h.weight_decay_mode != pb.WEIGHT_DECAY_MODE_L2
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        kwargs = dict(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay,
                      amsgrad=h.amsgrad, maximize=h.maximize)
        if self.device.type == "cuda" and "fused" in inspect.signature(cls).parameters:
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
        return cls(list(params), **kwargs)


class _Tensor:
    def __init__(self, spec: pb.TensorSpec, group: _Group, param: torch.Tensor):
        self.name = spec.name
        self.shape = tuple(spec.shape)
        self.numel = param.numel()
        self.group = group
        self.param = param
        self.step = 0

    def info(self) -> pb.TensorInfo:
        return pb.TensorInfo(name=self.name, shape=self.shape, param_group=self.group.name,
                             step=self.step, numel=self.numel)


def _empty(shapes, dtype: torch.dtype, device: torch.device):
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in shapes.items()}


def _receive(first, rest, shapes, dtype: torch.dtype, device: torch.device, required=None):
    """Copies the chunks of a client stream into new tensors of ``shapes`` (name -> shape).

    ``first`` is the stream's first message (its header already read), ``rest`` the others.
    Returns (name -> tensor in ``dtype`` on ``device``, payload bytes). Every element of the
    tensors named in ``required`` (default: all) must arrive; chunks of names not in ``shapes``,
    bad sizes and a second header are INVALID_ARGUMENT.
    """
    tensors = _empty(shapes, dtype, device)
    received, nbytes = _receive_into(tensors, first, rest)
    _check_received(tensors, received, required)
    return tensors, nbytes


def _receive_into(tensors, first, rest):
    """Copies the chunks of a client stream into ``tensors`` (name -> tensor).

    Returns (name -> elements received, payload bytes); raises as _receive does.
    """
    flat = {name: t.view(-1) for name, t in tensors.items()}
    received = dict.fromkeys(tensors, 0)
    nbytes = 0
    for i, message in enumerate(itertools.chain([first], rest)):
        if i > 0 and message.HasField("header"):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "header in a later message")
        for chunk in message.chunks:
            dst = flat.get(chunk.tensor)
            if dst is None:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"chunk for tensor '{chunk.tensor}' that this call does not name")
            size = len(chunk.data)
            itemsize = dst.element_size()
            if size % itemsize or chunk.offset + size // itemsize > dst.numel():
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"chunk of '{chunk.tensor}' at {chunk.offset}: bad size {size}")
            if size:
                n = size // itemsize
                dst[chunk.offset:chunk.offset + n].copy_(
                    torch.frombuffer(chunk.data, dtype=dst.dtype))
                received[chunk.tensor] += n
                nbytes += size
    return received, nbytes


def _check_received(tensors, received, required=None):
    """INVALID_ARGUMENT unless every element of the tensors in ``required`` (default: all)
    arrived (``received``: name -> element count)."""
    for name in tensors if required is None else required:
        if received[name] != tensors[name].numel():
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"tensor '{name}': received "
                           f"{received[name]} of {tensors[name].numel()} elements")


def _to_fp32(grads, grad_scale):
    """fp32 gradients, divided by grad_scale (None: 1). Reuses fp32 tensors."""
    grads = {name: g.float() for name, g in grads.items()}  # No copy when already fp32.
    if grad_scale is not None:
        for g in grads.values():
            g.div_(grad_scale)
    return grads


class _PushInParts:
    """A push that travels as several calls (PushHeader.part_count > 1): what its parts share.

    Guarded by TorchPeer._parts.
    """

    def __init__(self, header: pb.PushHeader, tensors, dtype: torch.dtype, device: torch.device):
        self.header = header  # The first part's, without part_index.
        self.tensors = tensors
        self.grads = _empty({t.name: t.shape for t in tensors}, dtype, device)
        self.received = dict.fromkeys(self.grads, 0)  # Elements, summed over the parts.
        self.nbytes = 0
        self.joined = set()  # part_index of every part that has arrived.
        self.ended = 0  # Parts whose stream ended well.
        self.over = False  # Failed, or being applied: no part can fail it any more.
        self.response = None  # The reply of every part, once applied.
        self.error = None  # Why it failed, once failed.
        self.failed_at = 0.0


def _without_part_index(header: pb.PushHeader) -> pb.PushHeader:
    h = pb.PushHeader()
    h.CopyFrom(header)
    h.ClearField("part_index")
    return h
