"""fusedps.Client's calls about the server rather than tensor data: param groups, server and
model facts, models, checkpoints and the tensor listing. Internal module: Client (fusedps/client.py)
inherits them; their docstrings are Client's documentation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from fusedps import _dtypes, _models, _replies, errors
from fusedps import _hyperparameters as _hp
from fusedps._requests import _hyperparameters, checked_group_hyperparameters
from fusedps.results import (Consistency, ModelDeleted, ModelInfo, ParamGroup, ServerInfo,
                             TensorInfo, TensorList)
from fusedps.v1 import parameter_service_pb2 as pb


@errors.translate_public_methods
class AdminCalls:
    """Client's param group, facts and model calls (unary calls on Client's channel)."""

    if TYPE_CHECKING:  # Client's, set by its __init__.
        model: str
        _stub: Any

        def _timeout(self, payload_bytes: int = 0) -> Optional[float]: ...

    # -- param groups ---------------------------------------------------------------------------

    def register_param_group(self, name: str, lr: Optional[float] = None,
                             betas: Optional[Tuple[float, float]] = None,
                             eps: Optional[float] = None, weight_decay: Optional[float] = None,
                             amsgrad: Optional[bool] = None, maximize: Optional[bool] = None,
                             decoupled_weight_decay: bool = True, *,
                             state_dtype: Optional[str] = None,
                             params_dtype: Optional[str] = None,
                             rounding_seed: Optional[int] = None, **more: Any) -> ParamGroup:
        """Registers a param group (a set of AdamW hyperparameters shared by tensors).

        Arguments left None take torch.optim.AdamW's defaults on the server (lr 1e-3,
        betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2, amsgrad False, maximize False) and
        fp32 storage. decoupled_weight_decay=False selects L2 decay, as torch.optim.Adam's
        weight_decay. Registering an identical group again is a no-op.

        Storage, fixed at registration as amsgrad is (docs/python.md, "Low-precision
        optimizer state"); each step's math is fp32 whatever the storage. Each dtype takes
        either spelling: "fp32" or "float32", "bf16" or "bfloat16":
          state_dtype: "fp32" (None: the default; 12 bytes per parameter with fp32 params),
            "bf16" (exp_avg and exp_avg_sq rounded to nearest even: 8) or "int8" (block-wise
            dynamic quantization, an fp32 scale per 256 elements: 6.03; an embedding table's
            blocks are its rows, a scale per row; tensors under 4096 elements keep fp32
            state, as TensorInfo.state_dtype says). Not with amsgrad.
          params_dtype: "fp32" (None: the default, the fp32 master copy) or "bf16": bf16
            params only (2 bytes less per parameter), each step's fp32 result rounded to bf16
            stochastically; pulls return the bf16 values exactly.
          rounding_seed: that rounding's seed, an int in [0, 2**64) (None: 0). Its random bits
            depend only on (rounding_seed, the tensor's name, its step, the element's index),
            so replaying the same pushes, or restoring a checkpoint, gives the same bits.

        Any other field of proto fusedps.v1.Hyperparameters may be given by its name in
        ``more`` (a knob newer than this signature).

        Returns:
          The group as stored, with defaults filled in (ParamGroup).
        Raises:
          ValueError (before any call): a state_dtype, params_dtype or rounding_seed not
            listed above, or amsgrad with a state_dtype other than "fp32".
          TypeError (before any call): a name in ``more`` that is no hyperparameter.
          FusedPSError: INVALID_ARGUMENT for out-of-range values or a bad name (1..128 bytes);
            ALREADY_EXISTS when a different group of that name exists (other storage
            included).
        """
        hyperparameters = checked_group_hyperparameters(
            lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay,
            state_dtype, params_dtype, rounding_seed, **more)
        req = pb.RegisterParamGroupRequest(model=self.model, param_group=pb.ParamGroup(
            name=name, hyperparameters=hyperparameters))
        resp = self._stub.RegisterParamGroup(req, timeout=self._timeout())
        return ParamGroup._from_pb(resp.param_group)

    def set_hyperparameters(self, group: str, *, lr: Optional[float] = None,
                            betas: Optional[Tuple[float, float]] = None,
                            eps: Optional[float] = None, weight_decay: Optional[float] = None,
                            maximize: Optional[bool] = None,
                            decoupled_weight_decay: Optional[bool] = None,
                            **more: Any) -> ParamGroup:
        """Changes hyperparameters of a group at run time (e.g. an lr schedule).

        Only the arguments given change; the next push uses the new values (like assigning
        ``optimizer.param_groups[i]["lr"]``). amsgrad and the storage (state_dtype,
        params_dtype, rounding_seed) cannot change. Any other field of proto
        fusedps.v1.Hyperparameters may be given by its name in ``more`` (TypeError for a name
        that is none).

        Returns:
          The group after the change (ParamGroup).
        Raises:
          TypeError (before any call): a name in ``more`` that is no hyperparameter, or
            one fixed at registration.
          FusedPSError: NOT_FOUND for an unknown group, INVALID_ARGUMENT for bad values.
        """
        fixed = sorted(set(more) & {"amsgrad", *_hp.STORAGE})
        if fixed:
            raise TypeError(f"set_hyperparameters() cannot change {', '.join(fixed)}: fixed "
                            "at registration")
        req = pb.SetHyperparametersRequest(
            model=self.model,
            param_group=group,
            hyperparameters=_hyperparameters(lr, betas, eps, weight_decay, None, maximize,
                                             decoupled_weight_decay, **more))
        resp = self._stub.SetHyperparameters(req, timeout=self._timeout())
        return ParamGroup._from_pb(resp.param_group)

    # -- facts and models -----------------------------------------------------------------------

    def info(self) -> ServerInfo:
        """Server and model facts: version, backend, device, counts, param groups, limits,
        memory (ServerInfo)."""
        r = self._stub.GetInfo(pb.GetInfoRequest(model=self.model), timeout=self._timeout())
        return ServerInfo(
            version=int(r.version), backend=r.backend, device=r.device,
            tensor_count=int(r.tensor_count), parameter_count=int(r.parameter_count),
            param_groups=tuple(ParamGroup._from_pb(g) for g in r.param_groups),
            server_version=r.server_version, max_message_bytes=int(r.max_message_bytes),
            param_copy_dtype=_dtypes.WIRE_NAMES.get(r.param_copy_dtype),
            consistency=(Consistency._from_pb(r.consistency) if r.HasField("consistency")
                         else None),
            plan_hash=r.plan_hash, model=r.model, memory_bytes=int(r.memory_bytes),
            server_memory_bytes=int(r.server_memory_bytes), model_count=int(r.model_count),
            buffer_count=int(r.buffer_count), buffer_bytes=int(r.buffer_bytes))

    def server_infos(self) -> List[ServerInfo]:
        """[info()]: the list of one ServerInfo that ShardedClient.server_infos gives per shard
        (fusedps.ParameterServiceClient)."""
        return [self.info()]

    def create_model(self, name: str, *, mode: Optional[str] = None,
                     replicas_to_aggregate: int = 1, total_replicas: int = 1,
                     round_timeout_seconds: float = 30.0, max_staleness: int = 0,
                     staleness_lr_scaling: bool = False) -> Tuple[bool, ModelInfo]:
        """Creates an empty model ``name`` on the server (docs/api.md, "Models"), with a
        consistency mode of its own ("async", "sync", "bounded", with the options of
        docs/consistency.md), or the server's flags' for mode None. Returns (created, its
        ModelInfo); created is False when it existed with the same consistency (a no-op, so
        that every trainer of a job may create it). Not implied by ``model``.

        Raises:
          ValueError: an unknown mode.
          fusedps.errors.InvalidArgument: a bad name (1-64 of [a-z0-9._-]) or consistency.
          fusedps.errors.AlreadyExists: the model exists with another consistency.
          fusedps.errors.PermissionDenied: a token that is not admin (of that model).
        """
        consistency = _models.consistency_request(mode, replicas_to_aggregate, total_replicas,
                                                  round_timeout_seconds, max_staleness,
                                                  staleness_lr_scaling)
        return _models.create(self._stub, name, consistency, self._timeout())

    def list_models(self) -> List[ModelInfo]:
        """The server's models that this client's token may reach, by name (ModelInfo)."""
        return _models.list_all(self._stub, self._timeout())

    def delete_model(self, name: str, timeout: Optional[float] = 60.0) -> ModelDeleted:
        """Deletes model ``name``: its tensors, state, device memory and checkpoints, durably
        (a restart does not bring it back). Calls naming it then raise NotFound; deleting
        "default" empties it. Waits up to ``timeout`` seconds for calls in flight to let go of
        the model's memory (ModelDeleted.memory_freed says whether they did).

        Raises:
          fusedps.errors.NotFound: no such model.
          fusedps.errors.PermissionDenied: a token that is not admin (of that model).
        """
        return _models.delete(self._stub, name, timeout)

    def checkpoint(self, timeout: Optional[float] = 600.0) -> Tuple[int, str]:
        """Has the server write a checkpoint holding every push acknowledged before this call,
        and returns ``(version, path)``: the shard version it holds and its directory on the
        server. Blocks until the checkpoint is durable (``timeout`` seconds at most).

        Raises:
          FusedPSError: FAILED_PRECONDITION (the server has no --checkpoint-dir),
            RESOURCE_EXHAUSTED (its disk is full), UNAVAILABLE, DEADLINE_EXCEEDED.
        """
        r = self._stub.Checkpoint(pb.CheckpointRequest(model=self.model), timeout=timeout)
        return int(r.version), r.path

    def list_tensors(self) -> TensorList:
        """Every registered tensor (TensorInfo: name, shape, group, step, numel, and its
        storage: params_dtype, state_dtype), with ``.version``. The server returns a large
        shard in pages; this reads them all, each page a call with a deadline of its own.

        Raises:
          RuntimeError: the server repeated a page token (a listing that would never end).
        """
        version, infos = _replies.list_pages(
            lambda request: self._stub.ListTensors(request, timeout=self._timeout()),
            model=self.model)
        return TensorList((TensorInfo._from_pb(t) for t in infos), version)
