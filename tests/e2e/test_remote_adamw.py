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
(RemoteAdamW's model's, copied), so that they compare the optimizers alone.

GradScaler: grad_scalers.make_scaler (torch's own GradScaler on every torch version). With
FUSEDPS_TEST_DEVICE=cuda on a machine with CUDA, the model runs on the GPU under fp16 autocast
with a real CUDA GradScaler (dynamic scale) and the servers use the CUDA backend.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Callable, Dict, List

import grpc
import pytest
import torch

import fusedps
from fusedps.plan import make_plan
from fusedps.torch import RemoteAdamW
from grad_scalers import make_scaler
from server_fixture import running_server

# torch >= 2.3 warns at each GradScaler.step that its grad_scaler keyword will go; fusedps.torch
# silences it, but pytest resets warning filters around each test.
pytestmark = pytest.mark.filterwarnings(
    "ignore:GradScaler is going to stop passing itself:FutureWarning")

# test_parity.py's tolerance: PyTorch's own for fused vs for-loop AdamW.
RTOL = 1.3e-6
ATOL = 1e-5

DEVICE = torch.device("cuda" if os.environ.get("FUSEDPS_TEST_DEVICE") == "cuda"
                      and torch.cuda.is_available() else "cpu")
# fp16 autocast on the GPU: the forward passes see params that differ by rounding, and fp16
# rounds their activations differently; a looser bound there.
TRAIN_RTOL, TRAIN_ATOL = (RTOL, ATOL) if DEVICE.type == "cpu" else (1e-4, 1e-4)


def _has_load_state() -> bool:
    return hasattr(fusedps.Client, "load_state")


needs_load_state = pytest.mark.skipif(not _has_load_state(),
                                      reason="fusedps.Client.load_state not available")


def autocast():
    if DEVICE.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.float16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# Models and optimizers
# ----------------------------------------------------------------------------------------------

class Net(torch.nn.Module):
    """A small MLP with a classification head and an auxiliary head (used on some steps only,
    so that its grads are None on the others)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(),
                                        torch.nn.Linear(32, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 3)
        self.aux = torch.nn.Linear(32, 1)

    def loss(self, x, y, use_aux: bool):
        with autocast():
            h = self.body(x)
            logits = self.head(h)
            aux = self.aux(h) if use_aux else None
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        if use_aux:
            loss = loss + aux.float().square().mean()
        return loss


def param_groups(model: torch.nn.Module) -> List[Dict]:
    """Two groups of named params, the usual split: decayed weights, biases without decay."""
    decay = [(n, p) for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [(n, p) for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def torch_adamw(params, **kw):
    """The oracle: torch.optim.AdamW's for-loop implementation. Given named params (a module's
    named_parameters or groups of them) it keeps the names where torch can (>= 2.6: its
    state_dict then has "param_names", as RemoteAdamW's has there)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, foreach=False, **kw)
    except TypeError:  # torch < 2.6: tensors only
        def strip(ps):
            return [p[1] if isinstance(p, tuple) else p for p in ps]
        if params and isinstance(params[0], dict):
            params = [dict(g, params=strip(g["params"])) for g in params]
        else:
            params = strip(params)
        return torch.optim.AdamW(params, foreach=False, **kw)


def batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 12, generator=gen)
    y = torch.randint(0, 3, (16,), generator=gen)
    return x.to(DEVICE), y.to(DEVICE)


def assert_params_close(a: torch.nn.Module, b: torch.nn.Module, rtol=RTOL, atol=ATOL, msg=""):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.detach().cpu(), pb.detach().cpu(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{msg} {name}: {m}")


def assert_state_dicts_close(ours: Dict, theirs: Dict, rtol=RTOL, atol=ATOL,
                             ignore_group_keys=("foreach",)):
    """Same structure (group keys, state indices and keys, dtypes, shapes, devices) and values
    within tolerance; steps exactly."""
    assert len(ours["param_groups"]) == len(theirs["param_groups"])
    for g, h in zip(ours["param_groups"], theirs["param_groups"]):
        assert set(g) == set(h), (set(g) ^ set(h))
        for k in g:
            if k in ignore_group_keys:
                continue
            if k in ("lr", "initial_lr"):
                assert float(g[k]) == pytest.approx(float(h[k]), rel=1e-12), k
            else:
                assert g[k] == h[k], (k, g[k], h[k])
    assert set(ours["state"]) == set(theirs["state"])
    for i, entry in ours["state"].items():
        other = theirs["state"][i]
        assert list(entry) == list(other), (i, list(entry), list(other))
        for k, v in entry.items():
            w = other[k]
            assert (v.dtype, v.shape, v.device) == (w.dtype, w.shape, w.device), (i, k)
            if k == "step":
                assert torch.equal(v, w), (i, v, w)
            else:
                torch.testing.assert_close(v, w, rtol=rtol, atol=atol,
                                           msg=lambda m: f"state {i} {k}: {m}")


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

def _models(seed=3):
    ours, theirs = Net(seed).to(DEVICE), Net(seed).to(DEVICE)
    return ours, theirs


def copy_grads(source: torch.nn.Module, *targets: torch.nn.Module) -> None:
    """Gives the targets' params source's gradients (None stays None): the focused tests compare
    the optimizers on the same gradients, with no feedback through separate forward passes."""
    for ps in zip(source.parameters(), *(t.parameters() for t in targets)):
        for q in ps[1:]:
            q.grad = None if ps[0].grad is None else ps[0].grad.detach().clone()


def _step_both(models, opts, step, use_aux=True):
    """One step of each optimizer on models[0]'s gradients of batch ``step``."""
    x, y = batch(step)
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    models[0].loss(x, y, use_aux).backward()
    copy_grads(models[0], *models[1:])
    for opt in opts:
        opt.step()


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
