"""fusedps.ParameterServiceClient: the one shape of fusedps.Client (one server) and
fusedps.ShardedClient (a model cut over several servers), as fusedps.torch.RemoteAdamW uses
them.

Code written against this Protocol works with either client without asking which it has::

    from fusedps import ParameterServiceClient

    def lr_of(client: ParameterServiceClient, group: str) -> float:
        infos = client.server_infos()          # one ServerInfo per server, in shard order
        return next(g.lr for g in infos[0].param_groups if g.name == group)

Where the two differ by nature (one server or several), the Protocol promises only what both
give: results RemoteAdamW does not read are ``object``; a push's result is a PushResult or a
ShardedPushResult (both have ``step_skipped``); pull_state's version is one int or a list per
shard. Both classes are checked against it: by mypy (the assignments at the end of this file)
and by client/python/tests/test_protocol.py (their method signatures).
"""

from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Protocol, Tuple, Union,
                    runtime_checkable)

if TYPE_CHECKING:
    import torch

    from fusedps._requests import ModelLike
    from fusedps.client import Client
    from fusedps.results import PushResult, ServerInfo
    from fusedps.sharded import ShardedClient, ShardedPushResult

__all__ = ["ParameterServiceClient"]


@runtime_checkable
class ParameterServiceClient(Protocol):
    """What fusedps.Client and fusedps.ShardedClient both offer, with one signature each.

    Each method is documented on Client; ShardedClient does the same on every shard that holds
    a slice of the tensors named (docs/sharding.md).
    """

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until every server answers."""
        ...

    def close(self) -> None:
        """Closes the channels. Idempotent."""
        ...

    def server_infos(self) -> List["ServerInfo"]:
        """Each server's ServerInfo, in shard order (a Client's list holds one)."""
        ...

    def register_param_group(self, name: str, *, lr: Optional[float] = None,
                             betas: Optional[Tuple[float, float]] = None,
                             eps: Optional[float] = None, weight_decay: Optional[float] = None,
                             amsgrad: Optional[bool] = None, maximize: Optional[bool] = None,
                             decoupled_weight_decay: bool = True,
                             state_dtype: Optional[str] = None,
                             params_dtype: Optional[str] = None,
                             rounding_seed: Optional[int] = None, **more: Any) -> object:
        """Registers a param group (on every server)."""
        ...

    def set_hyperparameters(self, group: str, *, lr: Optional[float] = None,
                            betas: Optional[Tuple[float, float]] = None,
                            eps: Optional[float] = None, weight_decay: Optional[float] = None,
                            maximize: Optional[bool] = None,
                            decoupled_weight_decay: Optional[bool] = None,
                            **more: Any) -> object:
        """Changes a group's hyperparameters (on every server)."""
        ...

    def register_model(self, model_or_named_params: "ModelLike",
                       param_group: Union[str, Mapping[str, str]] = "default") -> object:
        """Registers tensors with their initial values: every one in ``param_group``, or each
        in the group a mapping name -> group gives it ("default" for names it lacks)."""
        ...

    def push_gradients(self, model_or_dict: "ModelLike", *, grad_dtype=None,
                       grad_scale: Optional[float] = None
                       ) -> Union["PushResult", "ShardedPushResult"]:
        """Pushes the gradients (one AdamW step on each server that holds some)."""
        ...

    def pull_parameters(self, model_or_names=None, dtype="float32", *,
                        prefix: str = "") -> Mapping[str, "torch.Tensor"]:
        """Pulls parameters, name -> CPU tensor; into the given tensors, in place, too."""
        ...

    def pull_state(self, field: str = "exp_avg", names=None, *, prefix: str = ""
                   ) -> Tuple[Dict[str, "torch.Tensor"], Union[int, List[Optional[int]]],
                              Dict[str, int]]:
        """(name -> fp32 CPU tensor of ``field``, the version(s) read, name -> steps)."""
        ...

    def load_state(self, states: Mapping[str, Mapping[str, "torch.Tensor"]],
                   steps: Mapping[str, int]) -> object:
        """Overwrites params, AdamW state and steps (all or nothing on each server)."""
        ...

    def write_buffers(self, buffers, *, prefix: str = "") -> int:
        """Writes the model's buffers; returns the version of the server that keeps them."""
        ...

    def pull_buffers(self, buffers=None, *, prefix: str = "") -> Dict[str, "torch.Tensor"]:
        """The model's buffers (copied into the given ones, in place, too)."""
        ...

    def create_model(self, name: str) -> object:
        """Creates model ``name`` (on every server) with the servers' consistency flags."""
        ...

    def delete_model(self, name: str, timeout: Optional[float] = 60.0) -> object:
        """Deletes model ``name`` (on every server)."""
        ...


if TYPE_CHECKING:
    # mypy checks that both classes satisfy the Protocol (scripts/check_python.sh).
    def _both_conform(one: Client, sharded: ShardedClient) -> List[ParameterServiceClient]:
        return [one, sharded]
