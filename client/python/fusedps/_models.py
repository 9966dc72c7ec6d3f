"""Models, the server's namespaces (docs/api.md, "Models"): create, list, delete.

The calls Client.create_model, list_models and delete_model make (and ShardedClient's, on
every shard). Each model is a shard of its own on the server: its tensors, param groups,
version, consistency mode, sync rounds, sharding plan, retry table and checkpoints.
"""
from __future__ import annotations

from typing import List, Optional

from fusedps.results import ModelDeleted, ModelInfo
from fusedps.v1 import parameter_service_pb2 as pb

_MODES = {"async": pb.CONSISTENCY_MODE_ASYNC, "sync": pb.CONSISTENCY_MODE_SYNC,
          "bounded": pb.CONSISTENCY_MODE_BOUNDED}


def consistency_request(mode: Optional[str], replicas_to_aggregate: int, total_replicas: int,
                        round_timeout_seconds: float, max_staleness: int,
                        staleness_lr_scaling: bool) -> Optional["pb.Consistency"]:
    """The CreateModelRequest.consistency of these options; None for mode None (the server's
    flags).

    Raises:
      ValueError: a mode other than "async", "sync" and "bounded".
    """
    if mode is None:
        return None
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)} or None, got {mode!r}")
    return pb.Consistency(mode=_MODES[mode], replicas_to_aggregate=int(replicas_to_aggregate),
                          total_replicas=int(total_replicas),
                          round_timeout_seconds=float(round_timeout_seconds),
                          max_staleness=int(max_staleness),
                          staleness_lr_scaling=bool(staleness_lr_scaling))


def create(stub, name: str, consistency: Optional["pb.Consistency"],
           timeout: Optional[float]) -> "tuple[bool, ModelInfo]":
    """CreateModel: (created, the model)."""
    request = pb.CreateModelRequest(name=name)
    if consistency is not None:
        request.consistency.CopyFrom(consistency)
    r = stub.CreateModel(request, timeout=timeout)
    return bool(r.created), ModelInfo._from_pb(r.model)


def list_all(stub, timeout: Optional[float]) -> List[ModelInfo]:
    """ListModels: the models the caller may reach, by name."""
    return [ModelInfo._from_pb(m)
            for m in stub.ListModels(pb.ListModelsRequest(), timeout=timeout).models]


def delete(stub, name: str, timeout: Optional[float]) -> ModelDeleted:
    """DeleteModel."""
    r = stub.DeleteModel(pb.DeleteModelRequest(name=name), timeout=timeout)
    return ModelDeleted(int(r.freed_bytes), bool(r.memory_freed))
