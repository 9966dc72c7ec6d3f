"""fusedps: Python client of the fusedps parameter-update service.

The server keeps the fp32 master copy of named tensors and their AdamW state; trainers push
gradients (one atomic AdamW step per push) and pull parameters back.

* fusedps.torch.RemoteAdamW: a torch.optim.Optimizer that trains a model through fusedps
  servers, a drop-in for torch.optim.AdamW (imported on first use).
* fusedps.Client: one server; fusedps.ShardedClient: a model split over several servers, with
  fusedps.plan computing which slice of which tensor each holds (docs/sharding.md).
  fusedps.ParameterServiceClient: the typing.Protocol both satisfy (what RemoteAdamW uses).
* fusedps.errors: the exceptions, one per gRPC status code, under fusedps.FusedPSError.
* fusedps.checkpoint converts server checkpoints to and from PyTorch state dicts
  (docs/checkpoints.md); imported on first use.

The generated gRPC stubs live in fusedps.v1 (parameter_service_pb2, parameter_service_pb2_grpc),
generated when the package is built (pip install client/python, or make). torch and numpy are
imported only by the calls that move tensors, not by ``import fusedps``.
"""

from fusedps import errors
from fusedps.client import Client
from fusedps.errors import FusedPSError
from fusedps._protocol import ParameterServiceClient
from fusedps._push_transaction import PushTransaction
from fusedps.plan import PlanSlice, ShardPlan, make_plan
from fusedps.results import (Consistency, ModelDeleted, ModelInfo, ParamGroup, PulledTensors,
                             PushResult, RegisterResult, ServerInfo, TensorInfo, TensorList)
from fusedps.sharded import PulledShards, ShardedClient, ShardedPushResult

__version__ = "0.2.0"

# Submodules imported on first access, so that `import fusedps` stays light (no torch).
_LAZY_SUBMODULES = ("checkpoint", "torch")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"fusedps.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Client",
    "Consistency",
    "FusedPSError",
    "ModelDeleted",
    "ModelInfo",
    "ParamGroup",
    "ParameterServiceClient",
    "PlanSlice",
    "PulledShards",
    "PulledTensors",
    "PushResult",
    "PushTransaction",
    "RegisterResult",
    "ServerInfo",
    "ShardPlan",
    "ShardedClient",
    "ShardedPushResult",
    "TensorInfo",
    "TensorList",
    "make_plan",
    "errors",
    "checkpoint",
    "torch",
]
