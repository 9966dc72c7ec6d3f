"""RemoteAdamW(overlap=True)'s worker thread: what it does for a step (StepWorker, which
OverlapEngine inherits). Internal module of fusedps/_overlap.py, whose docstring says how a step
goes.

The worker runs tasks in the order they are queued: calls (the begin of a step's pushes, one
fusedps.PushTransaction per server; a commit, a cancel, a send of changed hyperparameters) and,
once delayed (delay=1 on a GPU), the write of a bucket whose copy to the host was deferred.
Every other bucket is written by a gradient hook or by step() (_write_ready_locked,
_write_staged), so that the worker takes the interpreter lock once per step during backward,
not once per bucket. Lifetimes and thread safety (OverlapEngine's docstring has the rest): a
step's transactions are written by one thread at a time: the hooks under _lock while backward
runs, then step(), then the worker (a deferred bucket, queued by step() after its own writes,
and the commit or cancel); the worker publishes them (_begin) before any write. The piece cache
(_pieces) is used by whichever thread writes, and cleared by _begin only for a new set of
params, which no write in flight uses.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, cast

import torch

from fusedps import _trace
from fusedps._overlap_step import _Bucket, _Step, layout_cached
from fusedps._push_transaction import PreparedPieces

__all__ = ["StepWorker"]


class StepWorker:
    """OverlapEngine's worker side (the module docstring)."""

    if TYPE_CHECKING:  # OverlapEngine's, set by its __init__.
        device: Any
        workspace: Any
        _opt: Any
        _cuda: bool
        _wire: str
        _itemsize: int
        _route: Any
        _tasks: Any
        _begun: Optional[tuple]
        _hosts: List[Optional[torch.Tensor]]
        _pieces: Dict[Tuple[int, int, Tuple[int, ...]], List[Optional[PreparedPieces]]]
        _hyper_failed: bool

    def _queue_hyperparameters(self, step: _Step) -> None:
        """At a step's first gradient (the loop waits in backward meanwhile): the changed
        hyperparameters (a scheduler's lr) go to the server now, on the worker before the
        step's writes, not on the step's critical path after backward. A failed send fails
        the step, and the next one sends every group's."""
        opt = self._opt
        changed = opt._changed_hyperparameters(mark=True)
        if not changed:
            return

        def send():
            try:
                _trace.mark("hyperparameters")
                opt._send_hyperparameters(changed, mark=False)
                _trace.mark("hyperparameters_sent")
            except BaseException as e:  # noqa: BLE001 - raised by the step's commit
                self._hyper_failed = True
                if step.error is None:
                    step.error = e

        self._call(send)

    def _after_hyperparameters_failed(self) -> None:
        """(The training thread.) After a failed send of marked hyperparameters, the next
        send is of every group's."""
        if self._hyper_failed:
            self._hyper_failed = False
            self._opt._forget_sent_hyperparameters()

    def _work(self) -> None:
        """The worker's loop: writes, commits and cancels, in the order they come."""
        if self._cuda:
            torch.cuda.set_device(self.device)
        while True:
            task = self._tasks.get()
            if task is None:
                return
            kind, *args = task
            if kind == "write":
                self._write(*args)
            else:  # ("call", future, fn)
                future, fn = args
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the waiter
                        future.set_exception(e)

    def _call(self, fn: Callable[[], Any]) -> Future:
        """Runs fn on the worker, after everything queued before it."""
        future: Future = Future()
        self._tasks.put(("call", future, fn))
        return future

    def _queue_begin(self, step: _Step, again: bool = False) -> None:
        """At a step's first gradient (or, without gradient hooks, once the last pull has
        landed in a training forward, else at step()): its pushes begin on the worker (making
        their calls takes a few hundred microseconds, most of it without the interpreter lock)
        while the loop goes on; the hooks write into them once they are there
        (_write_ready_locked). With ``again`` (step(), before any write) the step's pushes,
        begun long ago, are cancelled first: the server ends a call idle for
        --call-idle-seconds (60 s by default), and a push begun in a forward waits idle until
        step(), through whatever the loop did between (an evaluation with grad on, say). An
        error is the step's (raised at step())."""
        def begin():
            if again:
                self._cancel(step)
                step.transactions = None
            try:
                self._begin(step)
            except BaseException as e:  # noqa: BLE001 - reported at step()
                if step.error is None:
                    step.error = e

        step.begun_at = time.perf_counter()
        step.begun = self._call(begin)

    def _begin(self, step: _Step) -> None:
        """Begins the step's push on every server that holds some of its params; publishes
        step.transactions last (the hooks write once they see it)."""
        # The same params each step, as a rule: their split over the shards is made once.
        _trace.mark("begin")
        named = cast(List[int], step.tensors)  # Fixed with the step's first gradient.
        if self._begun is None or self._begun[0] != named:
            self._begun = (list(named), *self._route.tensors_by_shard(named))
            self._pieces.clear()  # They name tensors by their index in the push.
        _, by_shard, step.index = self._begun
        # Through a device workspace the push's calls carry only places (a few hundred bytes):
        # one call, not one per stream, whose starts and ends the commit would wait for.
        max_parts = 1 if self.workspace is not None and self.workspace.on_device else None
        transactions = []
        for shard, tensors in enumerate(by_shard):
            client = self._route.clients[shard]
            transactions.append(None if not tensors else client.begin_push(
                tensors, grad_dtype=self._wire, plan_hash=self._route.plan_hash,
                workspace=self.workspace, max_parts=max_parts))
        step.transactions = transactions
        _trace.mark("begun")

    def _write_ready_locked(self, step: _Step) -> None:
        """(A gradient hook, or backward's end; under _lock.) Writes the step's staged buckets
        whose copies to the host are done, in staging order, once its pushes have begun. So
        the worker runs no Python per bucket while backward computes: each time it takes the
        interpreter lock, backward's hooks wait for it (docs/benchmarks.md, run Z7)."""
        while step.unwritten and step.transactions is not None:
            bucket = step.unwritten[0]
            if bucket.event is not None and not bucket.event.query():
                return
            del step.unwritten[0]
            self._write(step, bucket)

    def _write_staged(self, step: _Step) -> None:
        """(step(), on the training thread.) Writes every staged bucket not written yet, each
        once its copy is done, after the begin the hooks queued (if they did; else it begins
        here). The hooks no longer write this step: it was taken, or backward is over."""
        if step.begun is not None:
            step.begun.result()  # Never raises: the error is the step's.
        unwritten, step.unwritten = step.unwritten, []
        for bucket in unwritten:
            self._write(step, bucket)

    def _write(self, step: _Step, bucket: _Bucket) -> None:
        """Writes a staged bucket into the step's pushes (beginning them if no one has), after
        its copy to the host; an error is the step's. Called by one thread at a time per step
        (_write_ready_locked, _write_staged, the worker for a deferred copy)."""
        if step.error is not None:
            return
        try:
            if step.transactions is None:
                self._begin(step)
            transactions = cast(list, step.transactions)  # Set by _begin.
            if bucket.copied is not None:  # A deferred copy (delay=1): queued at the next
                bucket.copied.wait()         # forward, or before anything waits for the worker.
                if bucket.copy_error is not None:
                    raise bucket.copy_error
            if bucket.event is not None:
                bucket.event.synchronize()
            _trace.mark("write", bucket.end - bucket.begin)
            for txn, prepared in zip(transactions, self._pieces_of(step, bucket)):
                if prepared is not None:
                    txn.write_prepared(prepared)
        except BaseException as e:  # noqa: BLE001 - reported at step()
            step.error = e

    def _pieces_of(self, step: _Step, bucket: _Bucket) -> List[Optional[PreparedPieces]]:
        """Per shard, the bucket's write: its (tensor index, element offset, elements, host
        address) pieces, prepared for the transport (PushTransaction.prepare), or None where
        it has none. Made once per buffer, place and params (and push's tensors, _begin): a
        bucket's write, in a gradient hook on backward's critical path, is then one call per
        shard."""
        def make() -> List[Optional[PreparedPieces]]:
            host = cast(torch.Tensor, self._hosts[step.buffer])  # Made by _stage's _buffers.
            base = host.data_ptr()
            transactions = cast(list, step.transactions)
            pieces: List[list] = [[] for _ in transactions]
            for i in bucket.params:
                at = step.offset[i]
                for k, seg in enumerate(self._route.segments[i]):
                    address = base + (at + seg.begin) * self._itemsize
                    pieces[seg.shard].append((step.index[(i, k)], 0, seg.numel, address))
            return [txn.prepare(p) if p else None for txn, p in zip(transactions, pieces)]

        return layout_cached(self._pieces, (step.buffer, bucket.begin, tuple(bucket.params)),
                             make)

    def _end(self, step: _Step, grad_scale: Optional[float],
             then_pulls: Optional[list] = None) -> list:
        """Commits (grad_scale, or cancels when it is False) every transaction of the step;
        returns the commits' results. then_pulls: per shard, the pull its commit carries
        (PullPipeline.prepare_commit_pulls). Raises the first error (the others are
        cancelled)."""
        if step.error is not None:
            self._cancel(step)
            raise step.error
        if step.transactions is None:
            raise RuntimeError("internal: a step with nothing staged was committed")
        results, error = [], None
        for shard, txn in enumerate(step.transactions):
            if txn is None:
                continue
            try:
                if error is None:
                    results.append(txn.commit(grad_scale, None if then_pulls is None
                                              else then_pulls[shard]))
                else:
                    txn.cancel()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                error = e
            finally:
                txn.close()
        if error is not None:
            raise error
        return results

    @staticmethod
    def _cancel(step: _Step) -> None:
        for txn in step.transactions or ():
            if txn is not None:
                txn.close()

