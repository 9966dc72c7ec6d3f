"""fusedps.torch.RemoteAdamW against torch.optim.AdamW (the oracle), over real servers.

The main test runs ONE training function twice, once with torch.optim.AdamW and once with
RemoteAdamW (fp32 gradients on the wire): two param groups, a CosineAnnealingLR schedule, a
GradScaler (with scaler.unscale_ + clipping on some steps), a param whose grad is None on odd
steps, and at step 10 a state_dict save, a NEW model, optimizer, scheduler and scaler (for
RemoteAdamW on a fresh server, which holds the new model's perturbed values until the load
writes), the loads in the order opt, scheduler, then model, and 14 more steps. The params and
state_dicts must then match within test_parity.py's tolerances (torch's own for fused vs
for-loop AdamW); on the GPU under fp16 autocast, where each run's forward passes round their
own way, within 1e-4. The focused tests after it give both optimizers the same gradients
(RemoteAdamW's model's, copied), so that they compare the optimizers alone. Loading state
(state_dict round trips, load order, restarts) and several servers are tested in
test_remote_adamw_state_dict.py; the model, the oracle and the comparisons of both files are in
remote_adamw_helpers.py.

GradScaler: grad_scalers.make_scaler (torch's own GradScaler on every torch version). With
FUSEDPS_TEST_DEVICE=cuda on a machine with CUDA, the model runs on the GPU under fp16 autocast
with a real CUDA GradScaler (dynamic scale) and the servers use the CUDA backend.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import grpc
import pytest
import torch

from fusedps.torch import RemoteAdamW
from grad_scalers import make_scaler
from remote_adamw_helpers import (ATOL, DEVICE, RTOL, Net, _has_load_state, _models,
                                  _step_both, assert_params_close, assert_state_dicts_close,
                                  batch, copy_grads, param_groups, torch_adamw)
from server_fixture import running_server

# torch >= 2.3 warns at each GradScaler.step that its grad_scaler keyword will go; fusedps.torch
# silences it, but pytest resets warning filters around each test.
pytestmark = pytest.mark.filterwarnings(
    "ignore:GradScaler is going to stop passing itself:FutureWarning")

# fp16 autocast on the GPU: the forward passes see params that differ by rounding, and fp16
# rounds their activations differently; a looser bound there.
TRAIN_RTOL, TRAIN_ATOL = (RTOL, ATOL) if DEVICE.type == "cpu" else (1e-4, 1e-4)


# ----------------------------------------------------------------------------------------------
# The training function, run with either optimizer
# ----------------------------------------------------------------------------------------------

STEPS = 24
SAVE_AT = 10


def train(make_optimizer: Callable, phase_server: Callable[[int], None] = lambda phase: None):
    """Trains Net for STEPS steps; at SAVE_AT saves everything, rebuilds model, optimizer,
    scheduler and scaler from other initial values, loads the saved states and goes on.

    make_optimizer(model, phase) builds the optimizer of phase 0 (start) or 1 (after the load).
    Returns (model, optimizer, scale history, skipped steps).
    """
    model = Net(seed=1).to(DEVICE)
    opt = make_optimizer(model, 0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-3)
    scaler = make_scaler()
    scales, skipped = [], 0
    for step in range(STEPS):
        if step == SAVE_AT:
            saved = dict(model=copy.deepcopy(model.state_dict()), opt=opt.state_dict(),
                         sched=sched.state_dict(), scaler=scaler.state_dict())
            saved = copy.deepcopy(saved)
            model = Net(seed=2).to(DEVICE)  # other values: the loads must overwrite them
            opt = make_optimizer(model, 1)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-3)
            scaler = make_scaler()
            opt.load_state_dict(saved["opt"])      # before the model's: RemoteAdamW must
            sched.load_state_dict(saved["sched"])  # write the model's values loaded below
            scaler.load_state_dict(saved["scaler"])
            model.load_state_dict(saved["model"])
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(x, y, use_aux=(step % 2 == 0))
        scaler.scale(loss).backward()
        if step % 3 == 0:  # clipping needs unscaled grads: the scaler must not divide again
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        scales.append(scaler.get_scale())
        sched.step()
    return model, opt, scales, skipped


def test_training_matches_torch(server_target):
    torch_model, torch_opt, torch_scales, torch_skipped = train(
        lambda model, phase: torch_adamw(param_groups(model), lr=0.02))

    with contextlib.ExitStack() as stack:
        def remote(model, phase):
            # Phase 1 on a fresh server: registration leaves the new model's values there,
            # so only the load (written at the next step) can make the runs agree.
            target = server_target if phase == 0 else stack.enter_context(running_server())
            opt = RemoteAdamW(param_groups(model), lr=0.02, targets=target,
                              grad_dtype="float32", prefix="train/")
            stack.callback(opt.close)
            return opt

        if not _has_load_state():
            pytest.skip("fusedps.Client.load_state not available")
        model, opt, scales, skipped = train(remote)
        assert scales == torch_scales and skipped == torch_skipped
        assert_params_close(model, torch_model, TRAIN_RTOL, TRAIN_ATOL, msg="after training")
        ours, theirs = opt.state_dict(), torch_opt.state_dict()
        assert_state_dicts_close(ours, theirs, TRAIN_RTOL, TRAIN_ATOL)
        assert opt.last_step_timings["push_seconds"] > 0
        assert opt.last_step_timings["pull_seconds"] > 0
        # The server holds what the model holds.
        pulled = opt.client.pull_parameters(opt.tensor_names)
        for name, p in zip(opt.tensor_names, opt.param_groups[0]["params"]
                           + opt.param_groups[1]["params"]):
            assert torch.equal(pulled[name], p.detach().cpu().float()), name


# ----------------------------------------------------------------------------------------------
# Focused checks
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hyper", [
    dict(lr=0.01),
    dict(lr=0.01, weight_decay=0.1),
    dict(lr=0.01, weight_decay=0.0, amsgrad=True),
    dict(lr=0.005, weight_decay=0.05, maximize=True),
    dict(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=True, maximize=True),
], ids=["lr", "weight_decay", "amsgrad", "maximize", "all"])
def test_variants_match_torch(server_target, hyper, request):
    ours, theirs = _models()
    opt = RemoteAdamW(ours.named_parameters(), targets=server_target,
                      prefix=f"variant-{request.node.callspec.id}/", **hyper)
    topt = torch_adamw(theirs.named_parameters(), **hyper)
    for step in range(8):
        _step_both((ours, theirs), (opt, topt), step, use_aux=step % 3 != 1)
    assert_params_close(ours, theirs)
    assert_state_dicts_close(opt.state_dict(), topt.state_dict())
    opt.close()


def test_grad_none_params_are_skipped(server_target):
    """Params without .grad are not pushed: their server step stays, as torch's state does."""
    ours, theirs = _models()
    opt = RemoteAdamW(ours.named_parameters(), lr=0.01, targets=server_target, prefix="none/")
    topt = torch_adamw(theirs.named_parameters(), lr=0.01)
    # aux is used on steps 0 and 3 only; steps 1, 2 and 4 leave its grads None.
    for step, use_aux in enumerate([True, False, False, True, False]):
        _step_both((ours, theirs), (opt, topt), step, use_aux)
    _, _, steps = opt.client.pull_state("exp_avg", opt.tensor_names)
    expected = {f"none/{n}": int(topt.state[p]["step"].item()) if p in topt.state else 0
                for n, p in theirs.named_parameters()}
    assert steps == expected
    assert steps["none/aux.weight"] == 2 and steps["none/head.weight"] == 5
    assert_params_close(ours, theirs)
    assert_state_dicts_close(opt.state_dict(), topt.state_dict())
    # A param never given a grad has no state entry, as in torch.
    fresh = Net(4).to(DEVICE)
    opt2 = RemoteAdamW(fresh.named_parameters(), targets=server_target, prefix="none2/")
    opt2.zero_grad(set_to_none=True)
    fresh.loss(*batch(0), use_aux=False).backward()
    opt2.step()
    aux_index = [n for n, _ in fresh.named_parameters()].index("aux.weight")
    assert aux_index not in opt2.state_dict()["state"]
    assert 0 in opt2.state_dict()["state"]
    opt.close()
    opt2.close()


def test_no_grads_does_nothing(server_target):
    model = Net(5).to(DEVICE)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target, prefix="nograd/")
    version = opt.client.info().version
    opt.zero_grad(set_to_none=True)
    assert opt.step() is None
    assert opt.client.info().version == version
    assert opt.state_dict()["state"] == {}
    opt.close()


def test_closure(server_target):
    ours, theirs = _models()
    opt = RemoteAdamW(ours.named_parameters(), lr=0.01, targets=server_target, prefix="closure/")
    topt = torch_adamw(theirs.named_parameters(), lr=0.01)
    x, y = batch(0)
    for model, o in ((ours, opt), (theirs, topt)):
        def closure(model=model, o=o):
            o.zero_grad()
            loss = model.loss(x, y, True)
            loss.backward()
            return loss

        with torch.no_grad():  # step() must evaluate the closure with grad enabled
            loss = o.step(closure)
        assert loss is not None and loss.requires_grad
    assert_params_close(ours, theirs)
    opt.close()


def test_hyperparameter_changes_reach_the_server(server_target):
    """param_groups edits (and a scheduler's) go to the server before the next push."""
    ours, theirs = _models()
    groups = param_groups(ours)
    groups[1]["name"] = "hyper-biases"
    opt = RemoteAdamW(groups, lr=0.01, targets=server_target, prefix="hyper/")
    topt = torch_adamw(param_groups(theirs), lr=0.01)
    assert opt.group_names == ["hyper/group0", "hyper-biases"]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tsched = torch.optim.lr_scheduler.StepLR(topt, step_size=1, gamma=0.5)
    for step in range(3):
        _step_both((ours, theirs), (opt, topt), step)
        sched.step()
        tsched.step()
    lr = torch.tensor(0.003)  # a tensor lr, as schedulers of torch >= 2.2 may store
    for o in (opt, topt):
        o.param_groups[1]["weight_decay"] = 0.2
        o.param_groups[0]["betas"] = (0.85, 0.99)
        o.param_groups[0]["eps"] = 1e-7
        o.param_groups[0]["lr"] = lr if o is opt else float(lr)
    _step_both((ours, theirs), (opt, topt), 3)
    groups_on_server = {g.name: g for g in opt.client.info().param_groups}
    g0, g1 = groups_on_server["hyper/group0"], groups_on_server["hyper-biases"]
    assert g0.lr == pytest.approx(0.003) and g0.betas == pytest.approx((0.85, 0.99))
    assert g0.eps == pytest.approx(1e-7) and g0.weight_decay == pytest.approx(0.01)
    assert g1.lr == pytest.approx(0.01 * 0.5 ** 3) and g1.weight_decay == pytest.approx(0.2)
    assert opt.last_step_timings["hyperparameters_seconds"] > 0
    assert_params_close(ours, theirs)

    opt.param_groups[0]["amsgrad"] = True
    ours.loss(*batch(4), True).backward()
    with pytest.raises(ValueError, match="amsgrad cannot change"):
        opt.step()
    opt.close()


def test_skipped_step_is_reported_to_the_scaler(server_target):
    """A non-finite gradient: the server skips the step, the scaler backs off as torch's does,
    and nothing changes on the server."""
    ours, theirs = _models()
    opt = RemoteAdamW(ours.named_parameters(), lr=0.01, targets=server_target, prefix="skip/")
    topt = torch_adamw(theirs.named_parameters(), lr=0.01)
    scalers = [make_scaler(init_scale=256.0), make_scaler(init_scale=256.0)]

    def step_both(step, poison: bool, unscale: bool):
        for o in (opt, topt):
            o.zero_grad(set_to_none=True)
        scalers[0].scale(ours.loss(*batch(step), True)).backward()
        scalers[1].scale(torch.zeros((), device=DEVICE))  # its lazy init; grads come copied
        if poison:
            ours.body[0].weight.grad[0, 0] = float("inf")
        copy_grads(ours, theirs)
        for o, scaler in zip((opt, topt), scalers):
            if unscale:
                scaler.unscale_(o)
            scaler.step(o)
            scaler.update()

    step_both(0, poison=False, unscale=False)
    version = opt.client.info().version
    before = opt.client.pull_parameters(opt.tensor_names)
    local_before = [p.detach().clone() for p in ours.parameters()]
    step_both(1, poison=True, unscale=False)  # the server finds the inf
    assert opt.last_step_skipped and opt.last_push_result.step_skipped
    assert [s.get_scale() for s in scalers] == [128.0, 128.0]
    assert opt.client.info().version == version
    after = opt.client.pull_parameters(opt.tensor_names)
    assert after.steps == before.steps
    for n in opt.tensor_names:
        assert torch.equal(after[n], before[n]), n
    for p, q in zip(ours.parameters(), local_before):
        assert torch.equal(p.detach(), q)

    step_both(2, poison=True, unscale=True)  # unscale_ found it: no push at all
    assert opt.last_step_skipped and opt.last_step_timings["push_seconds"] == 0.0
    assert [s.get_scale() for s in scalers] == [64.0, 64.0]
    assert opt.client.info().version == version

    step_both(3, poison=False, unscale=True)
    step_both(4, poison=False, unscale=False)
    assert not opt.last_step_skipped
    assert [s.get_scale() for s in scalers] == [64.0, 64.0]
    assert_params_close(ours, theirs)
    assert_state_dicts_close(opt.state_dict(), topt.state_dict())
    opt.close()


def test_manual_loss_scale(server_target):
    """step(grad_scale=S) (or opt.grad_scale = S): the server divides the grads by S."""
    ours, theirs = _models()
    opt = RemoteAdamW(ours.named_parameters(), lr=0.01, targets=server_target, prefix="scale/")
    topt = torch_adamw(theirs.named_parameters(), lr=0.01)
    scale = 512.0
    for step in range(4):
        for o in (opt, topt):
            o.zero_grad(set_to_none=True)
        (ours.loss(*batch(step), True) * scale).backward()
        copy_grads(ours, theirs)
        for p in theirs.parameters():
            p.grad.mul_(1.0 / scale)
        topt.step()
        if step < 2:
            opt.step(grad_scale=scale)
        else:
            opt.grad_scale = scale
            opt.step()
    assert_params_close(ours, theirs)
    with pytest.raises(ValueError, match="grad_scale"):
        opt.step(grad_scale=0.0)
    opt.close()


def test_bfloat16_gradients(server_target):
    """grad_dtype="bfloat16": torch.optim.AdamW on the gradients rounded to bf16."""
    ours, theirs = _models()
    opt = RemoteAdamW(ours.named_parameters(), lr=0.01, targets=server_target, prefix="bf16/",
                      grad_dtype="bfloat16")
    topt = torch_adamw(theirs.named_parameters(), lr=0.01)
    for step in range(4):
        for o in (opt, topt):
            o.zero_grad(set_to_none=True)
        ours.loss(*batch(step), True).backward()
        copy_grads(ours, theirs)
        for p in theirs.parameters():
            p.grad.copy_(p.grad.to(torch.bfloat16).float())
        opt.step()
        topt.step()
    assert opt.last_push_result.grad_bytes == 2 * sum(p.numel() for p in ours.parameters())
    assert_params_close(ours, theirs)

def test_construction_errors(server_target):
    model = Net(15)
    named = list(model.named_parameters())
    for flag in ("foreach", "fused", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=flag):
            RemoteAdamW(named, targets=server_target, **{flag: True})
    RemoteAdamW(named, targets=server_target, prefix="flags/", foreach=False, fused=None).close()
    with pytest.raises(TypeError, match="named"):
        RemoteAdamW(model.parameters(), targets=server_target)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        RemoteAdamW(named, lr=-1.0, targets=server_target)
    with pytest.raises(ValueError, match="grad_dtype"):
        RemoteAdamW(named, grad_dtype="float16", targets=server_target)
    with pytest.raises(ValueError, match="targets"):
        RemoteAdamW(named)
    with pytest.raises(ValueError, match="twice"):
        RemoteAdamW([{"params": named}, {"params": named[:1]}], targets=server_target)
    with pytest.raises(grpc.RpcError):
        RemoteAdamW(named, targets="127.0.0.1:1", connect_timeout=None,
                    client_options={"timeout": 2.0})
    opt = RemoteAdamW(named, targets=server_target, prefix="errors/",
                      client_options={"client_id": "trainer-7", "timeout": 20.0})
    assert opt.client.client_id == "trainer-7" and opt.client.timeout == 20.0
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    bad = opt.state_dict()
    bad["param_groups"] = bad["param_groups"] * 2
    with pytest.raises(ValueError, match="number of parameter groups"):
        opt.load_state_dict(bad)
    opt.close()


def test_import_is_lazy():
    """`import fusedps` does not import fusedps.torch; inside it, `torch` is PyTorch."""
    import subprocess
    import sys

    code = ("import sys, fusedps; assert 'fusedps.torch' not in sys.modules; "
            "import fusedps.torch as ft; assert ft.torch.optim.AdamW is not None")
    subprocess.run([sys.executable, "-c", code], check=True)
