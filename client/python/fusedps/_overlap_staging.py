"""RemoteAdamW(overlap=True)'s staging of a bucket (Staging, which OverlapEngine inherits):
its gradients gathered into the flat fp32 buffer ``sent`` and copied to the host buffer the
push reads, and the fence that orders the loop's next writes after the gathering. Internal
module of fusedps/_overlap.py, whose docstring says how a step goes and when the copy to the
host is deferred (delay=1 on a GPU).

Threads: _stage runs under OverlapEngine._lock (from a gradient hook on autograd's thread, or
from step()); _release_copies on the loop's thread (the forward pre-hook, or before a wait
for the worker), under the same lock. The side stream is used by one of them at a time.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, cast

import torch

from fusedps._overlap_step import _Bucket, _Step, layout_cached

__all__ = ["Staging"]

# torch >= 2.1: a bucket's gradients are gathered by one call (torch 1.13 concatenates them).
_FOREACH_COPY = hasattr(torch, "_foreach_copy_")


class Staging:
    """OverlapEngine's staging side (the module docstring)."""

    if TYPE_CHECKING:  # OverlapEngine's, set by its __init__.
        device: Any
        workspace: Any
        _cuda: bool
        _wire_dtype: torch.dtype
        _numel: List[int]
        _params: List[torch.Tensor]
        _lock: Any
        _stream: Any
        _sent: Optional[torch.Tensor]
        _wire_dev: Optional[torch.Tensor]
        _hosts: List[Optional[torch.Tensor]]
        _gathered: Optional[object]
        _deferred: List[Tuple[int, _Bucket]]
        _views: Dict[Tuple[int, Tuple[int, ...]], List[torch.Tensor]]
        _owner_pid: int  # The process that made the engine (os.getpid()).

    def _fence(self, stream) -> None:
        """At the end of backward (autograd's final callback, on its thread) and of step()'s
        staging: the stream the loop goes on in waits for every bucket's gathering (not its copy
        to the host), so that what was sent is each gradient as it was staged, whatever the loop
        writes next (clipping, zero_grad(set_to_none=False), the next backward)."""
        if self._gathered is not None:
            stream.wait_event(self._gathered)

    def _buffers(self, buffer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(sent, host) of a step, made on first use: sent is fp32 on the device; host holds
        the wire bytes (pinned on a GPU; on the CPU, sent itself for fp32). With a device
        workspace, host is a CUDA tensor carved from it: the copy into it converts to the
        wire dtype itself, with no _wire_dev between."""
        total = sum(self._numel)
        if self._sent is None:
            self._sent = torch.empty(total, dtype=torch.float32, device=self.device)
            on_device = self.workspace is not None and self.workspace.on_device
            if self._cuda and self._wire_dtype != torch.float32 and not on_device:
                self._wire_dev = torch.empty(total, dtype=self._wire_dtype, device=self.device)
        if self._hosts[buffer] is None:
            if self.workspace is not None:
                self._hosts[buffer] = self.workspace.carve(total, self._wire_dtype)
            elif not self._cuda and self._wire_dtype == torch.float32:
                self._hosts[buffer] = self._sent if buffer == 0 else torch.empty(total)
            else:
                self._hosts[buffer] = torch.empty(total, dtype=self._wire_dtype,
                                                  pin_memory=self._cuda)
        return self._sent, self._hosts[buffer]

    def _stage(self, step: _Step, bucket: _Bucket, grads: List[torch.Tensor], ready,
               defer_copy: bool = False) -> None:
        """Gathers the bucket's gradients into sent and the host buffer: on a GPU on the side
        stream, after `ready` (where backward wrote them), without waiting for it. With
        defer_copy (a GPU), the copy to the host waits for _release_copies (below)."""
        sent, host = self._buffers(step.buffer)
        r = slice(bucket.begin, bucket.end)
        with torch.no_grad():
            if not self._cuda:
                torch.cat([g.reshape(-1).float() for g in grads], out=sent[r])
                if host.data_ptr() != sent.data_ptr():
                    host[r].copy_(sent[r])
                return
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                # The gradients need no record_stream: the step holds them (its versions)
                # until it is taken, after the loop's stream waits for this gathering (_fence),
                # so the allocator cannot give their memory to work not ordered after it.
                if _FOREACH_COPY:  # One call; no view of each gradient made in Python.
                    torch._foreach_copy_(self._gather_views(bucket), grads)
                else:
                    torch.cat([g.reshape(-1) if g.dtype == torch.float32
                               else g.reshape(-1).float() for g in grads], out=sent[r])
                self._gathered = self._stream.record_event()
                if self._wire_dev is not None:
                    self._wire_dev[r].copy_(sent[r])
        if defer_copy:
            bucket.copied = threading.Event()
            self._deferred.append((step.buffer, bucket))
        else:
            self._copy_to_host(step.buffer, bucket)

    def _gather_views(self, bucket: _Bucket) -> List[torch.Tensor]:
        """Views of sent where the bucket's gradients go, each of its param's shape; made once
        per place and params (the same every step once the order settles)."""
        def make() -> List[torch.Tensor]:
            sent = cast(torch.Tensor, self._sent)  # Made by _buffers before any staging.
            views, at = [], bucket.begin
            for i in bucket.params:
                views.append(sent[at:at + self._numel[i]].view(self._params[i].shape))
                at += self._numel[i]
            return views

        return layout_cached(self._views, (bucket.begin, tuple(bucket.params)), make)

    def _copy_to_host(self, buffer: int, bucket: _Bucket) -> None:
        """Queues the copy of a gathered bucket (GPU) to the host buffer, on the side stream
        after its gathering (device to device, converting, into a device workspace); the
        worker writes it into the push once it is done (its event). A deferred
        bucket is marked copied whatever happens, with the error if the copy could not be
        queued (the worker then fails the step with it rather than wait for ever)."""
        try:
            r = slice(bucket.begin, bucket.end)
            source = (self._wire_dev if self._wire_dev is not None else self._sent)[r]
            with torch.no_grad(), torch.cuda.stream(self._stream):
                host = cast(torch.Tensor, self._hosts[buffer])  # Made by _buffers (staging).
                host[r].copy_(source, non_blocking=True)
                bucket.event = self._stream.record_event()
        except BaseException as e:
            bucket.copy_error = e
            raise
        finally:
            if bucket.copied is not None:
                bucket.copied.set()

    def _release_copies(self, *_unused) -> None:
        """Queues the deferred copies to the host (step(), delay=1). Called by the global
        forward pre-hook while delayed (at the next forward's first module) and before any
        wait for the worker (wait_parameters, _discard), which would wait for them. Raises the
        first copy's error; every deferred bucket is marked copied before it returns. Does
        nothing in a forked child (a DataLoader worker calling a transform that is a Module):
        the copies are the parent's, and CUDA is not the child's to use."""
        if not self._deferred:  # Every module's forward calls this: the common case first.
            return
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            deferred, self._deferred = self._deferred, []
            try:
                for buffer, bucket in deferred:
                    self._copy_to_host(buffer, bucket)
            finally:  # After an error (or an interrupt): the rest are not queued, but marked.
                for _, bucket in deferred:
                    if bucket.copied is not None and not bucket.copied.is_set():
                        bucket.copy_error = RuntimeError(
                            "the gradients' copy to the host was not queued: an earlier "
                            "bucket's copy failed")
                        bucket.copied.set()
