"""End-to-end parity: fusedps-server's AdamW against PyTorch's (the oracle).

Each case registers random tensors on a real server (CPU backend), pushes the same random
gradients that it gives to torch.optim.AdamW (foreach=False; torch.optim.Adam for L2 decay),
then pulls params, exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad) and the step counts
and compares them: torch.testing.assert_close(rtol=1.3e-6, atol=1e-5), PyTorch's own tolerance
for fused vs for-loop AdamW; steps exactly.

Every case uses its own param group and tensor names, so one server serves the whole module.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch


RTOL = 1.3e-6
ATOL = 1e-5

SMALL_SHAPES = [(17,), (8, 33), (4, 3, 5)]
# A 0-dim tensor, a 1-element one, one of 4.4 MB (split into several chunks and larger than
# gRPC's default 4 MiB message), odd 2-D and 3-D ones.
MIXED_SHAPES = [(), (1,), (1_100_000,), (257, 129), (3, 1, 7), (1000,)]


@dataclass
class Case:
    hyper: Dict = field(default_factory=dict)  # register_param_group kwargs
    shapes: Sequence[Tuple[int, ...]] = tuple(SMALL_SHAPES)
    steps: int = 6
    grad_dtype: str = "float32"
    grad_scale: Optional[float] = None
    lr_changes: Dict[int, float] = field(default_factory=dict)  # before step i: new lr
    # subsets[i]: indices of the tensors pushed at step i (None: all)
    subsets: Optional[List[Optional[List[int]]]] = None
    rtol: float = RTOL
    atol: float = ATOL


CASES = {
    "defaults": Case(),
    "lr_0.01": Case(hyper=dict(lr=0.01)),
    "weight_decay": Case(hyper=dict(weight_decay=0.1)),
    "weight_decay_maximize": Case(hyper=dict(weight_decay=0.1, maximize=True)),
    "weight_decay_amsgrad": Case(hyper=dict(weight_decay=0.1, amsgrad=True), steps=8),
    "l2": Case(hyper=dict(weight_decay=0.1, decoupled_weight_decay=False)),
    "l2_amsgrad_maximize": Case(hyper=dict(lr=0.01, weight_decay=0.05, amsgrad=True,
                                           maximize=True, decoupled_weight_decay=False)),
    "betas_eps": Case(hyper=dict(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)),
    "bf16_grads": Case(grad_dtype="bfloat16"),
    "fp16_grads": Case(grad_dtype="float16"),
    "grad_scale": Case(grad_scale=1000.0),
    "bf16_grads_grad_scale": Case(grad_dtype="bfloat16", grad_scale=512.0),
    "lr_change": Case(hyper=dict(lr=0.01), steps=7, lr_changes={3: 0.002, 5: 0.05}),
    "mixed_sizes": Case(hyper=dict(lr=0.01, weight_decay=0.1), shapes=MIXED_SHAPES, steps=5),
    "subsets": Case(
        shapes=[(13,), (5, 7), (), (64,)],
        steps=7,
        # tensor 3 is never pushed: its step stays 0 and its state zero
        subsets=[[0, 1, 2], [0], [1, 2], [0, 1, 2], [2], [0, 2], [1]]),
}


def _torch_optimizer(params, hyper: Dict):
    kw = dict(lr=hyper.get("lr", 1e-3), betas=hyper.get("betas", (0.9, 0.999)),
              eps=hyper.get("eps", 1e-8), weight_decay=hyper.get("weight_decay", 1e-2),
              amsgrad=hyper.get("amsgrad", False), maximize=hyper.get("maximize", False),
              foreach=False)
    if hyper.get("decoupled_weight_decay", True):
        return torch.optim.AdamW(params, **kw)
    return torch.optim.Adam(params, **kw)


def _wire_round(g: torch.Tensor, grad_dtype: str) -> torch.Tensor:
    """What the server sees of an fp32 gradient sent as grad_dtype, as fp32."""
    if grad_dtype == "float32":
        return g.clone()
    return g.to(getattr(torch, grad_dtype)).to(torch.float32)


def _assert_matches_torch(client, names, params, opt, amsgrad, rtol, atol, msg=""):
    pulled = client.pull_parameters(names)
    steps_expected = {}
    for n, p in zip(names, params):
        st = opt.state.get(p, {})
        steps_expected[n] = int(st["step"].item()) if "step" in st else 0
    assert pulled.steps == steps_expected, msg
    for n, p in zip(names, params):
        assert pulled[n].dtype == torch.float32 and pulled[n].shape == p.shape, n
        torch.testing.assert_close(pulled[n], p.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{msg} param {n}: {m}")
    fields = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    for f in fields:
        state, _, steps = client.pull_state(f, names)
        assert steps == steps_expected
        for n, p in zip(names, params):
            expected = opt.state[p][f] if p in opt.state else torch.zeros_like(p)
            torch.testing.assert_close(state[n], expected.detach(), rtol=rtol, atol=atol,
                                       msg=lambda m: f"{msg} {f} {n}: {m}")


@pytest.mark.parametrize("case_id", list(CASES))
def test_parity(client, case_id):
    case = CASES[case_id]
    gen = torch.Generator().manual_seed(zlib.crc32(case_id.encode()))
    group = f"parity-{case_id}"
    stored = client.register_param_group(group, **case.hyper)
    assert stored.name == group
    if "lr" in case.hyper:
        assert stored.lr == pytest.approx(case.hyper["lr"])

    names = [f"{case_id}/t{i}" for i in range(len(case.shapes))]
    inits = [torch.randn(s, generator=gen) for s in case.shapes]
    reg = client.register_model(list(zip(names, inits)), param_group=group)
    assert (reg.tensors_created, reg.tensors_existing) == (len(names), 0)

    params = [torch.nn.Parameter(x.clone()) for x in inits]
    opt = _torch_optimizer(params, case.hyper)
    version = client.info().version

    for step in range(case.steps):
        if step in case.lr_changes:
            new_lr = case.lr_changes[step]
            g = client.set_hyperparameters(group, lr=new_lr)
            assert g.lr == pytest.approx(new_lr)
            for pg in opt.param_groups:
                pg["lr"] = new_lr
        subset = case.subsets[step] if case.subsets else None
        idx = list(range(len(names))) if subset is None else subset
        grads = {}
        for i, p in enumerate(params):
            if i in idx:
                g = torch.randn(p.shape, generator=gen)
                if case.grad_scale is not None:
                    g = g * case.grad_scale
                grads[names[i]] = g
                seen = _wire_round(g, case.grad_dtype)
                p.grad = seen / case.grad_scale if case.grad_scale is not None else seen
            else:
                p.grad = None
        result = client.push_gradients(grads, grad_dtype=case.grad_dtype,
                                       grad_scale=case.grad_scale)
        opt.step()
        assert not result.step_skipped, result
        assert not result.duplicate
        assert result.tensors_updated == len(idx)
        assert result.version == version + 1
        version = result.version
        itemsize = 4 if case.grad_dtype == "float32" else 2
        assert result.grad_bytes == sum(grads[names[i]].numel() for i in idx) * itemsize

    _assert_matches_torch(client, names, params, opt, case.hyper.get("amsgrad", False),
                          case.rtol, case.atol, msg=case_id)


NON_FINITE = {
    "nan_fp32": ("float32", None, float("nan")),
    "inf_fp32": ("float32", None, float("inf")),
    "neg_inf_bf16": ("bfloat16", None, float("-inf")),
    "fp16_overflow": ("float16", None, 1e5),  # finite in fp32, inf once sent as fp16
    "nan_with_grad_scale": ("float32", 256.0, float("nan")),
}


def _snapshot(client, names, amsgrad):
    snap = {}
    pulled = client.pull_parameters(names)
    snap["param"] = (dict(pulled), pulled.steps)
    for f in ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else []):
        state, _, steps = client.pull_state(f, names)
        snap[f] = (state, steps)
    return snap


@pytest.mark.parametrize("case_id", list(NON_FINITE))
def test_non_finite_gradient_skips_step(client, case_id):
    grad_dtype, grad_scale, bad = NON_FINITE[case_id]
    gen = torch.Generator().manual_seed(1234)
    group = f"nonfinite-{case_id}"
    hyper = dict(lr=0.01, weight_decay=0.1, amsgrad=True)
    client.register_param_group(group, **hyper)
    shapes = [(33,), (), (6, 5)]
    names = [f"nonfinite-{case_id}/t{i}" for i in range(len(shapes))]
    inits = [torch.randn(s, generator=gen) for s in shapes]
    client.register_model(dict(zip(names, inits)), param_group=group)
    params = [torch.nn.Parameter(x.clone()) for x in inits]
    opt = _torch_optimizer(params, hyper)

    def push(grads):
        for p, n in zip(params, names):
            seen = _wire_round(grads[n], grad_dtype)
            p.grad = seen / grad_scale if grad_scale is not None else seen
        return client.push_gradients(grads, grad_dtype=grad_dtype, grad_scale=grad_scale)

    def good_grads():
        return {n: torch.randn(p.shape, generator=gen) for n, p in zip(names, params)}

    for _ in range(2):
        r = push(good_grads())
        assert not r.step_skipped
        opt.step()

    before = _snapshot(client, names, amsgrad=True)
    version = client.info().version
    grads = good_grads()
    bad_grad = grads[names[2]].clone()
    bad_grad.view(-1)[7] = bad  # one bad element in one of three tensors
    grads[names[2]] = bad_grad
    r = push(grads)  # torch is not stepped: the whole push must be dropped
    assert r.step_skipped, r
    assert r.skip_reason == "non_finite_grad"
    assert r.tensors_updated == 0
    assert r.version == version
    assert client.info().version == version

    after = _snapshot(client, names, amsgrad=True)
    for f in before:
        values_before, steps_before = before[f]
        values_after, steps_after = after[f]
        assert steps_after == steps_before == {n: 2 for n in names}, f
        for n in names:
            assert torch.equal(values_after[n], values_before[n]), (f, n)

    # The next good push is applied as step 3, as torch's.
    r = push(good_grads())
    assert not r.step_skipped and r.version == version + 1
    opt.step()
    _assert_matches_torch(client, names, params, opt, True, RTOL, ATOL, msg=case_id)


@pytest.mark.parametrize("grads_dtype,wire", [(torch.float32, "bfloat16"),
                                              (torch.float16, "float16")])
def test_default_wire_dtype(client, grads_dtype, wire):
    """With no grad_dtype, fp32 gradients travel as bf16 and fp16 ones as fp16; the server's
    step is torch.optim.AdamW's on the gradients rounded to that wire dtype."""
    gen = torch.Generator().manual_seed(99)
    names = [f"default-wire-{wire}/t{i}" for i in range(2)]
    inits = [torch.randn(s, generator=gen) for s in [(300,), (7, 9)]]
    client.register_model(dict(zip(names, inits)))
    params = [torch.nn.Parameter(x.clone()) for x in inits]
    opt = _torch_optimizer(params, {})
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=gen).to(grads_dtype)
                 for n, p in zip(names, params)}
        for n, p in zip(names, params):
            p.grad = _wire_round(grads[n].float(), wire)
        result = client.push_gradients(grads)
        opt.step()
        assert result.grad_bytes == 2 * sum(p.numel() for p in params)
    _assert_matches_torch(client, names, params, opt, False, RTOL, ATOL, msg=wire)
