"""RemoteAdamW.state_dict() numbers params as torch.optim.AdamW's does (issue 35, item 8).

torch's Optimizer.state_dict gives each param the index of its first appearance over all
groups (a mapping built group by group, keyed by the tensor), so a param repeated in a later
group keeps its first index, and its state is filed under that index. PyTorch's own state_dict
test checks this by extending param_groups with themselves. torch refuses a param in two groups
at construction (ValueError); RemoteAdamW does the same.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fusedps.torch import RemoteAdamW
from test_remote_adamw import assert_state_dicts_close, torch_adamw


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _step(model: torch.nn.Module, *optimizers) -> None:
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(7)
    model(torch.randn(8, 4, generator=gen)).square().mean().backward()
    for opt in optimizers:
        opt.step()


def _groups(model: torch.nn.Module):
    named = list(model.named_parameters())
    return [{"params": named[:2]}, {"params": named[2:], "weight_decay": 0.0}]


def test_a_param_repeated_in_a_later_group_keeps_its_first_index(server_target):
    """PyTorch's own check: ``opt.param_groups.extend(opt.param_groups)``; the repeated groups
    pack to the indices of the first ones, in RemoteAdamW as in torch."""
    ours, theirs = _model(), _model()
    opt = RemoteAdamW(_groups(ours), lr=0.01, targets=server_target, prefix="repeat/")
    topt = torch_adamw(_groups(theirs), lr=0.01)  # Named where torch keeps names (>= 2.6).
    try:
        _step(ours, opt)
        _step(theirs, topt)
        opt.param_groups.extend(opt.param_groups)
        topt.param_groups.extend(topt.param_groups)
        mine, reference = opt.state_dict(), topt.state_dict()
        assert [g["params"] for g in reference["param_groups"]] == [[0, 1], [2, 3], [0, 1],
                                                                    [2, 3]]
        assert [g["params"] for g in mine["param_groups"]] == \
            [g["params"] for g in reference["param_groups"]]
        assert_state_dicts_close(mine, reference)
    finally:
        opt.close()


def test_a_param_named_twice_in_one_group_is_numbered_as_torch_does(server_target):
    """One tensor under two names in a group (torch warns about duplicates): the same indices
    and the same state keys as torch's state_dict."""
    ours, theirs = _model(), _model()
    w, b = ours[0].weight, ours[0].bias
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = RemoteAdamW([("w", w), ("b", b), ("w_again", w)], lr=0.01,
                          targets=server_target, prefix="named-twice/")
        topt = torch.optim.AdamW([theirs[0].weight, theirs[0].bias, theirs[0].weight], lr=0.01)
    try:
        _step(ours, opt)
        _step(theirs, topt)
        mine, reference = opt.state_dict(), topt.state_dict()
        assert mine["param_groups"][0]["params"] == reference["param_groups"][0]["params"]
        assert set(mine["state"]) == set(reference["state"])
        # Loaded back, the one saved state goes to both of the tensor's names on the server.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            again = RemoteAdamW([("w", w), ("b", b), ("w_again", w)], lr=0.01,
                                targets=server_target, prefix="named-twice-loaded/")
        with again:
            again.load_state_dict(mine)
            assert again.write_pending_state()
            exp_avg, _, steps = again.client.pull_state("exp_avg", again.tensor_names)
            saved = mine["state"][2]
            for name in ("named-twice-loaded/w", "named-twice-loaded/w_again"):
                assert steps[name] == int(saved["step"].item()), name
                torch.testing.assert_close(exp_avg[name], saved["exp_avg"], rtol=0, atol=0)
    finally:
        opt.close()


def test_a_param_in_two_groups_is_refused_at_construction_as_torch_does(server_target):
    model = _model()
    w = model[0].weight
    with pytest.raises(ValueError, match="more than one parameter group"):
        torch.optim.AdamW([{"params": [w]}, {"params": [w]}])
    with pytest.raises(ValueError, match="more than one parameter group"):
        RemoteAdamW([{"params": [("w", w)]}, {"params": [("w_again", w)]}],
                    targets=server_target, prefix="two-groups/")
