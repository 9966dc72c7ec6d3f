"""How RemoteAdamW(overlap=True) cuts a step's tensors into push buckets and pull groups.

Internal module of fusedps._overlap and fusedps._pull_pipeline. Only the ends of a step are
exposed: what is left to push once backward ends, and what the first layers wait for before
the next forward can start. So the bucket at that end is small (``edge`` bytes) and the ones
further in double up to ``cap``, where each bucket's fixed cost (a gather, a message, a reply)
is spread over many bytes. DDP does the same at its one end: its first bucket is 1 MiB, the
rest ``bucket_cap_mb``. Here a backward's last bucket is the small one (the push), and a
forward's first group (the pull).
"""

from __future__ import annotations

from typing import List, Sequence

__all__ = ["DEFAULT_EDGE_BYTES", "plan_ends"]

# The bucket at the exposed end, when RemoteAdamW's edge_bucket_bytes is None. Each bucket and
# group costs the trainer's CPU beside compute, so fewer is better too: on an H200 (run Z3 of
# docs/dev/benchmark-log.md, bf16 gradients) 4 MiB beat 1 MiB and 0 (every bucket full size)
# for both GPT shapes trained there.
DEFAULT_EDGE_BYTES = 4 << 20


def plan_ends(sizes: Sequence[int], cap: int, edge: int, small_end: str) -> List[int]:
    """Cuts items of ``sizes`` bytes, in order, into consecutive groups; returns the index one
    past each group's last item (ascending; the last is len(sizes)).

    A group closes once it holds its target of bytes: ``edge`` for the group at ``small_end``
    ("head": the first group, "tail": the last), twice that for the next one inwards, and so
    on up to ``cap``; the group at the other end holds what is left. ``edge`` <= 0 or >=
    ``cap``: every target is ``cap`` (counted from the head).
    """
    if small_end not in ("head", "tail"):
        raise ValueError(f"small_end must be 'head' or 'tail', got {small_end!r}")
    cap = max(1, int(cap))
    edge = int(edge)
    uniform = edge <= 0 or edge >= cap
    n = len(sizes)
    if n == 0:
        return []
    order = range(n) if (uniform or small_end == "head") else range(n - 1, -1, -1)
    target = cap if uniform else edge
    cuts: List[int] = []  # Positions in ``order`` after which a group closes.
    held = 0
    for k, i in enumerate(order):
        held += int(sizes[i])
        if held >= target:
            cuts.append(k + 1)
            held = 0
            target = min(cap, target * 2)
    if not cuts or cuts[-1] != n:
        cuts.append(n)
    if uniform or small_end == "head":
        return cuts
    # Cut k items from the end = a group boundary k items from the end, from the head's side.
    ends = sorted({n - k for k in cuts if n - k > 0} | {n})
    return ends
