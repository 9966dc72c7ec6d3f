"""Unit tests of fusedps.torch.RemoteAdamW's pure-Python helpers (fusedps._remote_optim): named
param groups, the GradScaler contract, the state_dict checks. No server; the behaviour against
a real server and torch.optim.AdamW is tests/e2e/test_remote_adamw.py."""

from __future__ import annotations

import enum

import pytest
import torch

from fusedps import _remote_optim as ro


def _named(n=3):
    return [(f"p{i}", torch.nn.Parameter(torch.randn(i + 1, 2))) for i in range(n)]


# -- named params and groups ---------------------------------------------------------------------

def test_named_param_groups_forms():
    pairs = _named()
    module = torch.nn.Linear(2, 2)
    assert [n for n, _ in ro.named_param_groups(module.named_parameters())[0]["params"]] == \
        ["weight", "bias"]
    assert ro.named_param_groups(dict(pairs))[0]["params"] == pairs
    groups = ro.named_param_groups([{"params": pairs[:2], "lr": 0.1, "name": "a"},
                                    {"params": dict(pairs[2:])}])
    assert groups[0]["params"] == pairs[:2] and groups[0]["lr"] == 0.1
    assert groups[0]["name"] == "a" and groups[1]["params"] == pairs[2:]
    # torch >= 2.6's own layout: tensors with "param_names" beside them.
    g = ro.named_param_groups([{"params": [p for _, p in pairs], "param_names": ["x", "y", "z"]}])
    assert [n for n, _ in g[0]["params"]] == ["x", "y", "z"] and "param_names" not in g[0]


@pytest.mark.parametrize("bad,error", [
    (lambda: [torch.nn.Parameter(torch.zeros(1))], TypeError),
    (lambda: torch.nn.Parameter(torch.zeros(1)), TypeError),
    (lambda: [{"params": [torch.nn.Parameter(torch.zeros(1))]}], TypeError),
    (lambda: [{"params": _named(1)}, _named(1)[0]], TypeError),
    (lambda: [], ValueError),
    (lambda: [{"params": []}], ValueError),
    (lambda: [{"lr": 1.0}], ValueError),
    (lambda: [{"params": [torch.zeros(1)], "param_names": ["a", "b"]}], ValueError),
])
def test_named_param_groups_errors(bad, error):
    with pytest.raises(error):
        ro.named_param_groups(bad())


def test_implementation_flags():
    ro.check_implementation_flags(dict(foreach=None, fused=False, capturable=False), "x")
    for key in ro.IMPLEMENTATION_KEYS:
        with pytest.raises(ValueError, match=key):
            ro.check_implementation_flags({key: True}, "x")


def test_torch_adamw_facts_and_hyperparameters():
    facts = ro.torch_adamw_facts(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0,
                                 amsgrad=True, maximize=True)
    assert facts.defaults == torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1,
                                               betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0,
                                               amsgrad=True, maximize=True).defaults
    with pytest.raises(ValueError):
        ro.torch_adamw_facts(lr=0.1, betas=(1.5, 0.9))
    group = dict(facts.defaults, lr=torch.tensor(0.25), betas=(torch.tensor(0.5), 0.75))
    h = ro.hyperparameters_of(group)
    assert h == (("lr", 0.25), ("betas", (0.5, 0.75)), ("eps", 1e-6), ("weight_decay", 0.0),
                 ("maximize", True))
    assert type(h[0][1]) is float and all(type(x) is float for x in h[1][1])
    assert ro.hyperparameter_kwargs(h) == dict(lr=0.25, betas=(0.5, 0.75), eps=1e-6,
                                               weight_decay=0.0, maximize=True)
    # The loop may change these; amsgrad, the decay's kind and the storage are fixed.
    assert ro.MUTABLE == ("lr", "betas", "eps", "weight_decay", "maximize")


# -- GradScaler -----------------------------------------------------------------------------------

class _Stage(enum.Enum):  # torch's OptState: the helpers read the stage's name only
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class FakeScaler:
    """The parts of torch's GradScaler that RemoteAdamW reads and writes."""

    def __init__(self, scale=1024.0, shape=(1,)):
        self._enabled = True
        self._scale = torch.full(shape, scale)
        self._per_optimizer_states = {}

    def _get_scale_async(self):
        return self._scale

    def state_of(self, opt, stage, found=None):
        self._per_optimizer_states[id(opt)] = {"stage": stage, "found_inf_per_device": found or {}}
        return self._per_optimizer_states[id(opt)]


@pytest.mark.parametrize("shape", [(1,), ()])  # torch 1.x's and 2.x's scale
@pytest.mark.parametrize("skipped", [False, True])
def test_scaler_ready_the_server_divides_and_its_verdict_is_recorded(shape, skipped):
    scaler, opt = FakeScaler(2048.0, shape), object()
    state = scaler.state_of(opt, _Stage.READY)
    plan = ro.scaler_plan(scaler, opt, extra_scale=None)
    assert plan.grad_scale == 2048.0 and not plan.skip
    plan.report(skipped)
    (found,) = state["found_inf_per_device"].values()
    assert found.shape == torch.Size(shape) and found.dtype == torch.float32
    assert float(found.sum()) == (1.0 if skipped else 0.0)
    assert ro.scaler_plan(scaler, opt, extra_scale=4.0).grad_scale == 8192.0


def test_scaler_unscaled_is_not_divided_again():
    scaler, opt = FakeScaler(), object()
    found = torch.zeros(1)
    scaler.state_of(opt, _Stage.UNSCALED, {torch.device("cpu"): found})
    plan = ro.scaler_plan(scaler, opt, extra_scale=None)
    assert plan.grad_scale is None and not plan.skip
    plan.report(True)  # the server still found inf (e.g. in bf16 rounding): update() must see it
    assert float(found) == 1.0
    found.zero_()
    plan = ro.scaler_plan(scaler, opt, extra_scale=None)
    plan.report(False)
    assert float(found) == 0.0


def test_scaler_unscaled_with_local_inf_skips():
    scaler, opt = FakeScaler(), object()
    scaler.state_of(opt, _Stage.UNSCALED, {torch.device("cpu"): torch.ones(1)})
    assert ro.scaler_plan(scaler, opt, extra_scale=None).skip


def test_disabled_scaler_and_attribute_contract():
    scaler = FakeScaler()
    scaler._enabled = False
    plan = ro.scaler_plan(scaler, object(), extra_scale=3.0)
    assert plan.grad_scale == 3.0 and not plan.skip
    plan = ro.attribute_plan(torch.tensor(512.0), torch.tensor(0.0))
    assert plan.grad_scale == 512.0 and not plan.skip
    assert ro.attribute_plan(None, torch.tensor(1.0)).skip
    assert ro.attribute_plan(None, None).grad_scale is None
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            ro.check_grad_scale(bad)


# -- state_dict ------------------------------------------------------------------------------------

def _groups(amsgrad=(False, True)):
    pairs = _named(3)
    base = ro.torch_adamw_facts().defaults
    return [dict(base, params=[p for _, p in pairs[:2]], amsgrad=amsgrad[0]),
            dict(base, params=[pairs[2][1]], amsgrad=amsgrad[1], weight_decay=0.0)]


def _state_dict(groups):
    sd = {"state": {}, "param_groups": ro.pack_groups(groups)}
    for i, p in enumerate(q for g in groups for q in g["params"]):
        entry = {"step": torch.tensor(3.0), "exp_avg": torch.randn(p.shape),
                 "exp_avg_sq": torch.rand(p.shape)}
        if i == 2:
            entry["max_exp_avg_sq"] = torch.rand(p.shape)
        sd["state"][i] = entry
    return sd


def test_pack_groups_and_step():
    groups = _groups()
    packed = ro.pack_groups(groups)
    assert [g["params"] for g in packed] == [[0, 1], [2]]
    assert set(packed[0]) == set(groups[0])
    assert ro.scalar_step(7).dtype == torch.float32 and ro.scalar_step(7).shape == ()


def test_validate_state_dict_takes_hyperparameters_and_state():
    groups = _groups()
    sd = _state_dict(groups)
    sd["param_groups"][0]["lr"] = 0.5
    sd["param_groups"][0]["initial_lr"] = 0.7  # a scheduler's key comes along, as in torch
    sd["param_groups"][0]["fused"] = True  # an implementation flag does not
    del sd["state"][1]
    loaded = ro.validate_state_dict(sd, groups, [False, True])
    assert loaded.groups[0]["lr"] == 0.5 and loaded.groups[0]["initial_lr"] == 0.7
    assert loaded.groups[0].get("fused") == groups[0].get("fused")
    assert loaded.groups[0]["params"] is groups[0]["params"]
    assert sorted(loaded.entries) == [0, 2] and loaded.entries[0]["step"] == 3
    assert "max_exp_avg_sq" in loaded.entries[2]
    sd["state"][0]["exp_avg"].add_(1.0)  # the loaded copy does not follow the source
    assert not torch.equal(loaded.entries[0]["exp_avg"], sd["state"][0]["exp_avg"])


@pytest.mark.parametrize("mutate,match", [
    (lambda sd: sd.pop("state"), "state_dict"),
    (lambda sd: sd["param_groups"].pop(), "number of parameter groups"),
    (lambda sd: sd["param_groups"][0]["params"].pop(), "size of optimizer's group"),
    (lambda sd: sd["param_groups"][1].update(amsgrad=False), "amsgrad"),
    (lambda sd: sd["state"].update({7: sd["state"][0]}), "names no parameter"),
    (lambda sd: sd["state"][0].pop("exp_avg_sq"), "missing"),
    (lambda sd: sd["state"][2].pop("max_exp_avg_sq"), "missing"),
    (lambda sd: sd["state"][1].update(exp_avg=torch.zeros(9)), "shape"),
    (lambda sd: sd["state"][1].update(step=torch.tensor(1.5)), "whole number"),
])
def test_validate_state_dict_errors(mutate, match):
    groups = _groups()
    sd = _state_dict(groups)
    mutate(sd)
    with pytest.raises(ValueError, match=match):
        ro.validate_state_dict(sd, groups, [False, True])


def test_state_entry_follows_the_param():
    like = torch.zeros(2, 3, dtype=torch.float64)
    entry = ro.state_entry(4, {"exp_avg_sq": torch.ones(2, 3), "exp_avg": torch.ones(2, 3)},
                           like)
    assert list(entry) == ["step", "exp_avg", "exp_avg_sq"]
    assert entry["exp_avg"].dtype == torch.float64 and float(entry["step"]) == 4.0
