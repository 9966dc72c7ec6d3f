"""GradScaler on every torch version, for the end-to-end tests.

torch.amp.GradScaler("cpu") where torch has it (>= 2.3); on older torch (Debian's 1.13), whose
GradScaler is CUDA-only, torch's own torch.cuda.amp.GradScaler class with its two CUDA-only
kernels (unscale-and-check, scale update) redone in Python on CPU tensors, so that its
step()/unscale_()/update() logic, which RemoteAdamW plugs into, is torch's. On DEVICE cuda
(FUSEDPS_TEST_DEVICE=cuda with CUDA), a real CUDA GradScaler.
"""

from __future__ import annotations

import os
from collections import defaultdict
from unittest import mock

import torch

DEVICE = torch.device("cuda" if os.environ.get("FUSEDPS_TEST_DEVICE") == "cuda"
                      and torch.cuda.is_available() else "cpu")

class CpuGradScaler(torch.cuda.amp.GradScaler):
    """torch 1.x's GradScaler on CPU tensors: its two CUDA-only kernels redone in Python, all
    the rest (step, unscale_, stages, per-optimizer found_inf records) torch's own code."""

    def __init__(self, **kwargs):
        import torch.cuda.amp.grad_scaler as gs

        with mock.patch.object(gs, "amp_definitely_not_available", return_value=False):
            super().__init__(**kwargs)

    def scale(self, outputs):
        if self._scale is None:
            self._scale = torch.full((1,), float(self._init_scale))
            self._growth_tracker = torch.zeros(1, dtype=torch.int32)
        return outputs * self._scale

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        if not torch.isfinite(p.grad).all():
                            found_inf.fill_(1.0)
                        p.grad.mul_(inv_scale)
        return {found_inf.device: found_inf}

    def update(self, new_scale=None):
        from torch.cuda.amp.grad_scaler import _refresh_per_optimizer_state

        found = [f for s in self._per_optimizer_states.values()
                 for f in s["found_inf_per_device"].values()]
        assert found, "No inf checks were recorded prior to update."
        if sum(float(f.item()) for f in found):
            self._scale.mul_(self._backoff_factor)
            self._growth_tracker.zero_()
        else:
            self._growth_tracker += 1
            if int(self._growth_tracker.item()) == self._growth_interval:
                self._scale.mul_(self._growth_factor)
                self._growth_tracker.zero_()
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def make_scaler(init_scale: float = 1024.0, growth_interval: int = 10_000):
    """A GradScaler for DEVICE (see the module docstring)."""
    kwargs = dict(init_scale=init_scale, growth_interval=growth_interval)
    amp_scaler = getattr(torch.amp, "GradScaler", None)
    if DEVICE.type == "cuda":
        return amp_scaler("cuda", **kwargs) if amp_scaler else torch.cuda.amp.GradScaler(**kwargs)
    if amp_scaler is not None:
        return amp_scaler("cpu", **kwargs)
    return CpuGradScaler(**kwargs)
