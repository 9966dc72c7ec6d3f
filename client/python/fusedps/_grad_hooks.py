"""Calls back when backward has finished accumulating a parameter's gradient.

Internal module of fusedps.torch (RemoteAdamW(overlap=True) sends each gradient as soon as it
is ready). On torch >= 2.1 this is Tensor.register_post_accumulate_grad_hook. On older torch
(Debian's 1.13) it is a hook on the parameter's gradient accumulator, the autograd node
(AccumulateGrad) that adds each backward's gradient into ``.grad``, which runs after it has
done so: what torch.nn.parallel.DistributedDataParallel's reducer hooks in torch 1.x. The node
is reached through a throwaway view of the parameter (``p.expand_as(p).grad_fn``) and kept alive
here, since the parameter holds it only weakly.

Lifetimes: the hooks stay until remove() (or the object is garbage-collected with its handles).
The callback runs on the thread that runs backward (autograd's device thread for CUDA).
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch

__all__ = ["GradReadyHooks"]


class GradReadyHooks:
    """on_ready(index) after backward has accumulated params[index].grad.

    Params that do not require grad get no hook (they never have a gradient).
    """

    def __init__(self, params: Sequence[torch.Tensor], on_ready: Callable[[int], None]):
        self._handles: List[Any] = []  # torch's RemovableHandle.
        self._accumulators: List[Any] = []
        native = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
        for index, p in enumerate(params):
            if not p.requires_grad:
                continue
            if native:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda _p, index=index: on_ready(index)))
            else:
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                self._accumulators.append(accumulator)
                self._handles.append(accumulator.register_hook(
                    lambda *_unused, index=index: on_ready(index)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._accumulators = []
