"""RemoteAdamW(overlap=True)'s record of a step (what the gradient hooks and step() gathered:
_Step and its _Bucket list) and the check at step() of the gradients against what was sent
(StepCheck, which OverlapEngine inherits). Internal module of fusedps/_overlap.py, whose
docstring says how a step goes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, TypeVar, cast

import torch

# A gradient changed by one factor c, as fl(g * c): with c estimated in fp32 from one element,
# |new - fl(old * c_est)| stays within about 4 roundings of |new| (2^-22); the bound allows 16,
# and an absolute 1e-30 for subnormals.
_RATIO_RTOL = 2.0 ** -20
_RATIO_ATOL = 1e-30


_T = TypeVar("_T")


def layout_cached(cache: Dict[Any, _T], key: Any, make: Callable[[], _T]) -> _T:
    """cache[key], made by make() on first use: the Python work of a bucket's layout (its
    gather's views, its write's pieces), the same every step once the staging order settles.
    Emptied past 4096 entries, so that orders that never settle cannot grow it for ever."""
    value = cache.get(key)
    if value is None:
        value = make()
        if len(cache) > 4096:
            cache.clear()
        cache[key] = value
    return value


@dataclass
class _Bucket:
    params: List[int]
    begin: int  # Elements into the step's flat buffers.
    end: int
    event: Optional[Any] = None  # The staging's device copy (torch.cuda.Event); None on the CPU.
    # Set once that copy is queued, when it was deferred (delay=1 on a GPU); None: queued with
    # the gathering. copy_error: why a deferred copy was not queued (then set all the same).
    copied: Optional[threading.Event] = None
    copy_error: Optional[BaseException] = None


@dataclass
class _Step:
    """What the hooks and step() gathered for one step."""

    params: List[int] = field(default_factory=list)  # In staging order.
    offset: Dict[int, int] = field(default_factory=dict)
    cursor: int = 0
    bucket: List[int] = field(default_factory=list)
    bucket_begin: int = 0
    bucket_bytes: int = 0
    buckets: List[_Bucket] = field(default_factory=list)
    buffer: int = 0  # Which host buffer (delay=1 alternates two).
    tensors: Optional[List[int]] = None  # The push's params, fixed when it began.
    transactions: Optional[list] = None  # Per shard; published by _begin.
    begun: Optional[Any] = None  # The Future of the begin the first hook queued (_queue_begin).
    begun_at: float = 0.0  # When it was queued (time.perf_counter()).
    # Staged buckets (their copies queued, not deferred) that are not written yet, in order.
    unwritten: List["_Bucket"] = field(default_factory=list)
    index: Dict[Tuple[int, int], int] = field(default_factory=dict)
    error: Optional[BaseException] = None  # The worker's, while writing.
    mismatch: bool = False  # A gradient of a param the push does not name.
    fenced: bool = False  # The end-of-backward fence is queued (GPU).
    # Per staged param, its gradient tensor and that tensor's version counter when it was
    # staged: both the same at step() means nothing wrote it since, through autograd's view.
    versions: Dict[int, Tuple[torch.Tensor, int]] = field(default_factory=dict)
    push_started: float = 0.0


class StepCheck:
    """OverlapEngine's check of a step's gradients (step 2 of fusedps/_overlap.py's docstring)."""

    if TYPE_CHECKING:  # OverlapEngine's, set by its __init__.
        always_check: bool
        device: Any
        _params: List[torch.Tensor]
        _cuda: bool
        _stream: Any
        _sent: Optional[torch.Tensor]
        _current: Optional[torch.Tensor]
        _check_host: torch.Tensor

    def _untouched(self, step: _Step) -> bool:
        """Every param's gradient is the tensor staged, at the version staged (in-place writes
        through autograd's views, as clip_grad_norm_ and GradScaler.unscale_ make, count; writes
        through .data do not, see RemoteAdamW's overlap)."""
        if self.always_check:
            return False
        for i in step.params:
            g = self._params[i].grad
            staged = step.versions.get(i)
            if staged is None or staged[0] is not g or staged[1] != g._version:
                return False
        return True

    def _check(self, step: _Step) -> Tuple[bool, bool, bool, float]:
        """(unchanged, finite, uniform, c): the gradients now against what was sent, on the
        device, in one pass; one synchronization. uniform: every gradient is what was sent
        times one c, within fp32 rounding (c from the largest sent element)."""
        n = step.cursor
        sent_all = cast(torch.Tensor, self._sent)  # Made when the step's first bucket was staged.
        if self._current is None:
            self._current = torch.empty_like(sent_all)
        sent, current = sent_all[:n], self._current[:n]
        grads = [self._params[i].grad for i in step.params]
        with torch.no_grad():
            if self._cuda:
                ready = torch.cuda.current_stream(self.device).record_event()
                context = torch.cuda.stream(self._stream)
            else:
                context = _nullcontext()
            with context:
                if self._cuda:
                    self._stream.wait_event(ready)
                torch.cat([g.reshape(-1).float() for g in grads], out=current)
                unchanged = (current.view(torch.int32) == sent.view(torch.int32)).all()
                finite = torch.isfinite(current).all()
                k = sent.abs().argmax()
                factor = current[k] / sent[k]
                residual = torch.mul(sent, factor).sub_(current).abs_()
                bound = current.abs().mul_(_RATIO_RTOL).add_(_RATIO_ATOL)
                uniform = (residual <= bound).all()
                self._check_host.copy_(torch.stack([
                    unchanged.double(), finite.double(), uniform.double(), factor.double()]),
                    non_blocking=self._cuda)
                if self._cuda:
                    event = self._stream.record_event()
        if self._cuda:
            event.synchronize()
        values = self._check_host.tolist()
        return bool(values[0]), bool(values[1]), bool(values[2]), float(values[3])


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
