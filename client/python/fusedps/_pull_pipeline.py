"""Parameters back in the order the forward uses them (RemoteAdamW(overlap=True)).

Internal module of fusedps.torch. After a step is applied, PullPipeline pulls every parameter in
groups of about ``group_bytes``, in the order the last forward pass first used them, over the
client's streams at once. Each group lands in pinned host memory (the native transport writes
the wire's bytes there, no conversion) and is copied to the device on a side stream.

Where the values go:
  * "direct" (delay 0): into the parameters. A global forward pre-hook makes each module's
    forward wait for the groups up to its own parameters' (a CPU wait for the pull, then a
    stream wait for the copy), so the first layers run while the last ones still arrive.
    Parameters no module's pre-hook has been seen to own (used functionally) come first, so
    the first module's wait covers them.
  * "shadow" (delay 1): into a device buffer, installed into the parameters at the next step
    boundary (install()), while the model meanwhile computes with the previous values.

Lifetimes: the pipeline owns its thread pool, its buffers and the global hook until close().
A pull in flight reads and writes only the pipeline's buffers and, in "direct" mode, the
parameters, which nothing else writes until wait() or a module's pre-hook has waited for them.
Thread safety: start, wait, install and close are called from the optimizer's threads, one at a
time; the pool threads land groups; the hooks run on the forward's thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from fusedps import _chunks, _trace
from fusedps._route import Route

__all__ = ["PullPipeline"]

# torch >= 2.1: one call copies a group's tensors (torch 1.13 copies them one by one).
_FOREACH_COPY = hasattr(torch, "_foreach_copy_")


@dataclass
class _Group:
    params: List[int]
    # Made once per layout (start() reuses them while the order does not change):
    targets: Dict[int, list] = field(default_factory=dict)  # shard -> (name, host view)
    sources: List[torch.Tensor] = field(default_factory=list)  # Host views, as the params.
    landed: threading.Event = field(default_factory=threading.Event)
    landed_at: float = 0.0
    event: Optional[object] = None  # torch.cuda.Event once the device copy is queued
    future: Optional[Future] = None


class PullPipeline:
    """Args:
      route: where each parameter lives (fusedps._route.Route).
      params: the parameters, in the optimizer's order.
      wire: "float32" or "bfloat16": the pull's dtype.
      streams: pulls in flight at once (each on its own stream of the clients).
      group_bytes: wire bytes per group, about.
    """

    def __init__(self, route: Route, params: Sequence[torch.Tensor], wire: str, streams: int,
                 group_bytes: int):
        self._route = route
        self._params = list(params)
        self._wire = wire
        self._wire_dtype = _chunks.torch_dtype(wire)
        self._streams = max(1, int(streams))
        self._group_bytes = max(1, int(group_bytes))
        self._itemsize = _chunks.element_size(wire)
        self.device = self._params[0].device
        self._cuda = self.device.type == "cuda"
        self._index: Dict[int, int] = {id(p): i for i, p in enumerate(self._params)}
        self._numel = [p.numel() for p in self._params]
        self._pool = ThreadPoolExecutor(
            max_workers=self._streams, thread_name_prefix="fusedps-pull",
            initializer=(lambda: torch.cuda.set_device(self.device)) if self._cuda else None)
        self._lock = threading.Lock()
        self._groups: List[_Group] = []
        self._group_of: List[int] = [0] * len(self._params)
        self._offset: List[int] = [0] * len(self._params)
        self._waited_upto = -1  # Groups the forward has waited for, this pull.
        self._active = False    # A "direct" pull whose groups the forward may still wait for.
        self._mode = "direct"
        self._to_install = False  # A "shadow" pull not installed yet.
        # The order of first use, recorded by the pre-hook since the last start().
        self._recorded: List[int] = []
        self._recorded_set = set()
        self._modules_hooked = set()
        self._host: Optional[torch.Tensor] = None
        self._laid_out: List[int] = []  # The order _template was laid out in.
        self._template: List[_Group] = []
        self._shadow: Optional[torch.Tensor] = None
        self._h2d_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._shadow_free: Optional[object] = None  # Event: the last install has read shadow.
        self.versions: List[Optional[int]] = [None] * route.shards
        self.started_at = 0.0
        self.seconds = 0.0          # The last finished pull's wall time.
        self.exposed_seconds = 0.0  # What the forward and the optimizer waited for it.
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_forward)

    # -- the optimizer's side ---------------------------------------------------------------------

    def _layout(self, order: List[int]) -> List[_Group]:
        """Groups of about group_bytes in ``order``, their places in the host buffer, and what
        each pulls and copies."""
        if self._host is None:
            self._host = torch.empty(sum(self._numel), dtype=self._wire_dtype,
                                     pin_memory=self._cuda)
        groups: List[_Group] = []
        offset = 0
        current: List[int] = []
        size = 0
        for i in order:
            self._offset[i] = offset
            offset += self._numel[i]
            current.append(i)
            size += self._numel[i] * self._itemsize
            if size >= self._group_bytes:
                groups.append(_Group(current))
                current, size = [], 0
        if current:
            groups.append(_Group(current))
        for g, group in enumerate(groups):
            for i in group.params:
                self._group_of[i] = g
                base = self._offset[i]
                for seg in self._route.segments[i]:
                    view = self._host[base + seg.begin:base + seg.begin + seg.numel]
                    group.targets.setdefault(seg.shard, []).append((seg.server_name, view))
                group.sources.append(self._host[base:base + self._numel[i]].view(
                    self._params[i].shape))
        return groups

    def start(self, mode: str) -> None:
        """Starts pulling every parameter ("direct" or "shadow", see the module docstring)."""
        order = self._order()
        self._recorded, self._recorded_set = [], set()
        if order != self._laid_out:
            self._template = self._layout(order)
            self._laid_out = order
        groups = [_Group(t.params, t.targets, t.sources) for t in self._template]
        ready = None
        if self._cuda:
            # Backward (and the step's check) may still read the parameters on the device.
            ready = torch.cuda.current_stream(self.device).record_event()
            if mode == "shadow" and self._shadow is None:
                self._shadow = torch.empty(sum(self._numel), dtype=self._wire_dtype,
                                           device=self.device)
        with self._lock:  # Every group has its future before anyone can see the groups.
            for g, group in enumerate(groups):
                group.future = self._pool.submit(self._land, g, group, ready)
            self._groups = groups
            self._mode = mode
            self._waited_upto = -1
            self._active = mode == "direct"
            self._to_install = mode == "shadow"
            self.exposed_seconds = 0.0
            self.started_at = time.perf_counter()

    def wait(self) -> None:
        """Waits until every group has landed (and, on a GPU, makes the current stream wait for
        its copies); adds the time to exposed_seconds. Raises the first group's error."""
        with self._lock:
            groups = list(self._groups)
        start = time.perf_counter()
        try:
            self._wait_groups(len(groups) - 1)
        finally:
            with self._lock:
                self.exposed_seconds += time.perf_counter() - start
                self._active = False
                if groups:
                    self.seconds = max(g.landed_at for g in groups) - self.started_at

    def discard(self) -> None:
        """Drops a "shadow" pull's values uninstalled (newer ones were pulled otherwise)."""
        self._to_install = False

    def install(self) -> None:
        """"shadow" mode: copies the landed values into the parameters, on the current stream
        (call wait() first). Does nothing unless a "shadow" pull is waiting to be installed."""
        if not self._to_install:
            return
        self._to_install = False
        with torch.no_grad():
            sources = [self._source(i).view(p.shape) for i, p in enumerate(self._params)]
            if _FOREACH_COPY:
                torch._foreach_copy_(self._params, sources)
            else:
                for p, src in zip(self._params, sources):
                    p.copy_(src)
        if self._cuda:
            self._shadow_free = torch.cuda.current_stream(self.device).record_event()

    def close(self) -> None:
        self._hook.remove()
        self._pool.shutdown(wait=True)

    # -- the pool's side ----------------------------------------------------------------------

    def _source(self, i: int) -> torch.Tensor:
        begin = self._offset[i]
        buffer = self._shadow if (self._cuda and self._mode == "shadow") else self._host
        return buffer[begin:begin + self._numel[i]]

    def _land(self, g: int, group: _Group, ready) -> None:
        try:
            _trace.mark("pull", g)
            self._pull(g, group)
            _trace.mark("pulled", g)
            if self._cuda:
                with torch.cuda.stream(self._h2d_stream):
                    self._h2d_stream.wait_event(ready)
                    self._copy_to_device(group)
                    group.event = self._h2d_stream.record_event()
            elif self._mode == "direct":
                with torch.no_grad():
                    for i in group.params:
                        p = self._params[i]
                        p.copy_(self._source(i).view(p.shape))
        finally:
            group.landed_at = time.perf_counter()
            group.landed.set()
            _trace.mark("landed", g)

    def _pull(self, g: int, group: _Group) -> None:
        """Pulls the group's segments into the host buffer, one call per shard holding some."""
        for shard, targets in group.targets.items():
            version, _ = self._route.clients[shard].pull_into(targets, self._wire, stream=g)
            with self._lock:
                if self.versions[shard] is None or version > self.versions[shard]:
                    self.versions[shard] = version

    def _copy_to_device(self, group: _Group) -> None:
        with torch.no_grad():
            if self._mode == "shadow":
                if self._shadow_free is not None:
                    self._h2d_stream.wait_event(self._shadow_free)
                for i in group.params:
                    begin, n = self._offset[i], self._numel[i]
                    self._shadow[begin:begin + n].copy_(self._host[begin:begin + n],
                                                        non_blocking=True)
                return
            params = [self._params[i] for i in group.params]
            if all(p.dtype == self._wire_dtype for p in params):
                sources = group.sources
            else:  # Converted on the device, not on the CPU: the group's bytes go there first.
                begin = self._offset[group.params[0]]
                end = self._offset[group.params[-1]] + self._numel[group.params[-1]]
                staged = self._host[begin:end].to(self.device, non_blocking=True)
                sources = [staged[self._offset[i] - begin:self._offset[i] - begin +
                                  self._numel[i]].view(self._params[i].shape)
                           for i in group.params]
            if _FOREACH_COPY:
                torch._foreach_copy_(params, sources, non_blocking=True)
                return
            for p, src in zip(params, sources):
                p.copy_(src, non_blocking=True)

    # -- the forward's side -------------------------------------------------------------------

    def _order(self) -> List[int]:
        """Parameters no pre-hook was seen to own first, then the recorded order of first use."""
        recorded = [i for i in self._recorded]
        seen = set(recorded)
        if not recorded:
            return list(range(len(self._params)))
        return [i for i in range(len(self._params)) if i not in seen] + recorded

    def _wait_groups(self, upto: int) -> None:
        with self._lock:
            groups = self._groups[self._waited_upto + 1:upto + 1]
            first = self._waited_upto + 1
        for group in groups:
            group.future.result()  # Raises the group's error: the forward must not go on.
            if self._cuda and group.event is not None:
                torch.cuda.current_stream(self.device).wait_event(group.event)
        with self._lock:
            self._waited_upto = max(self._waited_upto, first + len(groups) - 1)

    def _pre_forward(self, module: torch.nn.Module, inputs) -> None:
        own = [self._index[id(p)] for p in module._parameters.values()
               if p is not None and id(p) in self._index]
        if not own:
            return
        for i in own:
            if i not in self._recorded_set:
                self._recorded_set.add(i)
                self._recorded.append(i)
        if id(module) not in self._modules_hooked:
            self._modules_hooked.add(id(module))
            # state_dict() reads the parameters outside a forward: it waits for them too.
            module._register_state_dict_hook(self._before_state_dict)
        if not self._active:
            return
        upto = max(self._group_of[i] for i in own)
        if upto <= self._waited_upto:
            return
        start = time.perf_counter()
        _trace.mark("wait", upto)
        self._wait_groups(upto)
        _trace.mark("waited", upto)
        with self._lock:
            self.exposed_seconds += time.perf_counter() - start

    def _before_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        if self._active:
            self.wait()
