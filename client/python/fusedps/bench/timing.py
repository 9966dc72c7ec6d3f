"""Where a timed training loop's phases end on CUDA (the self-check and examples/train_gpt.py).

A phase ends when the loop's own stream (the current one) has done its work: work that a phase
queued on other streams (RemoteAdamW's gradient copies to the host, its pulls' copies to the
device) goes on behind the next phase, as it does in a loop that nobody times, and the
optimizer's next step() waits for what it needs of it, so a step's time over many steps still
holds all of it. ``every_stream`` waits for the whole device instead: work behind a phase then
counts in the phase that queued it.
"""

from __future__ import annotations

import torch

__all__ = ["synchronize"]


def synchronize(device: torch.device, every_stream: bool = False) -> None:
    """Waits for the current stream of ``device`` (every stream with ``every_stream``); nothing
    on the CPU."""
    if device.type != "cuda":
        return
    if every_stream:
        torch.cuda.synchronize(device)
    else:
        torch.cuda.current_stream(device).synchronize()
