"""Large asynchronous copies between host and device, queued in pieces.

Internal module of fusedps.torch (RemoteAdamW(overlap=True)'s delayed pull, whose values the
optimizer's worker thread copies to the device while the loop goes on). A copy engine runs the
copies of its direction in the order they were queued, whatever their stream. A training loop
makes small synchronous copies of its own (a batch's ``inputs.to(device)``), and one queued
behind a large copy of fusedps waits for all of it: a GPT-2-small step's 170 MB of bf16 values
is about 3.5 ms at 50 GB/s. Queued in pieces of PIECE_BYTES by a thread beside the loop, the
pieces go in one by one, so the loop's copy goes in between them and waits for the few
queued before it. (Pieces queued all at once, from the loop's own thread, would not help.)
"""

from __future__ import annotations

import torch

__all__ = ["PIECE_BYTES", "copy_in_pieces"]

PIECE_BYTES = 8 << 20


def copy_in_pieces(dst: torch.Tensor, src: torch.Tensor, piece_bytes: int = PIECE_BYTES) -> None:
    """dst.copy_(src, non_blocking=True), queued as copies of at most piece_bytes of dst each.

    dst and src: 1-D tensors of the same numel (dtypes may differ, as copy_ converts), one on
    the host (pinned, for the copy to be asynchronous) and one on the device; queued on the
    current stream. ValueError when they are not 1-D or their numels differ."""
    if dst.dim() != 1 or src.dim() != 1 or dst.numel() != src.numel():
        raise ValueError(f"copy_in_pieces: 1-D tensors of one numel, got {tuple(dst.shape)} "
                         f"and {tuple(src.shape)}")
    n = dst.numel()
    step = max(1, piece_bytes // dst.element_size())
    for begin in range(0, n, step):
        end = min(n, begin + step)
        dst[begin:end].copy_(src[begin:end], non_blocking=True)
