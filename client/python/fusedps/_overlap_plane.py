"""RemoteAdamW(overlap=True)'s choice of data plane (DataPlane, which OverlapEngine inherits):
a device workspace, a host one, or gRPC (the engine's data_plane argument; docs/python.md,
"Same-host workspaces" and "Device workspaces"). Internal module of fusedps/_overlap.py.
Runs once, in the engine's constructor, on the thread that makes the optimizer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from fusedps import _dtypes, _workspace

__all__ = ["DataPlane"]

_logger = logging.getLogger("fusedps.torch")  # RemoteAdamW's.


class DataPlane:
    """OverlapEngine's choice of data plane (the module docstring)."""

    if TYPE_CHECKING:  # OverlapEngine's, set by its __init__ before the choice.
        device: torch.device
        data_plane_reason: str
        _route: Any
        _numel: List[int]
        _delay: int
        _wire_dtype: torch.dtype
        _cuda: bool

    def _open_workspace(self, data_plane: str, pull_dtype: str,
                        stored_dtype: Optional[str]):
        """The step's buffers in a same-host workspace, when data_plane allows one and the
        params live on one server that gives one: a device workspace ("device", or "auto" on a
        GPU when the server can pull into it: _device_pull_refused), else a host one
        ("workspace", "auto"); else None. data_plane_reason says why not the first kind tried
        ("" when it was had)."""
        if data_plane == "grpc":
            self.data_plane_reason = "data_plane='grpc'"
            return None
        if len(self._route.clients) != 1:
            self.data_plane_reason = "a workspace is used with one server only"
            return self._no_workspace(data_plane)
        client = self._route.clients[0]
        # The push's buffers (two with delay=1) and the pull's.
        total = sum(self._numel)
        buffers = [(total, self._wire_dtype)] * (2 if self._delay else 1)
        buffers.append((total, _dtypes.torch_dtype(pull_dtype)))
        nbytes = _workspace.needed_bytes(buffers)
        device_reason = ""
        if data_plane == "device" or (data_plane == "auto" and self._cuda):
            device_reason = _device_pull_refused(client, pull_dtype, stored_dtype)
            if not device_reason:
                workspace, device_reason = _workspace.open_workspace(
                    client, nbytes, pin=False, memory="device", device=self.device)
                if workspace is not None:
                    self.data_plane_reason = ""
                    return workspace
            self.data_plane_reason = f"no device workspace: {device_reason}"
            if data_plane == "device":
                raise RuntimeError(f"data_plane='device': {self.data_plane_reason}")
            _logger.info("RemoteAdamW: no device workspace, trying a host one: %s",
                         device_reason)
        workspace, host_reason = _workspace.open_workspace(client, nbytes, pin=self._cuda)
        if workspace is not None:
            self.data_plane_reason = f"no device workspace: {device_reason}" if (
                device_reason) else ""
            return workspace
        self.data_plane_reason = (f"no device workspace: {device_reason}; no workspace: "
                                  f"{host_reason}" if device_reason else host_reason)
        return self._no_workspace(data_plane)

    def _no_workspace(self, data_plane: str) -> None:
        """None (gRPC), logged, or RuntimeError when data_plane asked for a workspace."""
        if data_plane in ("workspace", "device"):
            raise RuntimeError(f"data_plane={data_plane!r}: no workspace "
                               f"({self.data_plane_reason})")
        _logger.info("RemoteAdamW: gradients and parameters go over gRPC: %s",
                     self.data_plane_reason)
        return None


def _device_pull_refused(client: Any, pull_dtype: str, stored_dtype: Optional[str]) -> str:
    """Why the server would refuse pulls in ``pull_dtype`` into a device workspace, or "": it
    writes there what its read gives, rounding nothing (server/service/pull_reactor.cc): fp32
    params in fp32, or its 16-bit param copy (--param-copy-dtype, which it keeps of fp32 params
    only; GetInfo says which) in that dtype. A bf16 pull of bf16 params goes through fp32 and is
    rounded on the host, so it is refused; params stored otherwise are left to a host
    workspace."""
    if stored_dtype != "float32":
        return (f"the server stores the params in {stored_dtype or 'more than one dtype'}; a "
                f"device workspace takes pulls of fp32 params only")
    if pull_dtype == "float32":
        return ""
    try:
        copy = client.info().param_copy_dtype
    except Exception:  # noqa: BLE001 - then as a server without a copy
        copy = None
    if pull_dtype == copy:
        return ""
    return (f"a {pull_dtype} pull into a device workspace reads the server's param copy, and "
            f"this server keeps {copy or 'none'} (--param-copy-dtype)")
