"""A model's buffers (docs/api.md, "Buffers"): module state that is not a parameter
(torch.nn.Module.register_buffer: BatchNorm's running_mean, running_var and
num_batches_tracked). The server keeps them beside the model's tensors, never optimized, and in
its checkpoints, so that a checkpoint restores the whole module (fusedps.checkpoint.to_torch).

The calls Client.write_buffers and pull_buffers make (ShardedClient's go to its first shard).
Buffers travel in their own dtype (_safetensors' names: F32, I64, BOOL, ...), bit for bit.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from fusedps import _safetensors
from fusedps.v1 import parameter_service_pb2 as pb

# A WriteBuffers request carries buffers up to about this many bytes (a larger buffer goes
# alone): well under the server's 8 MiB default receive limit.
_REQUEST_BYTES = 4 << 20


def module_buffers(module: torch.nn.Module, prefix: str = "") -> List[Tuple[str, torch.Tensor]]:
    """The buffers of ``module`` that its state_dict holds (persistent ones), by their
    state_dict names, each with ``prefix`` prepended: what a strict load_state_dict needs
    besides the parameters."""
    params = {id(p) for p in module.parameters()}
    return [(prefix + name, t) for name, t in module.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and id(t) not in params]


def named_buffers(buffers, prefix: str = "") -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a Module (module_buffers), a mapping or an iterable of pairs.

    Raises:
      TypeError: a value that is not a tensor, or of a dtype the server does not keep.
      ValueError: a name twice.
    """
    if isinstance(buffers, torch.nn.Module):
        pairs = module_buffers(buffers, prefix)
    elif isinstance(buffers, Mapping):
        pairs = [(prefix + str(n), t) for n, t in buffers.items()]
    else:
        pairs = [(prefix + str(n), t) for n, t in buffers]
    seen = set()
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"buffer {name!r} is a {type(t).__name__}, not a tensor")
        _safetensors.dtype_name(t.dtype)
        if name in seen:
            raise ValueError(f"buffer {name!r} is named twice")
        seen.add(name)
    return pairs


def _to_pb(name: str, t: torch.Tensor) -> "pb.Buffer":
    return pb.Buffer(name=name, dtype=_safetensors.dtype_name(t.dtype), shape=list(t.shape),
                     data=_safetensors.tensor_bytes(t))


def write(stub, model: str, pairs: Sequence[Tuple[str, torch.Tensor]],
          timeout: Optional[float]) -> int:
    """WriteBuffers, in requests of about _REQUEST_BYTES (each all or nothing, in order).
    Returns the model's version at the last write."""
    version = 0
    batch: List["pb.Buffer"] = []
    size = 0
    requests = []
    for name, t in pairs:
        b = _to_pb(name, t)
        if batch and size + len(b.data) > _REQUEST_BYTES:
            requests.append(batch)
            batch, size = [], 0
        batch.append(b)
        size += len(b.data)
    if batch:
        requests.append(batch)
    for buffers in requests:
        r = stub.WriteBuffers(pb.WriteBuffersRequest(buffers=buffers, model=model),
                              timeout=timeout)
        version = int(r.version)
    return version


def pull(stub, model: str, names: Iterable[str], timeout: Optional[float]
         ) -> Dict[str, torch.Tensor]:
    """PullBuffers: name -> CPU tensor in the buffer's dtype and shape (every buffer for no
    names)."""
    out: Dict[str, torch.Tensor] = {}
    for message in stub.PullBuffers(pb.PullBuffersRequest(names=list(names), model=model),
                                    timeout=timeout):
        b = message.buffer
        out[b.name] = _safetensors.tensor_of_bytes(b.data, b.dtype, b.shape)
    return out


def copy_into(pairs: Sequence[Tuple[str, torch.Tensor]], pulled: Mapping[str, torch.Tensor]
              ) -> List[str]:
    """Copies the pulled values into the local buffers of the same names, in place (to their
    device; shapes must match). Returns the names of local buffers the server did not have.

    Raises:
      ValueError: a buffer whose shape differs from the server's.
    """
    missing = []
    with torch.no_grad():
        for name, t in pairs:
            value = pulled.get(name)
            if value is None:
                missing.append(name)
                continue
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"buffer {name!r}: the server's has shape {tuple(value.shape)}, "
                                 f"the local one {tuple(t.shape)}")
            t.copy_(value)
    return missing


class ModuleBuffers:
    """The buffers a RemoteAdamW keeps on the server (RemoteAdamW(buffers=...)).

    attach() at construction: buffers the server has come into the module (a resumed run
    continues with the server's running statistics, as with its params), the others are
    written. Each step then takes a snapshot of their values once backward is done (snapshot)
    and writes it before the step's push commits (send): every checkpoint of the server then
    holds buffers and params that the module had together. The tensors are the module's at
    construction: in-place updates (BatchNorm's) are seen, a buffer replaced by another tensor
    is not.
    """

    def __init__(self, client, buffers, prefix: str):
        self._client = client
        self.pairs = named_buffers(buffers, prefix)

    def attach(self) -> None:
        if not self.pairs:
            return
        missing = copy_into(self.pairs, self._client.pull_buffers())
        if missing:
            local = dict(self.pairs)
            self._client.write_buffers([(n, local[n]) for n in missing])

    def snapshot(self) -> List[Tuple[str, torch.Tensor]]:
        """Copies of the buffers' current values on the CPU (the next forward may change the
        module's before they are sent)."""
        return [(n, t.detach().to("cpu", copy=True)) for n, t in self.pairs]

    def send(self, snapshot: Sequence[Tuple[str, torch.Tensor]]) -> None:
        if snapshot:
            self._client.write_buffers(snapshot)
