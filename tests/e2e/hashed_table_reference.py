"""An independent reference of a hashed embedding table (docs/api.md, "Embedding tables"),
for the end-to-end tests: which key holds which slot, written here from the rules the API
documents, and the rows' values from torch.optim.SparseAdam over the table's slots.

The rules (proto TableOptions): a push's unique keys, ascending; those the table does not hold
take the free slots, smallest first, then the slots of the least recently updated rows (the
smallest (stamp, slot), the stamp being the table step at which a row was created or updated),
never a slot of a key of the same push. Every key of an applied push is stamped with the
table's new step. A created row starts at the initializer's values with zero moments.

The initializer (kernels/row_init.h) is written here with the standard library's log, cos and
sqrt in float64, not the server's fixed polynomials: the two agree to about 1e-15 before the
final rounding to fp32, so a value may differ from the server's in its last bit (the tests'
tolerances cover that, and nothing compounds it: the reference keeps its own rows).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

_MASK = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer (Stafford's Mix13), on unsigned 64-bit ints."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def init_row(seed: int, key: int, init_std: float, dim: int) -> torch.Tensor:
    """The initial params of the row of ``key``: element j is normal(0, std) by Box-Muller's
    cosine half from the 64 bits splitmix64 draws for (seed, key, j), as float32."""
    std = float(np.float32(init_std))
    row_key = _mix64(_mix64(seed & _MASK) ^ (key & _MASK))
    out = []
    for j in range(dim):
        bits = _mix64((row_key + (j + 1) * 0x9E3779B97F4A7C15) & _MASK)
        hi, lo = bits >> 32, bits & 0xFFFFFFFF
        u = (hi + 0.5) / 2.0**32
        t = lo / 2.0**32
        out.append(math.sqrt(-2.0 * math.log(u)) * math.cos(2.0 * math.pi * t) * std)
    return torch.tensor(out, dtype=torch.float64).float()


class HashedTableReference:
    """A hashed table of ``capacity`` slots of ``dim`` floats, stepped by SparseAdam."""

    def __init__(self, capacity: int, dim: int, seed: int, init_std: float, *,
                 bf16_state: bool = False, **hyper):
        self.capacity, self.dim, self.seed, self.init_std = capacity, dim, seed, init_std
        self.weight = torch.nn.Parameter(torch.zeros(capacity, dim))
        self.optimizer = torch.optim.SparseAdam([self.weight], **hyper)
        self.slot_of: Dict[int, int] = {}
        self.key_of: List[Optional[int]] = [None] * capacity
        self.stamp = [-1] * capacity  # -1: a free slot.
        self.step = 0
        self.evictions = 0
        # A table with bf16 state: the moments rounded to bf16 (nearest even) after each step.
        self.bf16_state = bf16_state

    def push(self, keys: torch.Tensor, grads: torch.Tensor) -> int:
        """Applies one push (keys with repeats, their [n, dim] gradient rows); returns the
        number of rows it evicted. The caller checks first that it is not refused."""
        unique = sorted(set(int(k) for k in keys))
        assert len(unique) <= self.capacity
        own = {self.slot_of[k] for k in unique if k in self.slot_of}
        free = [s for s in range(self.capacity) if self.stamp[s] == -1]
        oldest = sorted((self.stamp[s], s) for s in range(self.capacity)
                        if self.stamp[s] != -1 and s not in own)
        created, evicted = [], 0
        for k in unique:
            if k in self.slot_of:
                continue
            if free:
                slot = free.pop(0)
            else:
                slot = oldest.pop(0)[1]
                del self.slot_of[self.key_of[slot]]
                evicted += 1
            self.slot_of[k], self.key_of[slot] = slot, k
            created.append((k, slot))
        self.step += 1
        for k in unique:
            self.stamp[self.slot_of[k]] = self.step
        state = self.optimizer.state.get(self.weight)
        with torch.no_grad():
            for k, slot in created:
                self.weight[slot] = init_row(self.seed, k, self.init_std, self.dim)
                if state:
                    state["exp_avg"][slot] = 0
                    state["exp_avg_sq"][slot] = 0
        slots = torch.tensor([self.slot_of[int(k)] for k in keys], dtype=torch.int64)
        self.weight.grad = torch.sparse_coo_tensor(slots.unsqueeze(0), grads.float(),
                                                   (self.capacity, self.dim))
        self.optimizer.step()
        if self.bf16_state:
            state = self.optimizer.state[self.weight]
            for field in ("exp_avg", "exp_avg_sq"):
                state[field].copy_(state[field].bfloat16().float())
        self.evictions += evicted
        return evicted

    def rows(self, keys: Sequence[int], field: str = "param") -> torch.Tensor:
        """What a lookup of ``keys`` reads: a held key's row, else the initializer's (zeros
        for the moments)."""
        state = self.optimizer.state.get(self.weight)
        out = []
        for k in keys:
            slot = self.slot_of.get(int(k))
            if slot is None:
                out.append(init_row(self.seed, int(k), self.init_std, self.dim)
                           if field == "param" else torch.zeros(self.dim))
            elif field == "param":
                out.append(self.weight.detach()[slot])
            else:
                out.append(state[field][slot])
        return torch.stack(out) if out else torch.zeros(0, self.dim)

    def slots(self) -> torch.Tensor:
        """The table's [capacity, dim] params as pull_parameters reads them (free: zeros)."""
        out = self.weight.detach().clone()
        for s in range(self.capacity):
            if self.stamp[s] == -1:
                out[s] = 0
        return out
