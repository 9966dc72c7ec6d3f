"""Helpers of the RemoteAdamW tests (test_remote_adamw.py, test_remote_adamw_state_dict.py):
the model, the oracle torch.optim.AdamW, the comparisons, and a step of several optimizers on
the same gradients.

With FUSEDPS_TEST_DEVICE=cuda on a machine with CUDA, the model runs on the GPU under fp16
autocast.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, List

import pytest
import torch

import fusedps

# test_parity.py's tolerance: PyTorch's own for fused vs for-loop AdamW.
RTOL = 1.3e-6
ATOL = 1e-5

DEVICE = torch.device("cuda" if os.environ.get("FUSEDPS_TEST_DEVICE") == "cuda"
                      and torch.cuda.is_available() else "cpu")

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
# The same gradients for several optimizers
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
