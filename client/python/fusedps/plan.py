"""The sharding plan: which contiguous slice of which tensor lives on which of S servers.

The algorithm, the naming of slices on the servers and the plan's hash are specified in
docs/sharding.md; the C++ client (fusedps::ShardPlan, client/include/fusedps/plan.h) implements
the same, and tests/e2e/test_plan_interop.py checks that the two agree. Nothing here talks to
the network or needs torch.

Example::

    from fusedps.plan import make_plan

    plan = make_plan([("wte", (50257, 768)), ("ln.b", (768,), "no_decay")], shards=4)
    plan.hash                  # '3f5c...' (32 hex chars), sent with every registration and push
    for s in plan.shard_slices(0):
        print(s.server_tensor, s.shape_on_server, s.param_group)   # wte[0:1048576] (1048576,)
"""

from __future__ import annotations

import hashlib
import heapq
import json
import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

__all__ = ["DEFAULT_SLICE_ELEMENTS", "PlanSlice", "ShardPlan", "make_plan"]

# 4 MiB of fp32: the partition size of BytePS.
DEFAULT_SLICE_ELEMENTS = 1 << 20

# The first line of the hashed text; a change of the algorithm or the text gets a new version.
_HASH_HEADER = "fusedps-plan-v1"

_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class PlanSlice:
    """Elements [begin, end) of one tensor's row-major (flattened) elements, held by one shard.

    Attributes:
      tensor: the model tensor's name.
      server_tensor: the name the shard knows it by: ``tensor`` when the slice is the whole
        tensor, else ``"tensor[begin:end]"``.
      shape_on_server: the tensor's shape for a whole tensor, else ``(end - begin,)``.
      param_group: the tensor's param group.
      begin, end: element offsets into the flattened tensor (end exclusive).
      shard: the index of the server holding it, in [0, shards).
    """

    tensor: str
    server_tensor: str
    shape_on_server: Tuple[int, ...]
    param_group: str
    begin: int
    end: int
    shard: int

    @property
    def numel(self) -> int:
        """The slice's element count, end - begin."""
        return self.end - self.begin


@dataclass(frozen=True)
class PlanTensor:
    """One tensor of the plan: name, shape (tuple; () for 0-dim), param group, element count."""

    name: str
    shape: Tuple[int, ...]
    param_group: str
    numel: int


@dataclass(frozen=True)
class ShardPlan:
    """A model's tensors split over ``shards`` servers (make_plan builds it).

    Attributes:
      shards: the number of servers S (>= 1).
      slice_elements: C, the largest slice in elements.
      tensors: PlanTensor of every tensor, sorted by the UTF-8 bytes of their names.
      slices: every PlanSlice, in the order of ``tensors`` and then increasing offsets (the
        order the hash lists them in, and each server registers its own in).
      loads: elements held by each shard (a tuple of S ints).
      hash: 32 lowercase hex characters naming the plan (docs/sharding.md).
    """

    shards: int
    slice_elements: int
    tensors: Tuple[PlanTensor, ...]
    slices: Tuple[PlanSlice, ...]
    loads: Tuple[int, ...]
    hash: str

    def shard_slices(self, shard: int) -> List[PlanSlice]:
        """The slices of one shard, in registration order.

        Raises:
          IndexError: shard outside [0, shards).
        """
        if not 0 <= shard < self.shards:
            raise IndexError(f"shard {shard} outside [0, {self.shards})")
        return [s for s in self.slices if s.shard == shard]

    def tensor_slices(self, name: str) -> List[PlanSlice]:
        """The slices of one tensor, by increasing offset.

        Raises:
          KeyError: no tensor of that name.
        """
        out = [s for s in self.slices if s.tensor == name]
        if not out:
            raise KeyError(f"no tensor named {name!r} in the plan")
        return out

    def hash_text(self) -> str:
        """The text whose SHA-256 gives ``hash`` (docs/sharding.md, "The plan's hash")."""
        return _hash_text(self.shards, self.slice_elements, self.tensors, self.slices)

    def to_dict(self) -> Dict[str, Any]:
        """``{"hash", "shards", "slice_elements", "slices": [[tensor, begin, end, shard], ...]}``,
        slices in the order of ``slices``: what ``fusedps plan`` (the C++ CLI) prints."""
        return {
            "hash": self.hash,
            "shards": self.shards,
            "slice_elements": self.slice_elements,
            "slices": [[s.tensor, s.begin, s.end, s.shard] for s in self.slices],
        }

    def to_json(self) -> str:
        """to_dict() as one line of JSON, names in UTF-8 as they are (ensure_ascii=False):
        byte for byte what ``fusedps plan`` (fusedps::ShardPlan::ToJson) prints, but for its
        newline."""
        return json.dumps(self.to_dict(), ensure_ascii=False)


def make_plan(tensors, shards: int, slice_elements: int = DEFAULT_SLICE_ELEMENTS, *,
              param_group: str = "default") -> ShardPlan:
    """Computes the plan of docs/sharding.md.

    Args:
      tensors: the model's tensors, as any of
        * a sequence of ``(name, shape)`` or ``(name, shape, param_group)``, a shape being a
          sequence of ints (dims >= 0; () for a 0-dim tensor) or a torch.Size;
        * an nn.Module (its named_parameters()), a mapping name -> tensor, or (name, tensor)
          pairs: the tensors' shapes.
      shards: the number of servers S, >= 1.
      slice_elements: C, the largest slice in elements (>= 1); a tensor of more elements is cut
        into ceil(n / C) slices.
      param_group: the group of a tensor given without one (or with "").

    Returns:
      ShardPlan. The same tensors give the same plan in any input order.
    Raises:
      ValueError: shards < 1, slice_elements < 1, an empty name or one given twice, a negative
        dim, more than 2**63 - 1 elements, a name without a UTF-8 encoding (lone surrogates).
      TypeError: a name or group that is not a str, a dim that is not an int, an entry of
        another form.
    """
    shards = operator.index(shards)
    slice_elements = operator.index(slice_elements)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if slice_elements < 1:
        raise ValueError(f"slice_elements must be >= 1, got {slice_elements}")
    plan_tensors = _sorted_tensors(tensors, param_group)

    # Step 2: slices, in the order of step 1 and then offsets.
    pieces: List[Tuple[PlanTensor, int, int]] = []
    for t in plan_tensors:
        if t.numel <= slice_elements:
            pieces.append((t, 0, t.numel))
        else:
            for begin in range(0, t.numel, slice_elements):
                pieces.append((t, begin, min(begin + slice_elements, t.numel)))

    # Step 3: largest first; sorted() is stable, so equal counts keep the order of step 2.
    order = sorted(range(len(pieces)), key=lambda i: pieces[i][2] - pieces[i][1], reverse=True)
    # Step 4: the least loaded shard; the heap's (load, index) order sends ties to the lowest.
    heap = [(0, i) for i in range(shards)]
    owner = [0] * len(pieces)
    for i in order:
        load, shard = heapq.heappop(heap)
        owner[i] = shard
        heapq.heappush(heap, (load + pieces[i][2] - pieces[i][1], shard))
    loads = [0] * shards
    for load, shard in heap:
        loads[shard] = load

    slices = tuple(_slice(t, begin, end, owner[i]) for i, (t, begin, end) in enumerate(pieces))
    text = _hash_text(shards, slice_elements, plan_tensors, slices)
    digest = hashlib.sha256(text.encode("utf-8")).digest()[:16].hex()
    return ShardPlan(shards, slice_elements, plan_tensors, slices, tuple(loads), digest)


# ----------------------------------------------------------------------------------------------
# Internals
# ----------------------------------------------------------------------------------------------

def _slice(t: PlanTensor, begin: int, end: int, shard: int) -> PlanSlice:
    if begin == 0 and end == t.numel:
        return PlanSlice(t.name, t.name, t.shape, t.param_group, begin, end, shard)
    return PlanSlice(t.name, f"{t.name}[{begin}:{end}]", (end - begin,), t.param_group, begin,
                     end, shard)


def _hash_text(shards: int, slice_elements: int, tensors: Sequence[PlanTensor],
               slices: Sequence[PlanSlice]) -> str:
    by_name = {t.name: t for t in tensors}
    lines = [f"{_HASH_HEADER} shards={shards} slice_elements={slice_elements}\n"]
    for s in slices:
        t = by_name[s.tensor]
        shape = ",".join(str(d) for d in t.shape)
        lines.append(f"{_utf8_len(t.name)}:{t.name} [{shape}] "
                     f"{_utf8_len(t.param_group)}:{t.param_group} {s.begin} {s.end} {s.shard}\n")
    return "".join(lines)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def _sorted_tensors(tensors, default_group: str) -> Tuple[PlanTensor, ...]:
    """Step 1: PlanTensor of every entry, sorted by the UTF-8 bytes of the names."""
    if not isinstance(default_group, str) or not default_group:
        raise TypeError(f"param_group must be a non-empty str, got {default_group!r:.80}")
    out: Dict[bytes, PlanTensor] = {}
    for entry in _entries(tensors):
        if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
            raise TypeError("expected (name, shape) or (name, shape, param_group), got "
                            f"{entry!r:.80}")
        name, shape = entry[0], _shape_of(entry[0], entry[1])
        group = (entry[2] if len(entry) == 3 else "") or default_group
        if not isinstance(name, str):
            raise TypeError(f"a tensor name must be a str, got {name!r:.80}")
        if not name:
            raise ValueError("a tensor has an empty name")
        if not isinstance(group, str):
            raise TypeError(f"{name}: param group must be a str, got {group!r:.80}")
        key = _utf8(name)
        _utf8(group)
        if key in out:
            raise ValueError(f"tensor name {name!r} appears twice")
        out[key] = PlanTensor(name, shape, group, _numel(name, shape))
    return tuple(out[key] for key in sorted(out))


def _entries(tensors):
    """The entries of any accepted form: a module's or mapping's (name, tensor) pairs, else the
    sequence itself."""
    if hasattr(tensors, "named_parameters") and callable(tensors.named_parameters):
        return list(tensors.named_parameters())
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    if isinstance(tensors, (str, bytes)):
        raise TypeError("expected tensors as (name, shape) entries, got a string")
    return list(tensors)


def _shape_of(name, shape) -> Tuple[int, ...]:
    """A tuple of ints of a shape, or of a tensor's (anything with a ``.shape``) shape."""
    if hasattr(shape, "shape") and not isinstance(shape, (tuple, list)):
        shape = shape.shape
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"{name!r:.80}: a shape must be a sequence of ints, got "
                        f"{shape!r:.80}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"{name!r:.80}: negative dim in shape {list(dims)}")
    return dims


def _numel(name: str, dims: Tuple[int, ...]) -> int:
    """The element count, refused past 2**63 - 1 as the C++ plan does (dim by dim)."""
    numel = 1
    for d in dims:
        if d != 0 and numel > _INT64_MAX // d:
            raise ValueError(f"{name!r:.80}: shape {list(dims)} has more than 2**63 - 1 "
                             "elements")
        numel *= d
    return numel


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{text!r:.80} has no UTF-8 encoding (a lone surrogate)") from None
