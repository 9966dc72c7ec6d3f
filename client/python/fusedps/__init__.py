"""fusedps: Python client of the fusedps parameter-update service.

The server keeps the fp32 master copy of named tensors and their AdamW state; trainers push
gradients (one atomic AdamW step per push) and pull parameters back. See fusedps.client.Client.

The generated gRPC stubs live in fusedps.v1 (parameter_service_pb2, parameter_service_pb2_grpc),
produced at build time beside this package in build/python: use PYTHONPATH=build/python.

fusedps.checkpoint converts server checkpoints to and from PyTorch state dicts
(docs/checkpoints.md); it is imported on first use (``fusedps.checkpoint`` or
``import fusedps.checkpoint``).

A model can be split over several servers: fusedps.plan computes which slice of which tensor
each server holds (docs/sharding.md), and fusedps.sharded.ShardedClient drives the servers.
"""

from fusedps.client import (
    Client,
    Consistency,
    ParamGroup,
    PulledTensors,
    PushResult,
    RegisterResult,
    ServerInfo,
    TensorInfo,
    TensorList,
)
from fusedps.plan import PlanSlice, ShardPlan, make_plan
from fusedps.sharded import PulledShards, ShardedClient, ShardedPushResult

__version__ = "0.1.0"


def __getattr__(name):
    # Submodules imported on first access, so that `import fusedps` stays light.
    if name == "checkpoint":
        import importlib

        return importlib.import_module("fusedps.checkpoint")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Client",
    "Consistency",
    "ParamGroup",
    "PlanSlice",
    "PulledShards",
    "PulledTensors",
    "PushResult",
    "RegisterResult",
    "ServerInfo",
    "ShardPlan",
    "ShardedClient",
    "ShardedPushResult",
    "TensorInfo",
    "TensorList",
    "make_plan",
    "checkpoint",
]
