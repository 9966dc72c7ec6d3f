"""fusedps.torch.RemoteAdamW's state against torch.optim.AdamW's, over real servers: the same
training on one server and on several (whole tensors and cut ones), state_dict round trips with
torch, the order of model and optimizer loads, and a restarted trainer taking the server's values.
Each test gives both optimizers the same gradients (remote_adamw_helpers._step_both).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import fusedps
from fusedps.plan import make_plan
from fusedps.torch import RemoteAdamW
from remote_adamw_helpers import (DEVICE, Net, _has_load_state, _models, _step_both,
                                  assert_params_close, assert_state_dicts_close,
                                  needs_load_state, param_groups, torch_adamw)
from server_fixture import running_server


def test_sharded_targets_match_one_server(server_target):
    """The same training on two servers, whole tensors (targets=[a, b]) and cut ones (a plan
    with small slices), gives one server's params and state, bit for bit."""
    models = [Net(6).to(DEVICE) for _ in range(3)]
    hyper = dict(lr=0.01, weight_decay=0.1, amsgrad=True)
    with contextlib.ExitStack() as stack:
        # A server serves one plan: a pair for each.
        servers = [stack.enter_context(running_server()) for _ in range(6)]
        single = RemoteAdamW(models[0].named_parameters(), targets=server_target,
                             prefix="shard/", **hyper)
        stack.callback(single.close)
        whole = RemoteAdamW(models[1].named_parameters(), targets=servers[:2], prefix="shard/",
                            **hyper)
        stack.callback(whole.close)
        assert isinstance(whole.client, fusedps.ShardedClient)
        cut = RemoteAdamW(models[2].named_parameters(),
                          client=cut_client(models[2], servers[2:4], stack), **hyper)
        assert any(s.server_tensor != s.tensor for s in cut.client.plan.slices)
        opts = (single, whole, cut)
        for step in range(6):
            _step_both(models, opts, step, use_aux=step != 2)
        for other, o in zip(models[1:], opts[1:]):
            for (n, p), q in zip(models[0].named_parameters(), other.parameters()):
                assert torch.equal(p, q), n
            assert_state_dicts_close(o.state_dict(), single.state_dict(), rtol=0, atol=0)
        if _has_load_state():
            # A state_dict load writes every shard.
            saved = single.state_dict()
            fresh = Net(7).to(DEVICE)
            cut2 = RemoteAdamW(fresh.named_parameters(),
                               client=cut_client(fresh, servers[4:], stack),
                               **dict(hyper, lr=0.5))
            cut2.load_state_dict(saved)
            fresh.load_state_dict(models[0].state_dict())
            assert cut2.write_pending_state()
            assert_state_dicts_close(cut2.state_dict(), saved, rtol=0, atol=0)
            pulled = cut2.client.pull_parameters(cut2.tensor_names)
            for n, p in models[0].named_parameters():
                assert torch.equal(pulled[n], p.detach().cpu()), n


def cut_client(model, targets, stack):
    """A ShardedClient whose plan cuts the model's tensors into slices of 100 elements, closed
    with ``stack``. A plan given with the client names the optimizer's server groups."""
    plan = make_plan([(n, tuple(p.shape), "group0") for n, p in model.named_parameters()],
                     len(targets), slice_elements=100)
    client = fusedps.ShardedClient(targets, plan=plan)
    stack.callback(client.close)
    return client


@needs_load_state
def test_state_dict_round_trip_with_torch(server_target):
    """torch's state_dict loads into RemoteAdamW and RemoteAdamW's into torch; both go on as
    one."""
    ours, theirs = _models()
    hyper = dict(lr=0.01, weight_decay=0.1, amsgrad=True)
    opt = RemoteAdamW(param_groups(ours), targets=server_target,
                      prefix="roundtrip/", **hyper)
    topt = torch_adamw(param_groups(theirs), **hyper)
    for step in range(3):
        _step_both((ours, theirs), (opt, topt), step, use_aux=step != 1)
    ours_sd, theirs_sd = opt.state_dict(), topt.state_dict()
    assert_state_dicts_close(ours_sd, theirs_sd)
    assert ours_sd["state"][0]["step"].dtype == theirs_sd["state"][0]["step"].dtype
    # torch's state_dict holds its live tensors: copies, with another lr in both.
    ours_sd, theirs_sd = copy.deepcopy(ours_sd), copy.deepcopy(theirs_sd)
    ours_sd["param_groups"][0]["lr"] = theirs_sd["param_groups"][0]["lr"] = 0.004

    with running_server() as target:
        # torch -> RemoteAdamW, on a fresh server that holds other values until the load.
        model2 = Net(8).to(DEVICE)
        opt2 = RemoteAdamW(param_groups(model2), targets=target, prefix="rt2/",
                           **hyper)
        opt2.load_state_dict(theirs_sd)
        model2.load_state_dict(theirs.state_dict())
        assert opt2.param_groups[0]["lr"] == 0.004
        assert_state_dicts_close(opt2.state_dict(), theirs_sd)  # pending, as loaded
        # RemoteAdamW -> torch
        model3 = Net(9).to(DEVICE)
        model3.load_state_dict(ours.state_dict())
        topt3 = torch_adamw(param_groups(model3), **hyper)
        topt3.load_state_dict(ours_sd)
        topt.load_state_dict(theirs_sd)
        opt.load_state_dict(ours_sd)  # its own state back, with the new lr
        for step in range(3, 6):
            _step_both((model2, theirs, model3, ours), (opt2, topt, topt3, opt), step)
        assert_params_close(model2, theirs)
        assert_params_close(model3, theirs)
        assert_params_close(ours, theirs)
        assert_state_dicts_close(opt2.state_dict(), topt.state_dict())
        opt2.close()
    opt.close()


@needs_load_state
@pytest.mark.parametrize("order", ["model_first", "optimizer_first", "eager"])
def test_load_order(server_target, order):
    """Lazy load: model.load_state_dict and opt.load_state_dict in either order; the server gets
    the params the model holds at the next step (write_pending_state: at once)."""
    source, theirs = _models(10)
    sopt = torch_adamw(source.named_parameters(), lr=0.01)
    _step_both((source,), (sopt,), 0)
    saved_model, saved_opt = copy.deepcopy(source.state_dict()), copy.deepcopy(sopt.state_dict())

    model = Net(11).to(DEVICE)  # other values, registered on the server as they are
    opt = RemoteAdamW(model.named_parameters(), lr=0.01, targets=server_target,
                      prefix=f"order-{order}/")
    if order == "model_first":
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
    else:
        opt.load_state_dict(saved_opt)
        if order == "eager":
            opt.write_pending_state()  # the server gets Net(11)'s values now ...
            _, _, steps = opt.client.pull_state("exp_avg", opt.tensor_names)
            assert set(steps.values()) == {1}
        model.load_state_dict(saved_model)  # ... and this does not reach it
    version = opt.client.info().version
    _step_both((model, source), (opt, sopt), 1)
    if order == "eager":  # the push stepped Net(11)'s values, not the loaded ones
        assert opt.last_step_timings["load_state_seconds"] == 0.0
        assert opt.client.info().version == version + 1
        opt.close()
        return
    assert opt.last_step_timings["load_state_seconds"] > 0
    assert opt.client.info().version == version + 2  # the load, then the push
    assert_params_close(model, source)
    assert_state_dicts_close(opt.state_dict(), sopt.state_dict())
    opt.close()


def test_restart_takes_the_server_values(server_target):
    """A second optimizer over the same names (a restarted trainer, on_existing="resume")
    leaves the server's values and state, pulls them into its model, and takes its own
    hyperparameters."""
    model = Net(12).to(DEVICE)
    opt = RemoteAdamW(model.named_parameters(), lr=0.01, targets=server_target,
                      prefix="restart/")
    _step_both((model,), (opt,), 0)
    _step_both((model,), (opt,), 1)
    opt.close()
    restarted = Net(13).to(DEVICE)
    opt2 = RemoteAdamW(restarted.named_parameters(), lr=0.03, targets=server_target,
                       prefix="restart/", on_existing="resume")
    for p, q in zip(model.parameters(), restarted.parameters()):
        assert torch.equal(p, q)
    group = {g.name: g for g in opt2.client.info().param_groups}["restart/group0"]
    assert group.lr == pytest.approx(0.03)
    assert {int(e["step"].item()) for e in opt2.state_dict()["state"].values()} == {2}
    with pytest.raises(ValueError, match="amsgrad"):
        RemoteAdamW(Net(14).named_parameters(), amsgrad=True, targets=server_target,
                    prefix="restart/", on_existing="resume")
    opt2.close()
