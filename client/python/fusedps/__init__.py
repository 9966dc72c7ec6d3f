"""fusedps: Python client of the fusedps parameter-update service.

The server keeps the fp32 master copy of named tensors and their AdamW state; trainers push
gradients (one atomic AdamW step per push) and pull parameters back. See fusedps.client.Client.

The generated gRPC stubs live in fusedps.v1 (parameter_service_pb2, parameter_service_pb2_grpc),
produced at build time beside this package in build/python: use PYTHONPATH=build/python.
"""

from fusedps.client import (
    Client,
    ParamGroup,
    PulledTensors,
    PushResult,
    RegisterResult,
    ServerInfo,
    TensorInfo,
    TensorList,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "ParamGroup",
    "PulledTensors",
    "PushResult",
    "RegisterResult",
    "ServerInfo",
    "TensorInfo",
    "TensorList",
]
