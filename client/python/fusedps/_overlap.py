"""RemoteAdamW(overlap=True): the remote step hidden behind compute.

Internal module of fusedps.torch; RemoteAdamW's docstring says what users see. A step goes:

1. Backward. As backward finishes each parameter's gradient (fusedps._grad_hooks), the
   parameter joins the open bucket; a full bucket is staged by the hook itself, on a side
   CUDA stream (its gradients gathered into the flat fp32 buffer ``sent``, rounded to the
   wire dtype, copied to pinned host memory). At the step's first gradient a worker thread
   (StepWorker, fusedps/_overlap_worker.py) begins the step's push (fusedps.PushTransaction,
   one per server); the hooks that follow write each staged bucket into it once its copy is
   done (pieces prepared once per bucket layout: one call each), and step() writes the rest:
   the server stages them while backward goes on, and no other Python thread takes the
   interpreter lock from backward's hooks per bucket.
   At the end of backward the loop's stream waits for the gathering (so that what was sent
   is each gradient as backward left it, whatever the loop writes next). A bucket is full at
   ``bucket_bytes`` wire bytes, except near the end of backward: from the second step on, the
   buckets are planned on the last step's order so that the last one holds about
   ``edge_bytes`` and the ones before it double up to ``bucket_bytes`` (fusedps._bucket_plan):
   what is left to push once backward ends is small.
   Without gradient hooks (push_during_backward False, the default on a device workspace,
   where a step's gradients move device to device in well under a millisecond), nothing
   leaves during backward: step() begins the push on the worker and stages every gradient as
   one bucket meanwhile, as a delayed step does; the pull below is the same.
2. step(). The rest is staged. Then the check (StepCheck, fusedps/_overlap_step.py): every
   gradient as it is now (after clipping, GradScaler.unscale_, anything the loop did) against
   what was sent. Unchanged: the commit's grad_scale is the step's own (the GradScaler's
   scale, or none). All multiplied by one factor c (clip_grad_norm_, unscale_, both):
   grad_scale / c. Anything else: the push is cancelled and the step pushed again in full (a
   fallback, counted and warned about once).
   Non-finite gradients skip the step without a commit. The worker then sends changed
   hyperparameters and commits. (Hyperparameters changed before backward, as a scheduler's
   lr, went at the step's first gradient already: _queue_hyperparameters.)
3. The pull. delay=0: step() waits for the commit, then starts the pulls in forward order
   (fusedps._pull_pipeline) and returns; the next forward waits for each module's own
   parameters. Through a device workspace the commit carries the pull (pull_with_commit,
   PushCommit.pull): the server writes the step's params into the landing buffer before it
   replies, so every group has landed when the commit returns; step() then queues their
   device copies (the loop's stream waits for them) and, pushed at step(), begins the next
   push on the worker: the next forward waits for nothing, and its first module only queues
   a changed lr (on_landed, deferred). delay=1 (after ``delay_warmup`` steps as delay=0):
   step() returns at once; the
   worker commits and pulls into a device buffer, and the next step() installs those values.
   The forward of step t then runs on the parameters of step t - 1 (staleness 1, as
   ZeRO-Offload's delayed parameter update). Once delayed, the whole step hides behind the
   next step's compute, so nothing needs to leave during backward: the gradient and forward
   hooks are removed, step() gathers every gradient at once, as one bucket, and the worker
   lands the pull and queues its device copy. The loop's threads then run no fusedps Python
   during forward and backward (each hook call costs the CPU-bound loop, docs/benchmarks.md)
   but one global forward pre-hook that returns at once: the gathered bucket's copy to the
   host is queued there, at the next forward's first module, not in step(). A copy engine runs
   the copies of its direction in the order they were queued, whatever their stream, so the
   loop's own small device-to-host copy right after step() (``loss.item()``) would wait for
   the whole gradient (2.7 ms for the GPT-2-small shape's 170 MB, docs/benchmarks.md); the
   forward and backward that follow make no such copy. Anything that waits for the worker
   queues the deferred copy first (_release_copies).

Where the bytes go (``data_plane``): with one server on the same host, the host buffers are
carved from a same-host workspace (fusedps._workspace), and the pushes and pulls carry only
where the bytes lie in it; otherwise they carry the bytes over gRPC. A device workspace (the
server's GPU memory, mapped here through CUDA IPC) takes the host buffers' place on a GPU: the
"host" buffers below (``_hosts``, the pull's landing buffer) are then CUDA tensors carved from
it, and the copies into and out of them device to device; every wait that orders the server
after the trainer's copies (a bucket's event before its write, the last pull's copies before
the next landing, a commit before the buffer is staged again) is the same.

Lifetimes: the engine owns its hooks, worker thread, buffers, workspace and pull pipeline until
close().
A transaction reads the pinned buffer of its step until its commit or cancel returns; with
delay=1 two buffers alternate, since step t + 1's backward stages while step t commits.
Thread safety: hooks run on autograd's thread, step() on the training thread, the worker on its
own; _lock guards the bucket state they share. Hooks and step() only queue device work; the
worker waits (a bucket's copy, a commit, a pull).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from fusedps import _dtypes, _trace
from fusedps import _remote_optim as _ro
from fusedps._bucket_plan import DEFAULT_EDGE_BYTES, plan_ends
from fusedps._grad_hooks import GradReadyHooks
from fusedps._overlap_plane import DataPlane
from fusedps._overlap_staging import Staging
from fusedps._overlap_step import StepCheck, _Bucket, _Step
from fusedps._overlap_worker import StepWorker
from fusedps._pull_pipeline import PullPipeline
from fusedps._route import Route

__all__ = ["OverlapEngine"]

_logger = logging.getLogger("fusedps.torch")  # RemoteAdamW's.

# The default buckets (and pull groups). The cost a step adds to the trainer's compute grows
# with the number of buckets and pull groups (each is Python work beside the loop and a gRPC
# call), not with their bytes once these move through a workspace: on an H200, GPT-2-small
# shape, fp32, the step went from 2.47x local at 8 MiB to 1.82x at 32 MiB (docs/
# benchmarks.md). Over gRPC smaller buckets hide more of the transfer.
GRPC_BUCKET_BYTES = 8 << 20
WORKSPACE_BUCKET_BYTES = 32 << 20
# Without gradient hooks, a push begun in a forward this long before step() is begun again
# there (StepWorker._queue_begin): well below the server's --call-idle-seconds (60 s by
# default), and far above a forward and backward that the early begin is for.
BEGUN_MAX_SECONDS = 2.0


class OverlapEngine(DataPlane, StepCheck, StepWorker, Staging):
    """Args:
      optimizer: the RemoteAdamW (its client, _scaling_plan, hyperparameter and fallback
        methods are used).
      pairs: (server name, param) of every param.
      grad_dtype, pull_dtype: wire dtypes ("float32" / "bfloat16").
      bucket_bytes: wire bytes that close a bucket; None: WORKSPACE_BUCKET_BYTES through a
        workspace, GRPC_BUCKET_BYTES over gRPC.
      pull_group_bytes: wire bytes per pull group; None: as bucket_bytes.
      edge_bytes: wire bytes of a backward's last bucket and of a forward's first pull group
        (fusedps._bucket_plan); None: DEFAULT_EDGE_BYTES; 0: every bucket and group full
        size.
      delay: 0 or 1; delay_warmup: steps run with delay 0 first.
      data_plane: "auto" (a same-host workspace when the one server offers it: on a GPU, a
        device workspace first when the server can pull into it in the pull dtype, else a host
        one; else gRPC), "device" (a device workspace, or RuntimeError), "workspace" (a host
        workspace, or RuntimeError) or "grpc" (fusedps._workspace).
      stored_dtype: the wire name ("float32" / "bfloat16") of the params dtype the server
        stores every param in, None when the groups differ: a device workspace's pulls must
        be in it (or in the server's param copy's dtype).
      push_during_backward: True: gradient hooks stage and write the buckets while backward
        runs (the module docstring, 1); False: no gradient hooks, step() stages every
        gradient as one bucket (as a delayed step does) and its push begins on the worker
        while it stages; None: False on a device workspace (moving a step's gradients there
        takes well under a millisecond, less than the hooks' Python costs a CPU-bound
        backward: docs/benchmarks.md, runs E1-E2), True otherwise.
    """

    def __init__(self, optimizer: Any, pairs: Sequence[Tuple[str, torch.Tensor]],
                 grad_dtype: str, pull_dtype: str, bucket_bytes: Optional[int],
                 pull_group_bytes: Optional[int],
                 delay: int, delay_warmup: int, data_plane: str = "auto",
                 edge_bytes: Optional[int] = None, stored_dtype: Optional[str] = None,
                 push_during_backward: Optional[bool] = None):
        self._opt = optimizer
        self._names = [n for n, _ in pairs]
        self._params = [p for _, p in pairs]
        devices = {p.device for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"overlap=True needs every param on one device, got {devices}")
        self.device = devices.pop()
        self._cuda = self.device.type == "cuda"
        self._wire = grad_dtype
        self._wire_dtype = _dtypes.torch_dtype(grad_dtype)
        self._itemsize = _dtypes.element_size(grad_dtype)
        self._numel = [p.numel() for p in self._params]
        self._delay = int(delay)
        self._delay_warmup = int(delay_warmup)
        self._route = Route(optimizer.client, self._names, self._numel)
        streams = max(getattr(c, "streams", 1) for c in self._route.clients)
        self.workspace = self._open_workspace(data_plane, pull_dtype, stored_dtype)
        self.data_plane = ("grpc" if self.workspace is None else
                           "device" if self.workspace.on_device else "workspace")
        self.push_during_backward = (self.data_plane != "device" if push_during_backward is None
                                     else bool(push_during_backward))
        # A delay=0 step's pull rides on its commit (PushCommit.pull) through a device
        # workspace, where the server writes the params there device to device in tens of
        # microseconds: the step's parameters are in the landing buffer when the commit
        # returns, and no pull call runs beside the next forward. Through a host workspace the
        # same bytes would cross PCIe inside the commit, on step()'s path, instead of beside
        # the forward. One server (the route's only shard).
        self.pull_with_commit = self.data_plane == "device" and self._route.shards == 1
        if bucket_bytes is None:
            bucket_bytes = (WORKSPACE_BUCKET_BYTES if self.workspace is not None
                            else GRPC_BUCKET_BYTES)
        self._bucket_bytes = int(bucket_bytes)
        self._edge_bytes = DEFAULT_EDGE_BYTES if edge_bytes is None else int(edge_bytes)
        # The push's planned buckets (params after which one closes), made from the staging
        # order of the last step that staged every gradient in that order.
        self._planned_order: List[int] = []
        self._close_after: Set[int] = set()
        # Delayed on a GPU: the buckets gathered at step() whose copies to the host wait for
        # the next forward (step(), delay=1), and the global forward pre-hook that queues them.
        self._deferred: List[Tuple[int, _Bucket]] = []
        self._views: Dict[Tuple[int, Tuple[int, ...]], List[torch.Tensor]] = {}  # _gather_views
        self._copy_hook: Optional[Any] = None
        self._owner_pid = os.getpid()  # A forked child inherits the hook: _release_copies.
        # A delayed step's one bucket (_add_all_locked): (expected params, offsets, elements).
        self._all_layout: Optional[Tuple[List[int], Dict[int, int], int]] = None
        pull_group_bytes = self._bucket_bytes if pull_group_bytes is None else pull_group_bytes
        self.pulls = PullPipeline(self._route, self._params, pull_dtype, streams,
                                  pull_group_bytes, edge_bytes=self._edge_bytes,
                                  workspace=self.workspace)
        self.pulls.on_landed = self._on_pull_landed
        # The worker's pieces of a bucket's write, by (buffer, first element, params): the
        # same every step once the order settles.
        self._pieces: Dict[Tuple[int, int, Tuple[int, ...]], list] = {}
        self._hyper_failed = False  # A queued send of hyperparameters failed (the worker's).
        self.enabled = True  # False inside no_sync().
        self.steps = 0
        self.fallbacks = 0
        self.buckets_before_step = 0  # Of the last step: staged while backward ran.
        # Compare every gradient with what was sent at each step, also when no version
        # counter moved (for loops that write gradients through .data).
        self.always_check = False
        self._warned: Set[str] = set()
        self._expected: List[int] = []
        self._expected_set: Set[int] = set()
        self._expect([i for i, p in enumerate(self._params) if p.requires_grad])
        self._lock = threading.Lock()
        self._step = _Step()
        self._sent: Optional[torch.Tensor] = None
        self._current: Optional[torch.Tensor] = None
        self._wire_dev: Optional[torch.Tensor] = None
        self._hosts: List[Optional[torch.Tensor]] = [None, None]
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._check_host = torch.zeros(4, dtype=torch.float64, pin_memory=self._cuda)
        self._tasks: "queue.Queue" = queue.Queue()
        self._commit: Optional[Future] = None  # The last commit (and pull start), delay=1.
        self._worker = threading.Thread(target=self._work, name="fusedps-overlap", daemon=True)
        self._worker.start()
        self._gathered: Optional[object] = None  # The last bucket's gathering (GPU).
        self._begun: Optional[tuple] = None  # (tensors, by_shard, index) of the last _begin.
        self._hooks: Optional[GradReadyHooks] = GradReadyHooks(
            self._params, self._on_grad_ready) if self.push_during_backward else None

    # -- hooks (autograd's thread) ------------------------------------------------------------

    def _on_grad_ready(self, i: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            step = self._step
            self._start_push_locked(step)  # At the step's first gradient.
            if self._cuda and not step.fenced:
                # At the end of this backward, the loop's next writes to the gradients (clipping,
                # unscale_) must come after the buckets' gathering: see _fence.
                step.fenced = True
                stream = torch.cuda.current_stream(self.device)  # Backward's (the forward's).
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._end_of_backward(step, stream))
            if i in step.offset:  # A second backward without no_sync: caught at step().
                return
            if i not in self._expected_set:  # A param the push does not name.
                step.mismatch = True
                return
            self._add_locked(step, i)
            if step.unwritten:
                self._write_ready_locked(step)

    def _start_push_locked(self, step: _Step) -> None:
        """Once per step (its first gradient, or step() without gradient hooks): the push,
        naming the expected params, begins on the worker, after the changed hyperparameters
        are sent."""
        if step.tensors is None:
            step.tensors = list(self._expected)
            self._queue_begin(step)
            self._queue_hyperparameters(step)

    def _on_pull_landed(self) -> None:
        """(The loop's thread, once the last step's pull has landed: in the next forward, as a
        rule.) Without gradient hooks, the next step's push begins now on the worker, behind
        the forward, with the hyperparameters changed since (a scheduler's lr), not on
        step()'s path; in a forward without grad (an evaluation) only the hyperparameters go.
        With hooks both go at the first gradient; a delayed step's commit sends them behind
        the next forward."""
        if self.push_during_backward or self._delayed():
            return
        if torch.is_grad_enabled():  # A training forward: backward and step() follow.
            with self._lock:
                self._start_push_locked(self._step)
        # Changed since (a scheduler's lr): also when the push began already (in step(), when
        # the commit carried the pull: land_carried), and in an evaluation's forward.
        self._queue_hyperparameters(self._step)

    def _end_of_backward(self, step: _Step, stream) -> None:
        """Autograd's final callback (GPU): the fence (_fence), and the buckets whose copies
        are done are written."""
        self._fence(stream)
        with self._lock:
            self._write_ready_locked(step)

    def _add_locked(self, step: _Step, i: int, close: bool = True) -> None:
        """Adds param i to the open bucket, and (with close) closes the bucket once it is full
        or the plan ends one after i."""
        step.offset[i] = step.cursor
        step.params.append(i)
        step.bucket.append(i)
        step.cursor += self._numel[i]
        step.bucket_bytes += self._numel[i] * self._itemsize
        if close and (step.bucket_bytes >= self._bucket_bytes or i in self._close_after):
            self._close_bucket_locked(step)

    def _add_all_locked(self, step: _Step) -> None:
        """Adds every expected param to the empty step as one open bucket, as _add_locked
        would one by one (close=False), from a layout made once per expected list: a delayed
        step() stages all of them, on the loop's critical path."""
        if self._all_layout is None or self._all_layout[0] != self._expected:
            offsets, cursor = {}, 0
            for i in self._expected:
                offsets[i] = cursor
                cursor += self._numel[i]
            self._all_layout = (list(self._expected), offsets, cursor)
        params, offsets, cursor = self._all_layout
        step.offset = dict(offsets)
        step.params, step.bucket = list(params), list(params)
        step.cursor = cursor
        step.bucket_bytes = cursor * self._itemsize

    def _plan_buckets(self, order: List[int]) -> None:
        """Plans the next steps' buckets on this staging order (the module docstring, 1)."""
        if order == self._planned_order:
            return
        self._planned_order = list(order)
        ends = plan_ends([self._numel[i] * self._itemsize for i in order], self._bucket_bytes,
                         self._edge_bytes, "tail")
        self._close_after = {order[end - 1] for end in ends}

    def _close_bucket_locked(self, step: _Step, defer_copy: bool = False) -> None:
        if not step.bucket:
            return
        _trace.mark("bucket", step.cursor - step.bucket_begin)
        bucket = _Bucket(step.bucket, step.bucket_begin, step.cursor)
        step.bucket, step.bucket_begin, step.bucket_bytes = [], step.cursor, 0
        if not step.buckets:
            step.push_started = time.perf_counter()
        step.buckets.append(bucket)
        grads = [self._params[i].grad for i in bucket.params]
        for i, g in zip(bucket.params, grads):  # What the check compares with at step().
            step.versions[i] = (g, g._version)
        # On a GPU, gathered on the side stream after this point of the stream that wrote
        # them (backward's, or the loop's at step()); on the CPU, now.
        ready = torch.cuda.current_stream(self.device).record_event() if self._cuda else None
        self._stage(step, bucket, grads, ready, defer_copy=defer_copy)
        if defer_copy:  # Written by the worker once the copy is queued and done.
            self._tasks.put(("write", step, bucket))
        else:  # Written by a later hook, or by step() (_write_ready_locked, _write_staged).
            step.unwritten.append(bucket)

    # -- step() (the training thread) ---------------------------------------------------------

    def _expect(self, params: List[int]) -> None:
        """The params the next pushes name."""
        self._expected = list(params)
        self._expected_set = set(params)

    def wait_parameters(self) -> float:
        """Waits until nothing of fusedps runs: the last commit and pull (delay=1: its values
        are not installed) and every pull into the parameters. Returns the seconds it waited for
        the last delayed commit (which lands its pull too)."""
        waited = 0.0
        self._release_copies()  # The commit waits for them.
        if self._commit is not None:
            commit, self._commit = self._commit, None
            start = time.perf_counter()
            commit.result()
            waited = time.perf_counter() - start
        self.pulls.wait()
        return waited

    def _remove_hooks(self) -> None:
        """Removes the gradient hooks and the pull's forward hooks, for good (close(), or
        delay=1 once delayed)."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self.pulls.remove_forward_hooks()

    def close(self) -> None:
        """Waits for the last commit and pull, then removes the hooks and stops the threads."""
        try:
            self.wait_parameters()
        finally:
            self._remove_hooks()
            if self._copy_hook is not None:
                self._copy_hook.remove()
                self._copy_hook = None
            self._tasks.put(None)
            self._worker.join()
            self._cancel(self._step)  # A push begun (a backward, a forward) and not committed.
            self.pulls.close()
            if self.workspace is not None:
                if self._cuda:  # No copy may still use the memory unpinned (or unmapped).
                    torch.cuda.synchronize(self.device)
                self.workspace.close()
            _trace.dump()

    def _take_step(self) -> _Step:
        """The step the hooks gathered; the next one starts empty (delay=1: staging into the
        other host buffer, since this step's push may still read its own). On a GPU the loop's
        stream first waits for its gathering (_fence): the gradients it holds may be freed
        once it is dropped."""
        if self._cuda:
            self._fence(torch.cuda.current_stream(self.device))
        with self._lock:
            step, self._step = self._step, _Step()
            self._step.buffer = (1 - step.buffer) if self._delay else 0
        return step

    def _delayed(self) -> bool:
        return self._delay > 0 and self.steps >= self._delay_warmup

    def step(self, grad_scaler: Any, grad_scale: Optional[float]) -> Dict[str, float]:
        """The overlapped step (see the module docstring). Returns its timings."""
        opt = self._opt
        t0 = time.perf_counter()
        _trace.mark("step")
        timings = _new_timings()
        delayed = self._delayed()
        # The previous step's commit and pull must be done before this one commits; with
        # delay=0 the forward has waited for most of the pull already.
        # delay=1: the wait for the last commit is a wait for its pull as well.
        commit_wait = self.wait_parameters()
        timings["pull_seconds"] = self.pulls.seconds
        timings["pull_exposed_seconds"] = self.pulls.exposed_seconds + commit_wait
        plan = opt._scaling_plan(grad_scaler, grad_scale)
        with_grad = [i for i, p in enumerate(self._params) if p.grad is not None]
        if not with_grad or plan.skip:
            self._discard(self._take_step())
            opt.last_step_skipped = bool(plan.skip)
            if not plan.skip:
                plan.report(False)
            return self._finish_timings(timings, t0)
        with self._lock:
            step = self._step
            self.buckets_before_step = len(step.buckets)
            mismatch = step.mismatch or with_grad != self._expected
            if not mismatch:
                if not delayed and not self.push_during_backward:
                    # No hooks: the push began in the forward (_on_pull_landed), or begins on
                    # the worker now while this thread stages.
                    if (step.begun is not None
                            and time.perf_counter() - step.begun_at > BEGUN_MAX_SECONDS):
                        self._queue_begin(step, again=True)
                    self._start_push_locked(step)
                if step.tensors is None:
                    step.tensors = list(self._expected)
                if not step.params and (delayed or not self.push_during_backward):
                    # No hooks (delayed, or pushed at step()): all in one bucket.
                    self._add_all_locked(step)
                else:
                    for i in with_grad:
                        if i not in step.offset:  # No hook ran for it (or none is left).
                            self._add_locked(step, i, close=not delayed)
                # Delayed on a GPU: gathered now, copied to the host at the next forward (see
                # the delayed branch below) and then written by the worker: what the hooks
                # staged is written first, here, so that one thread at a time writes.
                if delayed and self._cuda:
                    self._write_staged(step)
                self._close_bucket_locked(step, defer_copy=delayed and self._cuda)
                if not delayed:
                    self._plan_buckets(step.params)
        step = self._take_step()
        if mismatch:
            # Another set of params has gradients than the push named: this step goes in
            # full, and the next pushes name this set.
            self._expect(with_grad)
            self._fallback(step, plan, timings, "the set of params with a gradient changed "
                           "(a param without a grad, or one that has a grad again)")
            return self._finish_timings(timings, t0)
        _trace.mark("check")
        if self._untouched(step) and not (delayed and plan.grad_scale is not None):
            # No gradient was written after it was staged: the common case needs no pass
            # over them (a GradScaler's inf/NaN is then the server's verdict).
            unchanged, finite, uniform, factor = True, True, True, 1.0
        else:
            unchanged, finite, uniform, factor = self._check(step)
        timings["check_seconds"] = time.perf_counter() - t0
        _trace.mark("checked")
        if not finite:
            self._discard(step)
            opt.last_step_skipped = True
            plan.report(True)
            return self._finish_timings(timings, t0)
        if not (unchanged or uniform):
            self._fallback(step, plan, timings, "a gradient changed after it was sent, not by "
                           "one factor for all (as clipping or GradScaler.unscale_ change them)")
            return self._finish_timings(timings, t0)
        commit_scale = plan.grad_scale if unchanged else (plan.grad_scale or 1.0) / factor
        self._write_staged(step)  # Before the commit is queued.
        self._after_hyperparameters_failed()
        hyper = opt._changed_hyperparameters(mark=True)
        if opt._pending is not None:
            start = time.perf_counter()
            self._run_on_worker(opt.write_pending_state)
            timings["load_state_seconds"] = time.perf_counter() - start

        buffers = opt._buffers.snapshot()

        def commit():
            start = time.perf_counter()
            try:
                opt._send_hyperparameters(hyper, mark=False)
            except BaseException:
                self._hyper_failed = True
                self._cancel(step)
                raise
            sent_hyper = time.perf_counter()
            opt._buffers.send(buffers)
            sent = time.perf_counter()
            then_pulls = (self.pulls.prepare_commit_pulls()
                          if self.pull_with_commit and not delayed else None)
            _trace.mark("commit")
            results = self._end(step, commit_scale, then_pulls)
            pushed = time.perf_counter()
            _trace.mark("committed")
            if delayed:
                self.pulls.start("shadow")
                self.pulls.land()  # Here, so that the loop's threads do nothing for it.
                _trace.mark("landed")
            else:
                # A duplicate's reply (the retry table's) carried no pull: pulled as usual.
                pulled = [r.pulled_version for r in results] if then_pulls is not None else []
                self.pulls.start("direct", landed=pulled if pulled and all(pulled) else None)
            return results, sent_hyper - start, sent - sent_hyper, pushed - step.push_started

        self.steps += 1
        if delayed:
            # The values the last commit's pull brought (waited for above) go in now; this
            # step commits behind the next forward, and the next ones are staged here.
            self.pulls.install()
            self._remove_hooks()
            if self._cuda and self._copy_hook is None:
                self._copy_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                    self._release_copies)
            self._commit = self._call(commit)
            opt.last_step_skipped = False
            plan.report(False)
            return self._finish_timings(timings, t0)
        wait = time.perf_counter()
        results, hyper_seconds, buffers_seconds, push_seconds = self._run_on_worker(commit)
        timings["push_exposed_seconds"] = time.perf_counter() - wait
        if self.pulls.land_carried() and not self.push_during_backward:
            # The commit carried the pull: it lands here, and the next push begins now on the
            # worker, while the loop goes on to its own waits (loss.item()). Begun in the next
            # forward instead, the worker's Python took the interpreter lock from the forward's
            # launches: on an H200 the small preset's forward and backward ran about 3 ms
            # slower than local's that way, and as fast as local's this way
            # (docs/benchmarks.md, runs G1-G5). A scheduler's next lr goes at the next
            # forward's first module (on_landed, deferred by land_carried).
            with self._lock:
                self._start_push_locked(self._step)
        timings["push_seconds"] = push_seconds
        timings["hyperparameters_seconds"] = hyper_seconds
        timings["buffers_seconds"] = buffers_seconds
        opt.last_push_result = results[0] if len(results) == 1 else tuple(results)
        for r in results:
            _ro.warn_timed_out_round(r, _logger)
        opt.last_step_skipped = any(r.step_skipped for r in results)
        plan.report(opt.last_step_skipped)
        return self._finish_timings(timings, t0)

    def _finish_timings(self, timings: Dict[str, float], t0: float) -> Dict[str, float]:
        timings["step_wait_seconds"] = time.perf_counter() - t0
        _trace.mark("step_end")
        timings["push_hidden_seconds"] = max(
            0.0, timings["push_seconds"] - timings["push_exposed_seconds"])
        timings["pull_hidden_seconds"] = max(
            0.0, timings["pull_seconds"] - timings["pull_exposed_seconds"])
        timings["exposed_seconds"] = (timings["step_wait_seconds"]
                                      + timings["pull_exposed_seconds"])
        return timings

    def _run_on_worker(self, fn):
        """fn() on the worker, after everything queued before it; waits for it and returns its
        value (raises its error). Queues the deferred copies first: a write queued before
        waits for its copy."""
        self._release_copies()
        return self._call(fn).result()

    def _discard(self, step: _Step) -> None:
        """Cancels the step's push (on the worker, after its writes)."""
        self._run_on_worker(lambda: self._cancel(step))

    def _fallback(self, step: _Step, plan, timings: Dict[str, float], why: str) -> None:
        """Cancels the step's push and pushes the gradients again in full, then pulls."""
        self._discard(step)
        self._after_hyperparameters_failed()  # The worker is done with the step's sends.
        self.pulls.discard()  # The full pull below brings newer values than any shadow.
        self.fallbacks += 1
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"RemoteAdamW(overlap=True): {why}; this step was pushed again in "
                          "full after backward (the push was not hidden). Further steps like it "
                          "are counted in the optimizer's overlap_fallbacks.", RuntimeWarning,
                          stacklevel=4)
        self.steps += 1
        self._opt._step_in_full(plan, timings)


def _new_timings() -> Dict[str, float]:
    keys = ("push_seconds", "push_exposed_seconds", "pull_seconds", "pull_exposed_seconds",
            "check_seconds", "hyperparameters_seconds", "load_state_seconds", "buffers_seconds",
            "step_wait_seconds")
    return {k: 0.0 for k in keys}
