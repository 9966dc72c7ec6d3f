"""Parameters back in the order the forward uses them (RemoteAdamW(overlap=True)).

Internal module of fusedps.torch. After a step is applied, PullPipeline pulls every parameter in
groups, in the order the last forward pass first used them (over gRPC several at once, on the
client's streams; through a same-host workspace one after another, each landing in order): the
first group small (``edge_bytes``), the next ones doubling up to ``group_bytes``
(fusedps._bucket_plan). Each group lands in pinned host memory (the wire's bytes, no
conversion) and is copied to the device on a side stream. Through a device workspace the
landing buffer is carved from the workspace on the GPU instead: the server writes each group
there by a device-to-device copy, and the side stream's copies out of it are device to device;
all else is the same. There the step's commit carries the pull (prepare_commit_pulls, then
start(mode, landed=...)): every group has landed once the commit returns, and no pull call runs
beside the forward.

Who does what: the landing runs on the C++ client's threads (fusedps._native.PipelinedPull)
when every server is reached through the native transport; through a same-host workspace
(fusedps._workspace, whose memory the host buffer is carved from) the server then writes each
group there and the C++ client only reads its short replies. Over grpcio, a pool of Python
threads lands the groups (_ThreadLanding, through the workspace when there is one; one thread
then, as the C++ client has one group in flight through a workspace). The device
copies are queued by the training loop's own thread, in the forward pre-hook and in wait():
each time, every group landed so far is queued. No Python
thread of fusedps then runs while the forward computes: a Python thread beside the loop costs
its interpreter lock, and the loop's kernel launches wait for it (bench/contention_probe.py
measured local training 1.3-2.0x slower beside a Python pulling thread, 1.0-1.2x beside the
same pulls in another process).

Where the values go:
  * "direct" (delay 0): into the parameters. A global forward pre-hook makes each module's
    forward wait for the groups up to its own parameters' (a CPU wait for the pull, then a
    stream wait for the copy), so the first layers run while the last ones still arrive.
    Parameters no module's pre-hook has been seen to own (used functionally) come first, so
    the first module's wait covers them.
  * "shadow" (delay 1): into a device buffer, installed into the parameters at the next step
    boundary (install()), while the model meanwhile computes with the previous values. The
    optimizer's worker waits for the landing and queues the copies (land()); the forward
    hook is then removed (remove_forward_hooks()), since the loop never waits mid-forward.

Lifetimes: the pipeline owns its landing (threads), its buffers and the global hook until
close(). A landing writes only the host buffer, which nothing reads before its group is waited
for; the device copies write the parameters ("direct") or the shadow buffer, which nothing
else writes until wait() or a module's pre-hook has waited for them. The copies out of the
host buffer are queued (asynchronous): start() waits on the CPU for the last pull's last copy
(its event) before the next landing may write there. That holds for a device workspace too,
whose writer (the server) is another process that no stream order reaches.
Thread safety: start, wait, install and close are called from the optimizer's threads, one at a
time; the hooks run on the forward's thread; _lock guards the state they share.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union, cast

import torch

from fusedps import _copies, _dtypes, _native, _trace, _workspace
from fusedps._bucket_plan import plan_ends
from fusedps._route import Route

__all__ = ["PullPipeline"]

# torch >= 2.1: one call copies a group's tensors (torch 1.13 copies them one by one).
_FOREACH_COPY = hasattr(torch, "_foreach_copy_")
_FIELD_PARAM = _dtypes.TENSOR_FIELDS["param"]


@dataclass
class _Group:
    params: List[int]
    # (shard, server name, host view) of each segment of its params.
    targets: List[Tuple[int, str, torch.Tensor]] = field(default_factory=list)
    # Views of the landing buffer, shaped as the params (and of its dtype, the wire's).
    sources: List[torch.Tensor] = field(default_factory=list)
    tensors: List[torch.Tensor] = field(default_factory=list)  # Its params, in order.


@dataclass
class _Pull:
    """One pull in flight, published whole by start(): the forward's hooks (and, with delay=1,
    the worker's start() beside them) see either all of it or none."""

    mode: str
    groups: List[_Group]
    landing: Union[_native.PipelinedPull, _ThreadLanding, "_Landed"]
    ready: Optional[object]  # Event: where the step's device work stood at start() (GPU).
    events: List[Optional[object]]  # Per group, its copies' event once queued (GPU).
    queued: int = 0  # Groups whose device copies are queued.
    waited_upto: int = -1  # Groups the current stream waits for.


class _ThreadLanding:
    """Lands the groups on a pool of Python threads (the transport is grpcio, or some server
    is): with Client.pull_into, or through ``workspace`` (fusedps._workspace, whose memory the
    targets lie in; one server) when given. The interface of fusedps._native.PipelinedPull."""

    def __init__(self, pool: ThreadPoolExecutor, route: Route, groups: List[_Group], wire: str,
                 workspace=None):
        self._route = route
        self._workspace = workspace
        self._wire = wire
        self._lock = threading.Lock()
        self._versions = [0] * route.shards
        self._started = time.perf_counter()
        self._last = self._started
        self.groups = len(groups)
        self._futures: List[Future] = [pool.submit(self._land, g, group)
                                       for g, group in enumerate(groups)]

    def _land(self, g: int, group: _Group) -> None:
        by_shard: Dict[int, list] = {}
        for shard, name, view in group.targets:
            by_shard.setdefault(shard, []).append((name, view))
        for shard, targets in by_shard.items():
            client = self._route.clients[shard]
            if self._workspace is not None:
                version = _workspace.pull_into_workspace(client, self._workspace, targets,
                                                         self._wire)
            else:
                version, _ = client.pull_into(targets, self._wire, stream=g)
            with self._lock:
                self._versions[shard] = max(self._versions[shard], version)
        with self._lock:
            self._last = time.perf_counter()

    def wait(self, group: int) -> None:
        for f in self._futures[:group + 1]:
            f.result()

    def landed(self) -> int:
        for g, f in enumerate(self._futures):
            if not f.done():
                return g
        return len(self._futures)

    def version(self, shard: int) -> int:
        with self._lock:
            return self._versions[shard]

    def seconds(self) -> float:
        with self._lock:
            return self._last - self._started

    def close(self) -> None:
        for f in self._futures:
            f.exception()  # Waits; the error was raised by wait() if anyone asked.


class _Landed:
    """A pull the step's commit carried (prepare_commit_pulls): every group landed when the
    commit returned. The interface of fusedps._native.PipelinedPull."""

    def __init__(self, groups: int, versions: List[int]):
        self.groups = groups
        self._versions = versions

    def wait(self, group: int) -> None:
        pass

    def landed(self) -> int:
        return self.groups

    def version(self, shard: int) -> int:
        return self._versions[shard]

    def seconds(self) -> float:
        return 0.0  # Inside the commit's round trip.

    def close(self) -> None:
        pass


class PullPipeline:
    """Args:
      route: where each parameter lives (fusedps._route.Route).
      params: the parameters, in the optimizer's order.
      wire: "float32" or "bfloat16": the pull's dtype.
      streams: pulls in flight at once over gRPC (each on its own stream of the clients);
        through a workspace, one (see __init__).
      group_bytes: wire bytes per group, about.
      edge_bytes: wire bytes of the first group, about; the next ones double up to group_bytes
        (fusedps._bucket_plan), so the first module waits for little. 0: all group_bytes.
      workspace: a same-host workspace of the route's one server (fusedps._workspace), which
        the host buffer is carved from and the pulls land through (a device workspace: on the
        GPU, in the stored dtype, which ``wire`` must then be); None: over gRPC.
    """

    def __init__(self, route: Route, params: Sequence[torch.Tensor], wire: str, streams: int,
                 group_bytes: int, edge_bytes: int = 0, workspace=None):
        self._route = route
        self._params = list(params)
        self._wire = wire
        self._wire_dtype = _dtypes.torch_dtype(wire)
        # Groups in flight at once. Through a workspace, one, in order: the server reads them
        # one after another anyway (one engine, one device stream), so groups in flight at once
        # land together, the first (the one the forward waits for) behind the larger ones (on
        # the CPU backend, a 4 MiB first group of four landed after 4.5 ms, alone after 0.7).
        # Over gRPC, streams at once: there the bytes travel on the streams' sockets.
        self._streams = 1 if workspace is not None else max(1, int(streams))
        self._group_bytes = max(1, int(group_bytes))
        self._edge_bytes = int(edge_bytes)
        self._itemsize = _dtypes.element_size(wire)
        self.device = self._params[0].device
        self._cuda = self.device.type == "cuda"
        self._index: Dict[int, int] = {id(p): i for i, p in enumerate(self._params)}
        self._numel = [p.numel() for p in self._params]
        self._workspace = workspace
        natives = [getattr(c, "_native", None) for c in route.clients]
        self._natives = cast(Optional[List[_native.NativeClient]],
                             natives if all(n is not None for n in natives) else None)
        self._pool = None if self._natives is not None else ThreadPoolExecutor(
            max_workers=self._streams, thread_name_prefix="fusedps-pull")
        # The pull in flight, until wait(); the copying (its queued, waited_upto) is done by one
        # thread at a time: the loop's (pre-hooks, wait), or for a "shadow" pull the worker's
        # (land) and then the loop's (wait, which follows the worker's end).
        self._pull: Optional[_Pull] = None
        self._last_event: Optional[Any] = None  # The last pull's last device copy (GPU).
        self._lock = threading.Lock()
        self._groups: List[_Group] = []
        self._group_of: List[int] = [0] * len(self._params)
        self._offset: List[int] = [0] * len(self._params)
        self._mode = "direct"  # The last pull's; _source reads it for install().
        self._to_install = False  # A "shadow" pull not installed yet.
        # The order of first use, recorded by the pre-hook since the last start().
        self._recorded: List[int] = []
        self._recorded_set: Set[int] = set()
        self._modules_hooked: Set[int] = set()  # id() of each module seen.
        self._host: Optional[torch.Tensor] = None
        self._laid_out: List[int] = []  # The order _groups was laid out in.
        # Made once per layout (each step's Python work beside the loop costs it): the native
        # landing's targets, and install()'s sources (with the buffer they view).
        self._native_targets: Optional[_native.PullGroups] = None
        self._install_sources: Optional[Tuple[torch.Tensor, List[torch.Tensor]]] = None
        self._commit_pulls: Optional[List[_native.CommitPull]] = None  # Likewise.
        self._shadow: Optional[torch.Tensor] = None
        self._h2d_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._shadow_free: Optional[object] = None  # Event: the last install has read shadow.
        self.versions: List[Optional[int]] = [None] * route.shards
        self.carried = 0  # Pulls that the step's commit carried (start(landed=...)).
        self.seconds = 0.0          # The last finished pull's wall time.
        self.exposed_seconds = 0.0  # What the forward and the optimizer waited for it.
        # Called on the loop's thread once a pull has landed and its versions are observed.
        self.on_landed: Optional[Callable[[], None]] = None
        # land_carried() defers on_landed to the next forward's first module (_pre_forward).
        self._defer_on_landed = False
        self._on_landed_due = False
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_forward)

    # -- the optimizer's side ---------------------------------------------------------------------

    def _layout(self, order: List[int]) -> List[_Group]:
        """Groups in ``order`` (edge_bytes first, doubling up to group_bytes), their places in
        the host buffer, and what each pulls and copies."""
        if self._host is None and self._workspace is not None:
            self._host = self._workspace.carve(sum(self._numel), self._wire_dtype)
        elif self._host is None:
            self._host = torch.empty(sum(self._numel), dtype=self._wire_dtype,
                                     pin_memory=self._cuda)
        offset = 0
        for i in order:
            self._offset[i] = offset
            offset += self._numel[i]
        ends = plan_ends([self._numel[i] * self._itemsize for i in order], self._group_bytes,
                         self._edge_bytes, "head")
        groups = [_Group(list(order[begin:end])) for begin, end in zip([0] + ends, ends)]
        for g, group in enumerate(groups):
            for i in group.params:
                self._group_of[i] = g
                base = self._offset[i]
                for seg in self._route.segments[i]:
                    view = self._host[base + seg.begin:base + seg.begin + seg.numel]
                    group.targets.append((seg.shard, seg.server_name, view))
                group.sources.append(self._host[base:base + self._numel[i]].view(
                    self._params[i].shape))
                group.tensors.append(self._params[i])
        return groups

    def _relayout(self) -> None:
        """The groups in the order of first use recorded since the last pull (_order)."""
        order = self._order()
        self._recorded, self._recorded_set = [], set()
        if order != self._laid_out:
            self._groups = self._layout(order)
            self._laid_out = order
            self._native_targets = _native.PullGroups(
                [[(shard, name, view.data_ptr(), view.numel())
                  for shard, name, view in group.targets] for group in self._groups])
            self._install_sources = None
            self._commit_pulls = None

    def prepare_commit_pulls(self) -> List[_native.CommitPull]:
        """A pull carried by the step's commits (through a workspace; PushCommit.pull): lays
        the groups out as start() does, waits (CPU) for the last pull's copies out of the
        landing buffer, which the server writes during the commit, and returns each shard's
        pull: its segments of every param, at their places in the landing buffer. Then
        commit, and start(mode, landed=the commits' pulled versions)."""
        self._relayout()
        self._sync_last_copies()
        if self._commit_pulls is None:
            by_shard: List[list] = [[] for _ in range(self._route.shards)]
            for group in self._groups:
                for shard, name, view in group.targets:
                    by_shard[shard].append((name, view.data_ptr(), view.numel()))
            code = _dtypes.WIRE_CODES[self._wire]
            self._commit_pulls = [_native.CommitPull(code, entries) for entries in by_shard]
        return self._commit_pulls

    def _sync_last_copies(self) -> None:
        if self._last_event is not None:
            # The last pull's copies read the host buffer that this one writes: done by now
            # (the loop's stream waited for them), but the CPU must know before it writes (the
            # server, into a device workspace, is ordered by nothing else).
            self._last_event.synchronize()
            self._last_event = None

    def start(self, mode: str, landed: Optional[List[int]] = None) -> None:
        """Starts pulling every parameter ("direct" or "shadow", see the module docstring).
        landed: the per-shard versions of the pulls the step's commits carried
        (prepare_commit_pulls, called before them): every group is in the landing buffer
        already, and only the device copies are left."""
        if landed is None:
            self._relayout()
        ready = None
        if self._cuda:
            # Backward (and the step's check) may still read the parameters on the device.
            ready = torch.cuda.current_stream(self.device).record_event()
            if mode == "shadow" and self._shadow is None:
                self._shadow = torch.empty(sum(self._numel), dtype=self._wire_dtype,
                                           device=self.device)
        self._sync_last_copies()
        landing: Union[_native.PipelinedPull, _ThreadLanding, _Landed]
        if landed is not None:
            landing = _Landed(len(self._groups), list(landed))
            self.carried += 1
        elif self._natives is not None:  # Through the workspace too, when one is open.
            landing = _native.PipelinedPull(
                self._natives, cast(_native.PullGroups, self._native_targets),  # The layout's.
                dtype=_dtypes.WIRE_CODES[self._wire], field=_FIELD_PARAM,
                threads=self._streams)
        else:
            landing = _ThreadLanding(cast(ThreadPoolExecutor, self._pool),  # Without natives.
                                     self._route, self._groups, self._wire, self._workspace)
        pull = _Pull(mode, self._groups, landing, ready, [None] * len(self._groups))
        with self._lock:
            self._mode = mode
            self._to_install = mode == "shadow"
            self.exposed_seconds = 0.0
            self._pull = pull
        _trace.mark("pull", len(self._groups))

    def wait(self) -> None:
        """Waits until every group has landed and queues its device copies (on a GPU the
        current stream waits for them); adds the time to exposed_seconds. Raises the first
        group's error. Then frees the landing."""
        with self._lock:
            pull = self._pull
        if pull is None:
            return
        start = time.perf_counter()
        try:
            self._wait_groups(pull, len(pull.groups) - 1)
        finally:
            landing = pull.landing
            with self._lock:
                self.exposed_seconds += time.perf_counter() - start
                self._pull = None
                self.seconds = landing.seconds()
            self._last_event = next((e for e in reversed(pull.events) if e is not None), None)
            landing.close()

    def land_carried(self) -> bool:
        """When the pull in flight was carried by the step's commit (start(landed=...)): waits
        for it now (wait(): queues every copy and makes the current stream wait; tens of
        microseconds of device time) and returns True, so that the next forward waits for
        nothing; on_landed is called at that forward's first module (then the scheduler has
        set the next lr). Else False."""
        with self._lock:
            pull = self._pull
        if pull is None or not isinstance(pull.landing, _Landed):
            return False
        self._defer_on_landed = True
        try:
            self.wait()
        finally:
            self._defer_on_landed = False
        return True

    def discard(self) -> None:
        """Drops a "shadow" pull's values uninstalled (newer ones were pulled otherwise)."""
        self._to_install = False

    def land(self) -> None:
        """"shadow" mode, on the optimizer's worker right after start(): waits until every group
        has landed and queues their copies into the shadow buffer, so that the loop's threads
        do nothing for this pull until wait() and install(). Raises a group's error."""
        with self._lock:
            pull = self._pull
        if pull is None or pull.mode != "shadow":
            return
        pull.landing.wait(len(pull.groups) - 1)
        self._queue_copies(pull, len(pull.groups))

    def remove_forward_hooks(self) -> None:
        """Removes the forward pre-hook for good: the pulls that follow are "shadow" pulls
        (delay=1), installed at step boundaries, laid out in the order recorded so far."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def install(self) -> None:
        """"shadow" mode: copies the landed values into the parameters, on the current stream
        (call wait() first). Does nothing unless a "shadow" pull is waiting to be installed."""
        if not self._to_install:
            return
        self._to_install = False
        buffer = self._source_buffer()
        if self._install_sources is None or self._install_sources[0] is not buffer:
            self._install_sources = (buffer, [self._source(i).view(p.shape)
                                              for i, p in enumerate(self._params)])
        sources = self._install_sources[1]
        with torch.no_grad():
            if _FOREACH_COPY:
                torch._foreach_copy_(self._params, sources)
            else:
                for p, src in zip(self._params, sources):
                    p.copy_(src)
        if self._cuda:
            self._shadow_free = torch.cuda.current_stream(self.device).record_event()

    def close(self) -> None:
        self.remove_forward_hooks()
        with self._lock:
            pull, self._pull = self._pull, None
        if pull is not None:
            pull.landing.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- the copies (the thread that waits: the loop's) -------------------------------------

    def _source(self, i: int) -> torch.Tensor:
        begin = self._offset[i]
        return self._source_buffer()[begin:begin + self._numel[i]]

    def _source_buffer(self) -> torch.Tensor:
        """Where the last pull's values are for install(): the shadow buffer ("shadow" on a
        GPU), else the host buffer."""
        return self._shadow if (self._cuda and self._mode == "shadow") else self._host

    def _queue_copies(self, pull: _Pull, landed: int) -> None:
        """Queues the device copies of groups [pull.queued, landed) (each has landed)."""
        while pull.queued < landed:
            g = pull.queued
            pull.queued += 1
            group = pull.groups[g]
            if not self._cuda:
                if pull.mode == "direct":
                    with torch.no_grad():
                        for i, src in zip(group.params, group.sources):
                            self._params[i].copy_(src)
                continue
            with torch.cuda.stream(self._h2d_stream):
                if g == 0:
                    self._h2d_stream.wait_event(pull.ready)
                self._copy_to_device(pull.mode, group)
                pull.events[g] = self._h2d_stream.record_event()

    def _copy_to_device(self, mode: str, group: _Group) -> None:
        host = cast(torch.Tensor, self._host)  # Made by _layout, before any pull.
        with torch.no_grad():
            if mode == "shadow":
                if self._shadow_free is not None:
                    self._h2d_stream.wait_event(self._shadow_free)
                begin = self._offset[group.params[0]]
                end = self._offset[group.params[-1]] + self._numel[group.params[-1]]
                # Made by start() for a "shadow" pull.
                _copies.copy_in_pieces(cast(torch.Tensor, self._shadow)[begin:end],
                                       host[begin:end])
                return
            params = group.tensors
            # Landed on the device already (a device workspace), or in the params' dtype: the
            # copies read the landing buffer itself, through the views made with the layout.
            if host.is_cuda or all(p.dtype == self._wire_dtype for p in params):
                sources = group.sources
            else:  # Converted on the device, not on the CPU: the group's bytes go there first.
                begin = self._offset[group.params[0]]
                end = self._offset[group.params[-1]] + self._numel[group.params[-1]]
                staged = host[begin:end].to(self.device, non_blocking=True)
                sources = [staged[self._offset[i] - begin:self._offset[i] - begin +
                                  self._numel[i]].view(self._params[i].shape)
                           for i in group.params]
            if _FOREACH_COPY:
                torch._foreach_copy_(params, sources, non_blocking=True)
                return
            for p, src in zip(params, sources):
                p.copy_(src, non_blocking=True)

    def _wait_groups(self, pull: _Pull, upto: int) -> None:
        """Waits for groups 0..upto to land, queues the copies of every group landed so far,
        and makes the current stream wait for those of groups 0..upto."""
        if upto > pull.waited_upto:
            pull.landing.wait(upto)  # Raises a group's error: the forward must not go on.
        self._queue_copies(pull, max(pull.landing.landed(), upto + 1))
        if upto > pull.waited_upto:
            if self._cuda:  # The side stream is in order: the last group's event covers all.
                torch.cuda.current_stream(self.device).wait_event(pull.events[upto])
            pull.waited_upto = upto
            if upto == len(pull.groups) - 1:
                self._landed_all(pull)

    def _landed_all(self, pull: _Pull) -> None:
        """Every group of ``pull`` has landed: its versions become each client's
        last_pulled_version (the base_version of the next push: sync mode checks it), as
        Client.pull_parameters does, before the next backward pushes."""
        pulled = [pull.landing.version(shard) for shard in range(self._route.shards)]
        with self._lock:
            for shard, version in enumerate(pulled):
                self.versions[shard] = max(self.versions[shard] or 0, version)
        for client, version in zip(self._route.clients, pulled):
            if self._natives is not None:  # _ThreadLanding's went through Client.pull_into.
                client._observe_version(version)
            client.last_pulled_version = version
        if self._defer_on_landed:
            self._on_landed_due = True
        elif self.on_landed is not None:
            self.on_landed()

    # -- the forward's side -------------------------------------------------------------------

    def _order(self) -> List[int]:
        """Parameters no pre-hook was seen to own first, then the recorded order of first use."""
        recorded = [i for i in self._recorded]
        seen = set(recorded)
        if not recorded:  # No forward seen since the last pull (or no hook left): as it was.
            return self._laid_out or list(range(len(self._params)))
        return [i for i in range(len(self._params)) if i not in seen] + recorded

    def _pre_forward(self, module: torch.nn.Module, inputs) -> None:
        if self._on_landed_due:  # A pull landed by land_carried(), observed at this forward.
            self._on_landed_due = False
            if self.on_landed is not None:
                self.on_landed()
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
        pull = self._pull
        if pull is None:
            return
        if pull.mode == "shadow":  # Nothing to wait for; the worker queues the copies (land).
            return
        upto = max(self._group_of[i] for i in own)
        if upto <= pull.waited_upto:
            self._queue_copies(pull, pull.landing.landed())
            return
        start = time.perf_counter()
        _trace.mark("wait", upto)
        self._wait_groups(pull, upto)
        _trace.mark("waited", upto)
        with self._lock:
            self.exposed_seconds += time.perf_counter() - start

    def _before_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        pull = self._pull
        if pull is not None and pull.mode == "direct":
            self.wait()
