"""fusedps.torch.RemoteAdamW's state_dict, load_state_dict and write_pending_state: the
optimizer state, kept on the server(s), in torch.optim.AdamW's state_dict format (the format's
helpers: fusedps/_remote_optim.py). Internal module; RemoteAdamW inherits StateDictMethods, and
their docstrings are its documentation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from fusedps import _remote_optim as ro

if TYPE_CHECKING:
    from fusedps._overlap import OverlapEngine
    from fusedps.client import Client
    from fusedps.sharded import ShardedClient


class StateDictMethods:
    """RemoteAdamW's optimizer state methods (before torch.optim.Optimizer in its bases, so
    that they replace torch's)."""

    if TYPE_CHECKING:  # RemoteAdamW's, set by its __init__.
        param_groups: List[Dict[str, Any]]
        client: Union[Client, ShardedClient]
        tensor_names: List[str]
        _overlap: Optional[OverlapEngine]
        _pending: Optional[ro.LoadedState]
        _params: List[torch.Tensor]
        _pairs: List[Tuple[str, torch.Tensor]]
        _group_of: List[int]
        _amsgrad: List[bool]

    def state_dict(self) -> Dict[str, Any]:
        """The optimizer's state in torch.optim.AdamW's format, read from the server(s).

        Returns:
          {"state": {index: {"step": 0-dim float32 tensor (CPU), "exp_avg": tensor,
          "exp_avg_sq": tensor, ["max_exp_avg_sq": tensor (amsgrad groups)]}},
          "param_groups": [{every key of this torch version's AdamW groups (from a real
          torch.optim.AdamW), plus the group's own keys, "params": [indices]}]}.
          Indices count the params over all groups in order, as torch numbers them (a param
          that appears again keeps the index torch gives it); state tensors have the param's
          shape, dtype and device. A param never stepped has no entry (as in torch). After a
          load_state_dict() not yet written (see there), the loaded state is returned.
        Raises:
          grpc.RpcError: from the server(s).

        The fields are read one after the other; read while no other trainer pushes to the
        same tensors, or the fields may come from different steps.
        """
        if self._overlap is not None:
            self._overlap.wait_parameters()  # The last commit in: the state is of that step.
        groups = ro.pack_groups(self.param_groups)
        index_of = ro.param_indices(self.param_groups)
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        if self._pending is not None:
            for position, entry in sorted(self._pending.entries.items()):
                param = self._params[position]
                state[index_of[id(param)]] = ro.state_entry(entry["step"], entry, param)
            return {"state": state, "param_groups": groups}
        fields: Dict[str, Dict[str, torch.Tensor]] = {}
        steps: Dict[str, int] = {}
        for field in ro.STATE_FIELDS:
            fields[field], steps = ro.pull_state(self.client, field, self.tensor_names)
        amsgrad_names = [n for i, n in enumerate(self.tensor_names)
                         if self._amsgrad[self._group_of[i]]]
        if amsgrad_names:
            fields[ro.AMSGRAD_FIELD], _ = ro.pull_state(self.client, ro.AMSGRAD_FIELD,
                                                        amsgrad_names)
        for name, param in self._pairs:
            if steps[name] > 0:
                entry = {f: values[name] for f, values in fields.items() if name in values}
                state[index_of[id(param)]] = ro.state_entry(steps[name], entry, param)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a torch.optim.AdamW state_dict (from torch.optim.AdamW or RemoteAdamW).

        Checks it at once and takes its hyperparameters into param_groups at once (as torch
        does: every saved group key but "params"; foreach/fused/capturable/differentiable keep
        this optimizer's values; saved "param_names" are not used, params are matched by
        index as in torch). The state (step, exp_avg, exp_avg_sq, max_exp_avg_sq) is written
        to the server(s) at the start of the next step() that pushes, together with the
        params' values at that moment: ``model.load_state_dict`` and ``opt.load_state_dict``
        may then come in either order, and the server's params are the model's. Params
        without a saved entry restart from zero state and step 0. Call
        write_pending_state() to write at once. state_dict() returns the loaded state
        meanwhile.

        Raises:
          ValueError: not an AdamW state_dict, another number of groups or params per group,
            an amsgrad that differs from this optimizer's, a state entry that misses a key,
            has a shape other than its param's or names no param.
        """
        loaded = ro.validate_state_dict(state_dict, self.param_groups, self._amsgrad)
        for group, new in zip(self.param_groups, loaded.groups):
            group.update(new)
        self._pending = loaded

    def write_pending_state(self) -> bool:
        """Writes the state of the last load_state_dict() to the server(s) now, with the
        current local params; all or nothing on each server. Returns False when nothing was
        pending.

        Raises:
          grpc.RpcError: from the server(s) (the state stays pending). RuntimeError: the
            client cannot write state (an older fusedps client).
        """
        pending = self._pending
        if pending is None:
            return False
        states: Dict[str, Dict[str, torch.Tensor]] = {}
        steps: Dict[str, int] = {}
        for index, (name, param) in enumerate(self._pairs):
            entry = pending.entries.get(index)
            fields = {"param": param.detach()}
            wanted = ro.STATE_FIELDS + ((ro.AMSGRAD_FIELD,)
                                        if self._amsgrad[self._group_of[index]] else ())
            for f in wanted:
                fields[f] = entry[f] if entry is not None else torch.zeros(param.shape)
            states[name] = fields
            steps[name] = entry["step"] if entry is not None else 0
        ro.write_state(self.client, states, steps)
        self._pending = None
        return True
