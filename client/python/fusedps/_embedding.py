"""fusedps.torch's embedding tables: RemoteEmbedding and RemoteEmbeddingBag, drop-ins for
torch.nn.Embedding(sparse=True) and torch.nn.EmbeddingBag(sparse=True) whose weight is an
embedding table on a fusedps server (docs/api.md, "Embedding tables"), and RemoteSparseAdam,
the optimizer that steps their rows there, as torch.optim.SparseAdam steps a local one.

A step goes:
1. forward: the batch's unique keys (torch.unique, with the inverse indices), their rows
   looked up on the server in one call (Client.lookup_rows) into a [u, dim] leaf tensor on the
   module's device; the output is torch.nn.functional.embedding (embedding_bag) of the inverse
   indices into it: the local module's values.
2. backward: autograd sums each key's gradient into its leaf row, as a sparse gradient's
   coalesce() would.
3. RemoteSparseAdam.step(): the leaves of every forward since the last step that have a
   gradient go to their server in one push per client (Client.push_rows: every table of the
   client, keys and rows; the server sums duplicate keys), where torch.optim.SparseAdam's math
   updates the pushed rows only. The push's base_version is the version its rows were looked
   up at (the oldest of the step's lookups): what bounded mode measures staleness against and
   sync mode puts the push in the round of. The next forward's lookup reads the new rows.

The dense rest of the model trains beside it with RemoteAdamW (or any optimizer): the two steps
are two pushes, each atomic on its own. In sync mode that is two pushes of one trainer to a
round, which the round refuses if they share a client_id and averages wrongly if they do not;
there a model with tables and dense tensors pushes both in one Client.push_rows call (``dense=``)
until RemoteAdamW carries the rows itself.

Lifetimes: a module keeps the leaves of its forwards (with grad enabled) until the optimizer's
step or zero_grad; a module made from a target owns its client (close() closes it).
Thread safety: none; one training thread, as torch's modules and optimizers.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from fusedps import errors
from fusedps.client import Client

__all__ = ["RemoteEmbedding", "RemoteEmbeddingBag", "RemoteSparseAdam", "remote_tables"]

# torch.optim.SparseAdam's defaults.
SPARSE_ADAM_LR = 1e-3
SPARSE_ADAM_BETAS = (0.9, 0.999)
SPARSE_ADAM_EPS = 1e-8


class _RemoteTable(torch.nn.Module):
    """What RemoteEmbedding and RemoteEmbeddingBag share: the table on the server, the lookup of
    a batch's rows, and the leaves waiting for RemoteSparseAdam."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str,
                 target: Optional[str], client: Optional[Client],
                 client_options: Optional[Mapping[str, Any]], param_group: Optional[str],
                 _weight: Optional[torch.Tensor], device: Any):
        super().__init__()
        if (target is None) == (client is None):
            raise ValueError("give exactly one of target= and client=")
        if int(num_embeddings) < 1 or int(embedding_dim) < 1:
            raise ValueError(f"num_embeddings ({num_embeddings}) and embedding_dim "
                             f"({embedding_dim}) must be >= 1")
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.name = name
        self.param_group = name if param_group is None else param_group
        self._owns_client = client is None
        if client is None:
            client = Client(str(target), **dict(client_options or {}))
        self.client = client
        self.device = torch.device("cpu") if device is None else torch.device(device)
        if _weight is None:  # torch.nn.Embedding's initialization: N(0, 1).
            _weight = torch.empty(self.num_embeddings, self.embedding_dim).normal_()
        elif tuple(_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"_weight has shape {tuple(_weight.shape)}, not "
                             f"({self.num_embeddings}, {self.embedding_dim})")
        try:  # The table's own group, SparseAdam's defaults until RemoteSparseAdam sets its own.
            self.client.register_param_group(self.param_group, lr=SPARSE_ADAM_LR,
                                              betas=SPARSE_ADAM_BETAS, eps=SPARSE_ADAM_EPS,
                                              weight_decay=0.0)
        except errors.AlreadyExists:
            pass  # Made before, with other values (an earlier run's): the optimizer sets them.
        self.client.register_table(name, _weight.detach(), param_group=self.param_group)
        # (keys [u] int64 on the CPU, rows [u, dim] leaf, the versions they were read at: one,
        # or one per shard through a ShardedClient) of each forward since the last step.
        self._pending: List[Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]] = []

    def _lookup(self, input: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inverse indices, shaped as input, into rows; rows [u, dim]: the batch's unique
        keys' rows, a leaf that keeps its gradient for the next step when grad is enabled)."""
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"indices must be int64 or int32, got {input.dtype}")
        keys, inverse = torch.unique(input, return_inverse=True)
        keys = keys.to(torch.int64).cpu()
        looked_up = self.client.lookup_rows(self.name, keys)
        rows = looked_up.rows.to(self.device)
        if torch.is_grad_enabled() and self.training:
            rows.requires_grad_(True)
            versions = tuple(getattr(looked_up, "versions", (looked_up.version,)))
            self._pending.append((keys, rows, versions))
        return inverse.to(self.device), rows

    def take_rows(self) -> Optional[Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]]:
        """The keys and gradient rows of every forward since the last call that got a gradient,
        concatenated (keys may repeat: the server sums them), and the oldest versions they were
        looked up at (per shard); or None. Forgets them all."""
        pending, self._pending = self._pending, []
        used = [(k, rows, versions) for k, rows, versions in pending if rows.grad is not None]
        if not used:
            return None
        return (torch.cat([k for k, _, _ in used]),
                torch.cat([rows.grad.detach().float().cpu() for _, rows, _ in used]),
                _oldest([versions for _, _, versions in used]))

    def forget_rows(self) -> None:
        """Drops the forwards' leaves (RemoteSparseAdam.zero_grad)."""
        self._pending = []

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, name={self.name!r}"


class RemoteEmbedding(_RemoteTable):
    """torch.nn.Embedding(num_embeddings, embedding_dim, sparse=True) whose weight is the
    embedding table ``name`` on a fusedps server (registered here; an identical one registered
    before is kept as it is).

    Args:
      num_embeddings, embedding_dim: the table's shape [rows, dim].
      name: the table's name on the server.
      target: "host:port" of the server (this module then owns its client), or
      client: a fusedps.Client to use (give exactly one).
      client_options: keyword arguments of fusedps.Client, with target.
      param_group: the table's group on the server (created with SparseAdam's defaults, no
        weight decay); default: the table's name.
      _weight: initial values [num_embeddings, embedding_dim]; default N(0, 1), drawn from
        torch's generator as torch.nn.Embedding draws them.
      device: where forward's output goes (the rows are looked up to host memory, then copied).
    forward(input): input int64 or int32 indices of any shape; returns input.shape + (dim,),
      float32. Keys outside [0, num_embeddings) raise fusedps.errors.InvalidArgument naming one.
    Not supported (ValueError): padding_idx, max_norm, scale_grad_by_freq, dense gradients.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str,
                 target: Optional[str] = None, client: Optional[Client] = None,
                 client_options: Optional[Mapping[str, Any]] = None,
                 param_group: Optional[str] = None, _weight: Optional[torch.Tensor] = None,
                 device: Any = None, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, scale_grad_by_freq: bool = False,
                 sparse: bool = True):
        _unsupported(padding_idx=padding_idx, max_norm=max_norm,
                     scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        super().__init__(num_embeddings, embedding_dim, name=name, target=target, client=client,
                         client_options=client_options, param_group=param_group,
                         _weight=_weight, device=device)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        inverse, rows = self._lookup(input)
        return torch.nn.functional.embedding(inverse, rows)


class RemoteEmbeddingBag(_RemoteTable):
    """torch.nn.EmbeddingBag(num_embeddings, embedding_dim, mode=..., sparse=True) whose weight is
    the embedding table ``name`` on a fusedps server. Arguments as RemoteEmbedding's, and mode
    ("sum" or "mean": torch's sparse gradients have no "max") and include_last_offset as
    torch's.
    forward(input, offsets=None, per_sample_weights=None): as torch.nn.EmbeddingBag's (a 1-D
      input with offsets, or a 2-D input of fixed-size bags); returns [bags, dim], float32.
    Not supported (ValueError): padding_idx, max_norm, scale_grad_by_freq, dense gradients.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str,
                 mode: str = "mean", target: Optional[str] = None,
                 client: Optional[Client] = None,
                 client_options: Optional[Mapping[str, Any]] = None,
                 param_group: Optional[str] = None, _weight: Optional[torch.Tensor] = None,
                 device: Any = None, include_last_offset: bool = False,
                 padding_idx: Optional[int] = None, max_norm: Optional[float] = None,
                 scale_grad_by_freq: bool = False, sparse: bool = True):
        _unsupported(padding_idx=padding_idx, max_norm=max_norm,
                     scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        if mode not in ("sum", "mean"):  # torch refuses "max" with sparse gradients too.
            raise ValueError(f"mode must be 'sum' or 'mean' (as torch.nn.EmbeddingBag's with "
                             f"sparse=True), got {mode!r}")
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)
        super().__init__(num_embeddings, embedding_dim, name=name, target=target, client=client,
                         client_options=client_options, param_group=param_group,
                         _weight=_weight, device=device)

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        inverse, rows = self._lookup(input)
        if offsets is not None:
            offsets = offsets.to(self.device)
        return torch.nn.functional.embedding_bag(
            inverse, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"


def _unsupported(*, padding_idx, max_norm, scale_grad_by_freq, sparse) -> None:
    if padding_idx is not None or max_norm is not None or scale_grad_by_freq or not sparse:
        raise ValueError("padding_idx, max_norm, scale_grad_by_freq and sparse=False are not "
                         "supported by a remote embedding table")


class RemoteSparseAdam(torch.optim.Optimizer):
    """torch.optim.SparseAdam for RemoteEmbedding and RemoteEmbeddingBag modules: step() pushes
    the rows each module's forwards since the last step looked up and got a gradient for, and
    the table's server applies SparseAdam's step to them (kernels/sparse_adam_math.h: torch's
    op order; one step count per table, advanced by each step that pushes rows of it).

    Args:
      modules: the remote embedding modules it steps.
      lr, betas, eps: as torch.optim.SparseAdam's (the defaults too); a scheduler may change
        lr: each step sends a changed value to the tables' groups first.
      weight_decay: decoupled, of the pushed rows only (SparseAdam has none); default 0.
    The optimizer keeps no state of its own (it is on the servers); state_dict() holds the
    hyperparameters. step() makes one push per client, of all its tables, based on the version
    their rows were looked up at. After step(), last_push_results has the pushes' results
    (fusedps PushResult) by table name (the tables of one client share theirs).
    Raises: fusedps.errors.FusedPSError from the servers (INVALID_ARGUMENT for a key outside a
    table's rows: nothing of that push is applied).
    """

    def __init__(self, modules: Iterable[_RemoteTable], lr: float = SPARSE_ADAM_LR,
                 betas=SPARSE_ADAM_BETAS, eps: float = SPARSE_ADAM_EPS,
                 weight_decay: float = 0.0):
        self.modules = list(modules)
        if not self.modules or not all(isinstance(m, _RemoteTable) for m in self.modules):
            raise ValueError("RemoteSparseAdam takes RemoteEmbedding and RemoteEmbeddingBag "
                             "modules (at least one)")
        # One placeholder tensor per module: torch's optimizers hold tensors, and schedulers
        # read and write param_groups.
        self._placeholders = [torch.zeros(0) for _ in self.modules]
        super().__init__(self._placeholders, dict(lr=lr, betas=tuple(betas), eps=eps,
                                                  weight_decay=weight_decay))
        self._sent: Dict[int, Tuple] = {}  # id(module) -> the hyperparameters its group has.
        self.last_push_results: Dict[str, Any] = {}

    def _hyperparameters(self) -> Tuple:
        g = self.param_groups[0]
        beta1, beta2 = g["betas"]
        return (float(g["lr"]), float(beta1), float(beta2), float(g["eps"]),
                float(g["weight_decay"]))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hyper = self._hyperparameters()
        # Per client (by identity, in module order): its modules' rows, pushed together.
        by_client: Dict[int, List[Tuple[_RemoteTable, Tuple]]] = {}
        for module in self.modules:
            taken = module.take_rows()
            if taken is None:
                continue  # No gradient: no step, as SparseAdam skips a param without one.
            if self._sent.get(id(module)) != hyper:
                lr, beta1, beta2, eps, weight_decay = hyper
                module.client.set_hyperparameters(module.param_group, lr=lr,
                                                  betas=(beta1, beta2), eps=eps,
                                                  weight_decay=weight_decay)
                self._sent[id(module)] = hyper
            by_client.setdefault(id(module.client), []).append((module, taken))
        results: Dict[str, Any] = {}
        for taken_rows in by_client.values():
            client = taken_rows[0][0].client
            rows = {module.name: (keys, grads) for module, (keys, grads, _) in taken_rows}
            base = _oldest([versions for _, (_, _, versions) in taken_rows])
            if isinstance(client, Client):
                result = client.push_rows(rows, base_version=base[0])
            else:  # A ShardedClient: a version per shard.
                result = client.push_rows(rows, base_versions=base)
            results.update({name: result for name in rows})
        self.last_push_results = results
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops what the forwards since the last step left to push."""
        for module in self.modules:
            module.forget_rows()


def _oldest(versions: List[Tuple[int, ...]]) -> Tuple[int, ...]:
    """Per shard, the oldest of several lookups' versions."""
    return tuple(min(v) for v in zip(*versions))


def remote_tables(model: torch.nn.Module) -> List[_RemoteTable]:
    """The RemoteEmbedding and RemoteEmbeddingBag modules of a model, in module order."""
    return [m for m in model.modules() if isinstance(m, _RemoteTable)]

