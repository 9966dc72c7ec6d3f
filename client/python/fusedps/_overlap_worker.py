"""RemoteAdamW(overlap=True)'s worker thread: what it does for a step (StepWorker, which
OverlapEngine inherits). Internal module of fusedps/_overlap.py, whose docstring says how a step
goes.

The worker runs tasks in the order they are queued: a bucket's write into the step's pushes
(one fusedps.PushTransaction per server), calls (a commit, a cancel, a send of changed
hyperparameters). Hooks and step() queue; only the worker waits on the network. Lifetimes and
thread safety: OverlapEngine's docstring; the piece cache (_pieces) and the step's
transactions are the worker's alone.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, cast

import torch

from fusedps import _trace
from fusedps._overlap_step import _Bucket, _Step, layout_cached

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
        _pieces: Dict[Tuple[int, int, Tuple[int, ...]], List[list]]
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
                opt._send_hyperparameters(changed, mark=False)
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

    def _begin(self, step: _Step) -> None:
        """Begins the step's push on every server that holds some of its params."""
        # The same params each step, as a rule: their split over the shards is made once.
        named = cast(List[int], step.tensors)  # Fixed with the step's first gradient.
        if self._begun is None or self._begun[0] != named:
            self._begun = (list(named), *self._route.tensors_by_shard(named))
            self._pieces.clear()  # They name tensors by their index in the push.
        _, by_shard, step.index = self._begun
        step.transactions = []
        for shard, tensors in enumerate(by_shard):
            client = self._route.clients[shard]
            step.transactions.append(None if not tensors else client.begin_push(
                tensors, grad_dtype=self._wire, plan_hash=self._route.plan_hash,
                workspace=self.workspace))

    def _write(self, step: _Step, bucket: _Bucket) -> None:
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
            for txn, shard_pieces in zip(transactions, self._pieces_of(step, bucket)):
                if shard_pieces:
                    txn.write(shard_pieces)
        except BaseException as e:  # noqa: BLE001 - reported at step()
            step.error = e

    def _pieces_of(self, step: _Step, bucket: _Bucket) -> List[list]:
        """Per shard, the (tensor index, element offset, elements, host address) pieces of the
        bucket's write; made once per buffer, place and params (and push's tensors, _begin)."""
        def make() -> List[list]:
            host = cast(torch.Tensor, self._hosts[step.buffer])  # Made by _stage's _buffers.
            base = host.data_ptr()
            pieces: List[list] = [[] for _ in cast(list, step.transactions)]
            for i in bucket.params:
                at = step.offset[i]
                for k, seg in enumerate(self._route.segments[i]):
                    address = base + (at + seg.begin) * self._itemsize
                    pieces[seg.shard].append((step.index[(i, k)], 0, seg.numel, address))
            return pieces

        return layout_cached(self._pieces, (step.buffer, bucket.begin, tuple(bucket.params)),
                             make)

    def _end(self, step: _Step, grad_scale: Optional[float]) -> list:
        """Commits (grad_scale, or cancels when it is False) every transaction of the step;
        returns the commits' results. Raises the first error (the others are cancelled)."""
        if step.error is not None:
            self._cancel(step)
            raise step.error
        if step.transactions is None:
            raise RuntimeError("internal: a step with nothing staged was committed")
        results, error = [], None
        for txn in step.transactions:
            if txn is None:
                continue
            try:
                if error is None:
                    results.append(txn.commit(grad_scale))
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

