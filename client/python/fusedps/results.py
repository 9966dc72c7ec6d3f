"""The values the fusedps client returns: param groups, push and registration results, tensor
listings, pulled tensors and server facts. Re-exported by fusedps.client and fusedps.

Plain data, built from the protobuf replies; nothing here talks to the network or imports
torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

from fusedps import _dtypes
from fusedps import _hyperparameters as _hp
from fusedps.v1 import parameter_service_pb2 as pb

__all__ = ["ParamGroup", "RegisterResult", "PushResult", "TensorInfo", "TensorList",
           "PulledTensors", "Consistency", "ServerInfo"]



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
      state_dtype: how exp_avg and exp_avg_sq are stored: "fp32", "bf16" or "int8" (its
        tensors under 4096 elements keep fp32 state; TensorInfo.state_dtype).
      params_dtype: "fp32" (the fp32 master copy) or "bf16" (stochastic rounding).
      rounding_seed: the seed of the stochastic rounding of bf16 params.
    The storage fields are fixed at registration (Client.register_param_group). A field the
    server left unset is None (a server older than the storage fields leaves them unset).
    """

    name: str
    lr: Optional[float]
    betas: Tuple[Optional[float], Optional[float]]
    eps: Optional[float]
    weight_decay: Optional[float]
    amsgrad: Optional[bool]
    maximize: Optional[bool]
    decoupled_weight_decay: Optional[bool]
    state_dtype: Optional[str] = None
    params_dtype: Optional[str] = None
    rounding_seed: Optional[int] = None

    @classmethod
    def _from_pb(cls, g: "pb.ParamGroup") -> "ParamGroup":
        fields: Dict[str, Any] = {"betas": (None, None), **_hp.from_proto(g.hyperparameters)}
        values: Dict[str, Any] = {f.name: fields.get(f.name) for f in dataclasses.fields(cls)
                                  if f.name != "name"}
        return cls(name=g.name, **values)


def _state_dtype_name(value: int) -> str:
    """"fp32", "bf16" or "int8" of a proto StateDType (UNSPECIFIED is fp32); another value
    (from a newer server) as "unknown(<number>)"."""
    return _dtypes.storage_name(value, _dtypes.STATE_NAMES)


def _params_dtype_name(value: int) -> str:
    """"fp32" or "bf16" of a proto DType (UNSPECIFIED is fp32); another as "unknown(<n>)"."""
    return _dtypes.storage_name(value, _dtypes.WIRE_NAMES)


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
      round_timed_out: sync mode: the round closed by its timeout with fewer than K pushes.
      missing_replicas: then, the client_ids it waited for in vain (those that pushed to one
        of the server's last 8 rounds but not to this one: a trainer that died or is stuck).
      pulled_version: the version a commit's pull read (PushTransaction.commit's then_pull);
        0 when the commit carried none, or when the server answered from its retry table
        (nothing was written: pull again).
    """

    version: int
    step_skipped: bool
    skip_reason: str
    tensors_updated: int
    grad_bytes: int
    duplicate: bool
    round_workers: int = 0
    round_timed_out: bool = False
    missing_replicas: Tuple[str, ...] = ()
    pulled_version: int = 0

    @classmethod
    def _from_pb(cls, r) -> "PushResult":
        """From a PushGradientsResponse."""
        return cls(int(r.version), bool(r.step_skipped), r.skip_reason, int(r.tensors_updated),
                   int(r.grad_bytes), bool(r.duplicate), int(r.round_workers),
                   bool(r.round_timed_out), tuple(r.missing_replicas), int(r.pulled_version))

    @classmethod
    def _from_native(cls, r) -> "PushResult":
        """From the C ABI's fusedps_push_result (fusedps._native)."""
        missing = r.missing_replicas.decode("utf-8", "replace")
        return cls(int(r.version), bool(r.step_skipped), r.skip_reason.decode("utf-8", "replace"),
                   int(r.tensors_updated), int(r.grad_bytes), bool(r.duplicate),
                   int(r.round_workers), bool(r.round_timed_out),
                   tuple(missing.split(",")) if missing else (), int(r.pulled_version))


@dataclass(frozen=True)
class TensorInfo:
    """One registered tensor: name, shape (tuple of ints; () for 0-dim), param group, the number
    of optimizer steps applied to it, its element count, and how the server stores it:
    params_dtype ("fp32" or "bf16", its group's) and state_dtype ("fp32", "bf16" or "int8":
    its group's, except "fp32" for a tensor under 4096 elements in an int8 group). A server
    older than the storage fields reports "fp32" (all it stores). table: an embedding table
    (Client.register_table), of shape (rows, dim); hashed: a table with hashed keys
    (Client.register_hashed_table), of shape (capacity, dim), with its initializer's
    table_seed and table_init_std (0 for other tensors)."""

    name: str
    shape: Tuple[int, ...]
    param_group: str
    step: int
    numel: int
    params_dtype: str = "fp32"
    state_dtype: str = "fp32"
    table: bool = False
    hashed: bool = False
    table_seed: int = 0
    table_init_std: float = 0.0

    @classmethod
    def _from_pb(cls, t: "pb.TensorInfo") -> "TensorInfo":
        options = t.table_options
        return cls(t.name, tuple(int(d) for d in t.shape), t.param_group, int(t.step),
                   int(t.numel), _params_dtype_name(t.params_dtype),
                   _state_dtype_name(t.state_dtype), bool(t.table), bool(options.hashed),
                   int(options.seed), float(options.init_std))


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
      model: the model these facts are about (the client's; the fields above but backend,
        device, server_version, max_message_bytes and param_copy_dtype are the model's).
      memory_bytes: device memory the model holds (host memory on the CPU backend), in bytes.
      server_memory_bytes: device memory the whole server holds (every model and the staging).
      model_count: models on the server.
      buffer_count, buffer_bytes: the model's buffers (Client.write_buffers) and their bytes
        (host memory, not in memory_bytes).
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
    model: str = ""
    memory_bytes: int = 0
    server_memory_bytes: int = 0
    model_count: int = 0
    buffer_count: int = 0
    buffer_bytes: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """A model on a server (ListModels, CreateModel): its name, version, tensor_count,
    parameter_count, consistency (Consistency), memory_bytes (device memory it holds) and
    plan_hash ("" when unsharded)."""

    name: str
    version: int
    tensor_count: int
    parameter_count: int
    consistency: Consistency
    memory_bytes: int
    plan_hash: str

    @classmethod
    def _from_pb(cls, m: "pb.ModelInfo") -> "ModelInfo":
        return cls(m.name, int(m.version), int(m.tensor_count), int(m.parameter_count),
                   Consistency._from_pb(m.consistency), int(m.memory_bytes), m.plan_hash)


@dataclass(frozen=True)
class ModelDeleted:
    """What delete_model freed: freed_bytes (the device memory the model held) and
    memory_freed (False when calls in flight still held the model at the deadline: its memory
    is freed once they are done)."""

    freed_bytes: int
    memory_freed: bool
