"""Helpers of the consistency-mode tests (test_sync.py, test_quorum_and_staleness.py): servers
with their /metrics, and the small MLP every trainer and the oracle share.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Sequence

import torch

from prometheus_text import Samples, scrape_samples
from server_fixture import running_server

RTOL = 1.3e-6  # test_parity.py's: PyTorch's own for fused vs for-loop AdamW.
ATOL = 1e-5
SLICE_ELEMENTS = 64  # 0.weight (144 elements) and 2.weight (72) are cut into slices.
GROUP = "sync"
LR, WEIGHT_DECAY = 0.01, 0.1


# -- servers and their metrics -----------------------------------------------------------------

@dataclass(frozen=True)
class Shard:
    target: str  # gRPC, "127.0.0.1:<port>"
    metrics_port: int


@contextlib.contextmanager
def running_shards(count: int, args: Sequence[str]):
    """`count` servers with the same flags; yields their Shards."""
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="fusedps-sync-"))
        shards = []
        for i in range(count):
            port_file = os.path.join(tmp, f"metrics-port-{i}")
            # The server writes its metrics port file before its gRPC one.
            target = stack.enter_context(
                running_server([f"--metrics-port-file={port_file}", *args]))
            with open(port_file) as f:
                shards.append(Shard(target, int(f.read())))
        yield shards


def scrape(shard: Shard) -> Samples:
    return scrape_samples(shard.metrics_port)


# -- the model and its data --------------------------------------------------------------------

def make_mlp() -> torch.nn.Module:
    """The same small MLP in every trainer and in the oracle: 4 tensors, 2 cut into slices."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def trainer_loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    """The loss of trainer `rank` at `step`, on its own slice of (deterministic) data."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)
