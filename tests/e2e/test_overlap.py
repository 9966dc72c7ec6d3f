"""RemoteAdamW(overlap=True) against torch.optim.AdamW (the oracle), over real CPU servers.

The gradients leave during backward, in small buckets, and step() commits them. For each
standard recipe, one training function runs 24 steps with either optimizer on the same
batches: plain steps with an lr scheduler; clip_grad_norm_ between backward and step; a
GradScaler with a fixed scale, unscale_ and clipping; 4 micro-batches with no_sync(); a gradient
changed in place after its bucket left. Params and optimizer state must then match within
test_parity.py's tolerances (torch's own for fused vs for-loop AdamW), with no step pushed again
in full (but the last recipe's, which must be).

Each recipe has a negative control: the same run with the mechanism that keeps it exact
switched off (monkeypatched) must fail the same check, so that these tests can fail.
Then: the one-step-delayed update against a torch reference that computes each gradient on the
parameters of two steps back, sharded servers, a param that stops having a gradient, a
GradScaler's overflow, a scheduler's lr sent during backward, and a failed send of it. With FUSEDPS_TEST_DEVICE=cuda (on a GPU machine) the models train on the
GPU, so that the staging on a side stream, the check and the pulls' device copies run there,
and the recipes run through a device workspace too (data_plane="device": the server's GPU
memory, copies device to device; skipped without a GPU).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, Dict, List, Tuple

import pytest
import torch

import fusedps
from fusedps import _overlap
from fusedps.plan import make_plan
from fusedps.torch import RemoteAdamW
from grad_scalers import DEVICE, make_scaler
from server_fixture import running_server

RTOL = 1.3e-6  # test_parity.py's: torch's own for fused vs for-loop AdamW.
ATOL = 1e-5
STEPS = 24
HYPER = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.05)
RECIPES = ("plain", "clip", "scaler", "accumulate", "inplace")
# A device workspace needs a trainer and a server on one GPU (FUSEDPS_TEST_DEVICE=cuda).
ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda",
                            reason="a device workspace needs FUSEDPS_TEST_DEVICE=cuda and CUDA")
DEVICE_PLANE = pytest.param("device", marks=ON_GPU)


class Mlp(torch.nn.Module):
    def __init__(self, seed: int, extra: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
            torch.nn.Linear(48, 4))
        self.extra = torch.nn.Linear(48, 4) if extra else None
        self.to(DEVICE)

    def forward(self, x, use_extra: bool = False):
        h = self.layers[:4](x)
        out = self.layers[4](h)
        return out + self.extra(h) if use_extra else out


def batch(step: int, micro: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + 10 * step + micro)
    x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
    return x.to(DEVICE), y.to(DEVICE)


def loss_of(model, step: int, micro: int = 0, parts: int = 1, use_extra: bool = False):
    x, y = batch(step, micro)
    return torch.nn.functional.cross_entropy(model(x, use_extra), y) / parts


def train(recipe: str, opt, model: Mlp, steps: int = STEPS):
    """The same loop for either optimizer; RemoteAdamW's no_sync where DDP users put it."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.6)
    scaler = make_scaler(init_scale=1024.0, growth_interval=1_000_000)
    remote = isinstance(opt, RemoteAdamW)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if recipe == "accumulate":
            for micro in range(4):
                quiet = opt.no_sync() if remote and micro < 3 else contextlib.nullcontext()
                with quiet:
                    loss_of(model, step, micro, parts=4).backward()
        elif recipe == "scaler":
            scaler.scale(loss_of(model, step)).backward()
        else:
            loss_of(model, step).backward()
        if recipe == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.3)
        if recipe == "inplace":  # One gradient changed after its bucket left.
            model.layers[2].weight.grad[0].mul_(-0.5)
        if recipe == "scaler":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.3)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()


def assert_close(ours: RemoteAdamW, model: Mlp, ref: torch.optim.AdamW, ref_model: Mlp):
    ours.wait_parameters()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name}: {m}")
    theirs = ref.state_dict()["state"]
    mine = ours.state_dict()["state"]
    assert set(mine) == set(theirs)
    for i, entry in mine.items():
        assert int(entry["step"]) == int(theirs[i]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(entry[key], theirs[i][key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"state {i} {key}: {m}")


def run_recipe(target: str, recipe: str, prefix: str, transport: str = "auto",
               data_plane: str = "workspace", push_during_backward=None,
               pull_with_commit=None, expect_carried=None) -> Tuple[RemoteAdamW, Mlp]:
    """Trains both ways and checks them: parity, and no full push but the inplace recipe's
    (when the gradients leave during backward; pushed at step(), nothing left before the loop
    changed one, so no step is pushed again). pull_with_commit: whether each step's commit
    carries its pull (PushCommit.pull; None: the default, through a device workspace only);
    every step that was not pushed again in full must then have had its pull carried (unless
    expect_carried says otherwise)."""
    model, ref_model = Mlp(1), Mlp(1)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    opt = RemoteAdamW(model.named_parameters(), targets=target, prefix=prefix, overlap=True,
                      bucket_bytes=2048, client_options={"transport": transport},
                      data_plane=data_plane, push_during_backward=push_during_backward,
                      **HYPER)
    # The default: during backward, but on a device workspace.
    expected = data_plane != "device" if push_during_backward is None else push_during_backward
    if pull_with_commit is not None:
        opt._overlap.pull_with_commit = pull_with_commit
    carried = data_plane == "device" if pull_with_commit is None else pull_with_commit
    if expect_carried is not None:
        carried = expect_carried
    try:
        assert opt.data_plane_in_use == data_plane
        assert opt.push_during_backward_in_use == expected
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            train(recipe, opt, model)
        train(recipe, ref, ref_model)
        assert_close(opt, model, ref, ref_model)
        assert opt._overlap.pulls.carried == (STEPS - opt.overlap_fallbacks if carried else 0)
        if not expected:  # Everything left at step(), after the loop was done with it.
            assert opt.overlap_fallbacks == 0, "a step was pushed again in full"
            assert opt._overlap.buckets_before_step == 0
            assert opt.last_step_timings["push_seconds"] > 0
        elif recipe == "inplace":
            assert opt.overlap_fallbacks == STEPS
            assert any("changed after it was sent" in str(w.message) for w in caught)
        else:
            assert opt.overlap_fallbacks == 0, "a step was pushed again in full"
            # Pushed during backward: buckets were staged before step() on every step.
            assert opt._overlap.buckets_before_step > 1
            assert opt.last_step_timings["push_seconds"] > 0
        return opt, model
    finally:
        opt.close()
        # Still reported after close() (the self-check prints it then).
        assert opt.push_during_backward_in_use == expected


@pytest.mark.parametrize("data_plane, push_during_backward, pull_with_commit", [
    ("workspace", None, None), ("grpc", None, None), ("workspace", False, None),
    ("grpc", False, None), ("workspace", False, True), ("workspace", True, True),
    pytest.param("device", None, None, marks=ON_GPU),
    pytest.param("device", True, None, marks=ON_GPU),
    pytest.param("device", None, False, marks=ON_GPU)])
@pytest.mark.parametrize("recipe", RECIPES)
def test_overlap_matches_torch(server_target, recipe, data_plane, push_during_backward,
                               pull_with_commit):
    """Through a same-host workspace (what a trainer beside its server gets), a device one
    (on a GPU) and over gRPC (the native transport), with the gradients pushed during
    backward or at step() (push_during_backward; a device workspace's default is at step()),
    and the pull carried by the commit or not (pull_with_commit; a device workspace's
    default): the same results."""
    run_recipe(server_target, recipe,
               prefix=f"{recipe}-{data_plane}-{push_during_backward}-{pull_with_commit}/",
               data_plane=data_plane, push_during_backward=push_during_backward,
               pull_with_commit=pull_with_commit)


@pytest.mark.parametrize("data_plane", ["workspace", "grpc", DEVICE_PLANE])
def test_overlap_over_grpcio_matches_torch(server_target, data_plane):
    """Without the native transport the pulls land on Python threads (_WorkspaceLanding,
    _ThreadLanding), and the pushes go through grpcio: the same results."""
    run_recipe(server_target, "clip", prefix=f"grpcio-clip-{data_plane}/", transport="grpcio",
               data_plane=data_plane)


# What keeps each recipe exact, switched off: each must make its recipe fail.
SWITCH_OFF: Dict[str, Callable] = {
    # The lr the scheduler set is never sent.
    "plain": lambda mp: mp.setattr(RemoteAdamW, "_changed_hyperparameters",
                                   lambda self, mark=False: []),
    # The check believes every gradient is as it was sent (so no clipping factor, no unscale).
    "clip": lambda mp: mp.setattr(_overlap.OverlapEngine, "_check",
                                  lambda self, step: (True, True, True, 1.0)),
    "scaler": lambda mp: mp.setattr(_overlap.OverlapEngine, "_check",
                                    lambda self, step: (True, True, True, 1.0)),
    # The earlier micro-batches push: their buckets go out, and the step is pushed again.
    "accumulate": lambda mp: mp.setattr(RemoteAdamW, "no_sync",
                                        lambda self: contextlib.nullcontext()),
    "inplace": lambda mp: mp.setattr(_overlap.OverlapEngine, "_check",
                                     lambda self, step: (True, True, True, 1.0)),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_fails_with_its_mechanism_switched_off(server_target, recipe, monkeypatch):
    SWITCH_OFF[recipe](monkeypatch)
    with pytest.raises(AssertionError):
        run_recipe(server_target, recipe, prefix=f"off-{recipe}/")


def stale_reference_step(ref, ref_model: Mlp, stale: Mlp, delayed: bool) -> None:
    """The delayed update's reference: ref (torch.optim.AdamW of ref_model) steps with the
    gradients that backward left in ``stale``; then ``stale`` takes the parameters its next
    gradients must be computed at: ref_model's before this step when delayed (staleness 1),
    after it otherwise."""
    before = [q.detach().clone() for q in ref_model.parameters()]
    for q, s in zip(ref_model.parameters(), stale.parameters()):
        q.grad = s.grad.clone()
    ref.step()
    values = before if delayed else [q.detach() for q in ref_model.parameters()]
    with torch.no_grad():
        for s, v in zip(stale.parameters(), values):
            s.copy_(v)


def assert_params_equal(model: Mlp, stale: Mlp, step: int) -> None:
    for (name, p), s in zip(model.named_parameters(), stale.parameters()):
        torch.testing.assert_close(p.detach(), s.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"step {step} {name}: {m}")


@pytest.mark.parametrize("transport, data_plane",
                         [("auto", "workspace"), ("auto", "grpc"), ("grpcio", "grpc"),
                          pytest.param("auto", "device", marks=ON_GPU),
                          pytest.param("grpcio", "device", marks=ON_GPU)])
def test_delayed_update_matches_a_reference_one_step_stale(server_target, transport,
                                                           data_plane):
    """delay=1 after 3 warm-up steps: each gradient is computed on the parameters of two steps
    back and applied to those of the step before, exactly as the reference does it."""
    warmup = 3
    model, ref_model, stale = Mlp(3), Mlp(3), Mlp(3)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target,
                      prefix=f"delay-{transport}-{data_plane}/", overlap=True,
                      bucket_bytes=2048, delay=1, delay_warmup=warmup,
                      client_options={"transport": transport}, data_plane=data_plane, **HYPER)
    try:
        assert opt._overlap.data_plane == data_plane
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss_of(model, step).backward()
            opt.step()
            stale.zero_grad(set_to_none=True)
            loss_of(stale, step).backward()
            stale_reference_step(ref, ref_model, stale, step >= warmup)
            opt.wait_parameters()  # In the warm-up, the pull lands during the next forward.
            assert_params_equal(model, stale, step)
        assert opt.overlap_fallbacks == 0
        opt.wait_parameters()
        theirs = ref.state_dict()["state"]
        for i, entry in opt.state_dict()["state"].items():  # The server: every step applied.
            assert int(entry["step"]) == int(theirs[i]["step"]) == STEPS
            torch.testing.assert_close(entry["exp_avg"], theirs[i]["exp_avg"], rtol=RTOL,
                                       atol=ATOL)
    finally:
        opt.close()


def test_delayed_steps_take_accumulated_clipped_gradients(server_target):
    """Once delayed, RemoteAdamW has no gradient hooks and stages at step(): 2 micro-batches
    (the first under no_sync), clip_grad_norm_ and zero_grad(set_to_none=False) must still give
    the reference's one-step-stale steps, with no fallback."""
    warmup, parts, max_norm = 2, 2, 0.5
    model, ref_model, stale = Mlp(5), Mlp(5), Mlp(5)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target, prefix="delay-recipe/",
                      overlap=True, bucket_bytes=2048, delay=1, delay_warmup=warmup, **HYPER)

    def accumulate(m, step, sync_context):
        for micro in range(parts):
            with sync_context() if micro < parts - 1 else contextlib.nullcontext():
                loss_of(m, step, micro, parts).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)

    try:
        for step in range(STEPS):
            opt.zero_grad(set_to_none=False)
            accumulate(model, step, opt.no_sync)
            opt.step()
            stale.zero_grad(set_to_none=True)
            accumulate(stale, step, contextlib.nullcontext)
            stale_reference_step(ref, ref_model, stale, step >= warmup)
            opt.wait_parameters()
            assert_params_equal(model, stale, step)
        assert opt.overlap_fallbacks == 0
    finally:
        opt.close()


def test_sharded_servers_match_torch():
    """Two servers, the tensors cut into slices of 500 elements: each step is a push on
    each server, its slices written from the bucket they are in."""
    with running_server() as a, running_server() as b, contextlib.ExitStack() as stack:
        model, ref_model = Mlp(4), Mlp(4)
        ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
        plan = make_plan([(n, tuple(p.shape), "group0") for n, p in model.named_parameters()],
                         2, slice_elements=500)
        client = fusedps.ShardedClient([a, b], plan=plan, streams=2)
        stack.callback(client.close)
        opt = RemoteAdamW(model.named_parameters(), client=client, overlap=True,
                          bucket_bytes=2048, **HYPER)
        try:
            train("clip", opt, model, steps=12)
            train("clip", ref, ref_model, steps=12)
            assert_close(opt, model, ref, ref_model)
            assert opt.overlap_fallbacks == 0
        finally:
            opt.close()


BOTH_PUSHES = pytest.mark.parametrize("push_during_backward", [True, False])


@BOTH_PUSHES
def test_a_param_that_loses_its_gradient_is_pushed_in_full_once(server_target,
                                                                 push_during_backward):
    """extra has a gradient on even steps only: each change of the set of params with a
    gradient pushes that step in full (warned once); the results stay exact."""
    model, ref_model = Mlp(5, extra=True), Mlp(5, extra=True)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target,
                      prefix=f"extra-{push_during_backward}/", overlap=True, bucket_bytes=2048,
                      push_during_backward=push_during_backward, **HYPER)
    try:
        with pytest.warns(RuntimeWarning, match="set of params with a gradient changed"):
            for step in range(6):
                for m, o in ((model, opt), (ref_model, ref)):
                    o.zero_grad(set_to_none=True)
                    loss_of(m, step, use_extra=step < 3).backward()
                    o.step()
        assert opt.overlap_fallbacks == 1  # Step 3, when extra stopped having a gradient.
        assert_close(opt, model, ref, ref_model)
    finally:
        opt.close()


@BOTH_PUSHES
def test_a_scaler_overflow_skips_the_step_as_torch_does(server_target, push_during_backward):
    model, ref_model = Mlp(6), Mlp(6)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target,
                      prefix=f"inf-{push_during_backward}/", overlap=True, bucket_bytes=2048,
                      push_during_backward=push_during_backward, **HYPER)
    scalers = [make_scaler(init_scale=1024.0), make_scaler(init_scale=1024.0)]
    try:
        for step in range(4):
            for m, o, scaler in ((model, opt, scalers[0]), (ref_model, ref, scalers[1])):
                o.zero_grad(set_to_none=True)
                loss = loss_of(m, step) * (float("inf") if step == 2 else 1.0)
                scaler.scale(loss).backward()
                scaler.step(o)
                scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale() == 512.0
        assert_close(opt, model, ref, ref_model)
        assert opt.overlap_fallbacks == 0
    finally:
        opt.close()



def lrs_sent_before_step(target: str, prefix: str, pull_with_commit=None,
                         **kwargs) -> List[bool]:
    """Six steps under a scheduler that changes the lr every step (each new lr sent once):
    for each step after the first, whether its lr was at the server before step().
    kwargs: RemoteAdamW's; pull_with_commit: as run_recipe's."""
    model = Mlp(8)
    opt = RemoteAdamW(model.named_parameters(), targets=target, prefix=prefix, overlap=True,
                      bucket_bytes=2048, **kwargs, **HYPER)
    if pull_with_commit is not None:
        opt._overlap.pull_with_commit = pull_with_commit
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    real, sent = opt.client.set_hyperparameters, []

    def recording(group, **kwargs):
        sent.append(kwargs["lr"])
        return real(group, **kwargs)

    opt.client.set_hyperparameters = recording
    before = []
    try:
        for step in range(6):
            opt.zero_grad(set_to_none=True)
            loss_of(model, step).backward()
            opt._overlap._call(lambda: None).result()  # The worker's queue so far, done.
            before.append(bool(sent) and sent[-1] == opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
            assert sent == [HYPER["lr"] * (1.0 / (1 + k)) for k in range(1, step + 1)]
    finally:
        opt.close()
    return before[1:]  # Step 0 has the registered lr.


@pytest.mark.parametrize("push_during_backward, early_send", [
    (True, "_queue_hyperparameters"), (False, "_on_pull_landed")])
def test_a_changed_lr_goes_before_step(server_target, monkeypatch, push_during_backward,
                                       early_send):
    """The scheduler's lr changes every step: it is sent once the step's first gradient is
    ready (on the worker, behind backward), or without gradient hooks once the last step's
    pull has landed (behind the forward), so it is at the server before step() and the commit
    sends nothing. The control: with the early send switched off, it goes at step()."""
    prefix = f"lr-{push_during_backward}"
    assert lrs_sent_before_step(server_target, f"{prefix}-early/",
                                push_during_backward=push_during_backward) == [True] * 5
    monkeypatch.setattr(_overlap.OverlapEngine, early_send, lambda self, *step: None)
    assert lrs_sent_before_step(server_target, f"{prefix}-late/",
                                push_during_backward=push_during_backward) == [False] * 5


@BOTH_PUSHES
def test_a_failed_lr_send_fails_its_step_and_the_next_sends_it_again(server_target,
                                                                     push_during_backward):
    """The early send of step 5's lr (during backward, or at the start of step() without
    gradient hooks) fails: that step raises and applies nothing; the next step sends every
    group's hyperparameters again, and the run goes on equal to torch's with step 5 left
    out."""
    model, ref_model = Mlp(9), Mlp(9)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target,
                      prefix=f"lr-fail-{push_during_backward}/", overlap=True, bucket_bytes=2048,
                      push_during_backward=push_during_backward, **HYPER)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (opt, ref)]
    real = opt.client.set_hyperparameters
    calls = []

    def failing_once(group, **kwargs):
        calls.append(kwargs["lr"])
        if len(calls) == 1:
            raise RuntimeError("injected: set_hyperparameters failed")
        return real(group, **kwargs)

    opt.client.set_hyperparameters = failing_once
    try:
        for step in range(12):
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad(set_to_none=True)
                loss_of(m, step).backward()
            if step == 5:
                with pytest.raises(RuntimeError, match="injected"):
                    opt.step()
            else:
                opt.step()
                ref.step()
            for sched in scheds:
                sched.step()
        assert calls == [0.005, 0.005, 0.0025]  # Failed, sent again at step 6, step 10's.
        assert_close(opt, model, ref, ref_model)
    finally:
        opt.close()


def test_buckets_are_written_by_the_hooks_not_the_worker(server_target, monkeypatch):
    """A bucket staged during backward is written into the push by a later gradient hook once
    its copy is done (or by step()), never by the worker thread: each time the worker takes
    the interpreter lock, backward's hooks wait for it (docs/benchmarks.md, run Z7). A hook
    on the first layer's weight (its gradient comes last) waits for the worker's begin of the
    push, so that the hook after it has buckets to write and a push to write them into."""
    from fusedps import _push_transaction

    writes: List[Tuple[str, int, bool]] = []
    in_step = [False]
    real = _push_transaction.PushTransaction.write_prepared

    def recording(self, prepared):
        import threading
        writes.append((threading.current_thread().name, step_now[0], in_step[0]))
        return real(self, prepared)

    monkeypatch.setattr(_push_transaction.PushTransaction, "write_prepared", recording)
    model, ref_model = Mlp(10), Mlp(10)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target, prefix="hook-writes/",
                      overlap=True, bucket_bytes=2048, push_during_backward=True, **HYPER)

    def wait_for_begin(grad):
        begun = opt._overlap._step.begun
        if begun is not None:
            begun.result()
        return grad

    model.layers[0].weight.register_hook(wait_for_begin)
    step_now = [0]
    try:
        for step in range(4):
            step_now[0] = step
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad(set_to_none=True)
                loss_of(m, step).backward()
            in_step[0] = True
            opt.step()
            ref.step()
            in_step[0] = False
        assert_close(opt, model, ref, ref_model)
    finally:
        opt.close()
    assert writes and all(name != "fusedps-overlap" for name, _, _ in writes), writes
    for step in range(4):  # Every step wrote some buckets during backward.
        assert any(s == step and not during_step for _, s, during_step in writes), writes


def test_without_hooks_a_training_forward_begins_the_push_an_evaluation_does_not(server_target):
    """push_during_backward=False: once the last step's pull has landed in a forward with grad
    on, the next push begins on the worker (off step()'s path); when it lands in a forward
    under no_grad (an evaluation), only the changed lr goes, and the push begins at step().
    The values stay torch's either way."""
    model, ref_model = Mlp(11), Mlp(11)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    # A host workspace: through a device one the commit carries the pull, and step() begins
    # the next push itself (test_overlap_commit_pull.py).
    opt = RemoteAdamW(model.named_parameters(), targets=server_target, prefix="begin-early/",
                      overlap=True, push_during_backward=False, data_plane="workspace", **HYPER)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9) for o in (opt, ref)]
    engine = opt._overlap
    began = []
    try:
        for step in range(8):
            evaluate = step % 2 == 0
            if evaluate:
                with torch.no_grad():  # Its forward lands the last step's pull.
                    model(batch(step)[0])
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad(set_to_none=True)
                loss_of(m, step).backward()
            began.append(engine._step.begun is not None)
            opt.step()
            ref.step()
            for sched in scheds:
                sched.step()
        assert_close(opt, model, ref, ref_model)
        # Step 0 has no pull to land; then odd steps' training forwards begin the push.
        assert began == [False, True] * 4, began
    finally:
        opt.close()


@pytest.mark.parametrize("begin_again", [True, False])
def test_a_push_begun_long_before_step_is_begun_again(monkeypatch, begin_again):
    """A forward with grad on begins the next push; the loop then pauses past the server's
    --call-idle-seconds (1 s here), which ends the idle call. step() begins it again
    (BEGUN_MAX_SECONDS) and the values stay torch's. The control: without that, the step
    fails on the ended call."""
    if not begin_again:
        monkeypatch.setattr(_overlap, "BEGUN_MAX_SECONDS", 1e9)
    with running_server(["--call-idle-seconds=1"]) as target:
        model, ref_model = Mlp(12), Mlp(12)
        ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
        opt = RemoteAdamW(model.named_parameters(), targets=target, prefix="idle/",
                          overlap=True, push_during_backward=False, **HYPER)
        try:
            def steps():
                for step in range(3):
                    for m, o in ((model, opt), (ref_model, ref)):
                        o.zero_grad(set_to_none=True)
                        loss = loss_of(m, step)
                        if o is opt and step == 1:
                            time.sleep(2.5)  # After the forward that began the push.
                        loss.backward()
                    opt.step()
                    ref.step()

            if begin_again:
                steps()
                assert_close(opt, model, ref, ref_model)
            else:
                with pytest.raises(Exception):
                    steps()
        finally:
            opt.close()
