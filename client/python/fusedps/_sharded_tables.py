"""ShardedClient's embedding tables (docs/sharding.md, "Embedding tables"): a table striped over
every shard by key, so that a lookup or a push fans out to the shards that own its keys.
Internal module: ShardedClient (fusedps/sharded.py) inherits TableShardCalls; its docstrings
are ShardedClient's documentation.

Where a key lives, for S shards (a fixed rule: every client with the same S agrees, so the
plan's hash covers it):
  * a dense-id table of ``rows`` rows: key k on shard k mod S, as row k // S there; shard s
    holds rows s, s + S, s + 2S, ... (ceil((rows - s) / S) of them) as a dense-id table;
  * a hashed table: key k on shard Mix64(k) mod S (splitmix64's finalizer of k's 64 bits, so
    that any pattern of feature ids spreads evenly), under its own key there; each shard holds
    a hashed table of ceil(capacity / S) slots with the same seed and init_std, so a row starts
    from the same values on whichever shard owns it. Eviction is per shard.

Every push names the table on every shard, with the shard's rows or none: each shard's table
advances its one step count on every push, as torch.optim.SparseAdam's single step count does.
A push is atomic on each shard, not across them (as ShardedClient's dense pushes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from fusedps._client_tables import _keys_tensor, _table_gradient
from fusedps._lazy import LazyModule
from fusedps.results import PushResult, RegisterResult

if TYPE_CHECKING:
    import numpy as np
    import torch

    from fusedps.client import Client
    from fusedps.plan import ShardPlan
else:
    np = LazyModule("numpy")
    torch = LazyModule("torch")

__all__ = ["ShardedLookedUpRows", "TableShardCalls", "owner_of_keys"]


@dataclass(frozen=True)
class ShardedLookedUpRows:
    """Rows of a sharded table read by ShardedClient.lookup_rows.

    Attributes:
      rows: a CPU tensor [n, dim] (the lookup's dtype), row i keys[i]'s, in the keys' order.
      versions: per shard, the version its rows were read at (each shard steps on its own).
      step: the table's step count (the same on every shard once their pushes are applied).
    """

    rows: "torch.Tensor"
    versions: Tuple[int, ...]
    step: int

    @property
    def version(self) -> int:
        """The lowest of versions (a lookup reads each shard at its own version)."""
        return min(self.versions)


@dataclass(frozen=True)
class _Table:
    hashed: bool
    rows: int  # Rows (dense ids) or capacity (hashed), of the whole table.
    dim: int


def _mix64(keys: "np.ndarray") -> "np.ndarray":
    """splitmix64's finalizer of each int64 key's 64 bits, as uint64 (wrapping arithmetic)."""
    z = keys.astype(np.int64).view(np.uint64).copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def owner_of_keys(keys: "torch.Tensor", shards: int, hashed: bool) -> "torch.Tensor":
    """The shard of each key (int64 tensor): k mod S (dense ids, k >= 0), Mix64(k) mod S
    (hashed keys)."""
    if not hashed:
        return torch.remainder(keys, shards)
    with np.errstate(over="ignore"):
        owner = _mix64(keys.numpy()) % np.uint64(shards)
    return torch.from_numpy(owner.astype(np.int64))


class TableShardCalls:
    """ShardedClient's embedding table calls: register_table, register_hashed_table, push_rows,
    lookup_rows."""

    if TYPE_CHECKING:  # ShardedClient's.
        clients: List["Client"]
        plan: Optional["ShardPlan"]
        _tables: Dict[str, _Table]

        def _fan_out(self, call: Callable[[int, "Client"], Any]) -> List[Any]: ...

        def _table_plan_hash(self) -> str: ...

    def register_table(self, name: str, init: "torch.Tensor", *, param_group: str = "default",
                       prefix: str = "") -> List[RegisterResult]:
        """Registers a dense-id embedding table striped over the shards (module docstring):
        shard s gets rows s, s + S, ... of ``init`` ([rows, dim]), each as Client.register_table
        registers a table. Returns each shard's RegisterResult. Raises as Client.register_table
        (ValueError for rows < S: every shard holds at least one row)."""
        full = prefix + name
        if not isinstance(init, torch.Tensor) or init.dim() != 2:
            raise ValueError(f"{full}: a table's init must be a 2-D tensor [rows, dim]")
        shards = len(self.clients)
        if init.shape[0] < shards:
            raise ValueError(f"{full}: {init.shape[0]} rows cannot stripe over {shards} shards")
        plan_hash = self._table_plan_hash()
        results = self._fan_out(lambda s, c: c.register_table(
            full, init[s::shards], param_group=param_group, plan_hash=plan_hash))
        self._tables[full] = _Table(False, int(init.shape[0]), int(init.shape[1]))
        return results

    def register_hashed_table(self, name: str, capacity: int, dim: int, *, seed: int = 0,
                              init_std: float = 1.0, param_group: str = "default",
                              prefix: str = "") -> List[RegisterResult]:
        """Registers a hashed embedding table striped over the shards (module docstring): each
        shard a hashed table of ceil(capacity / S) slots, with this seed and init_std, as
        Client.register_hashed_table registers one. Returns each shard's RegisterResult."""
        full = prefix + name
        shards = len(self.clients)
        per_shard = -(-int(capacity) // shards)
        plan_hash = self._table_plan_hash()
        results = self._fan_out(lambda s, c: c.register_hashed_table(
            full, per_shard, dim, seed=seed, init_std=init_std, param_group=param_group,
            plan_hash=plan_hash))
        self._tables[full] = _Table(True, int(capacity), int(dim))
        return results

    def _table(self, full: str) -> _Table:
        table = self._tables.get(full)
        if table is None:
            raise KeyError(f"table {full!r} was not registered through this ShardedClient "
                           f"(register_table or register_hashed_table: registering again is a "
                           f"no-op that tells it how the table is striped)")
        return table

    def _split(self, full: str, keys: "torch.Tensor") -> List["torch.Tensor"]:
        """Per shard, the indices into ``keys`` of the keys it owns, in order. ValueError for
        a dense-id key outside [0, rows)."""
        table = self._table(full)
        if not table.hashed and keys.numel():
            low, high = int(keys.min()), int(keys.max())
            if low < 0 or high >= table.rows:
                bad = low if low < 0 else high
                raise ValueError(f"{full}: key {bad} is outside [0, {table.rows})")
        owner = owner_of_keys(keys, len(self.clients), table.hashed)
        return [torch.nonzero(owner == s).reshape(-1) for s in range(len(self.clients))]

    def _local_keys(self, full: str, keys: "torch.Tensor") -> "torch.Tensor":
        """Keys as the owning shard knows them: k // S for dense ids, k for hashed keys."""
        return keys if self._table(full).hashed else torch.div(
            keys, len(self.clients), rounding_mode="floor")

    def push_rows(self, rows: Mapping[str, Any], *, grad_dtype="float32",
                  grad_scale: Optional[float] = None, prefix: str = "",
                  sequence_number: int = 0,
                  base_versions: Optional[Sequence[int]] = None) -> List[PushResult]:
        """Pushes gradient rows of sharded tables: each shard gets the rows of the keys it owns
        (none, for a shard that owns none: its table still steps, as SparseAdam's one step
        count does), as one Client.push_rows per shard, at once. ``rows`` as
        Client.push_rows' (a (keys, grads) pair or a sparse COO gradient per table); dense
        gradients go through push_gradients. ``base_versions``: per shard, the version the
        gradients were computed from (a lookup's ``versions``); None: each shard client's last
        pulled version, as Client.push_rows. Returns each shard's PushResult. Raises as
        Client.push_rows, and ValueError for a dense-id key outside [0, rows) or
        base_versions of another length than the shards (before any call), KeyError for a
        table not registered through this ShardedClient."""
        if base_versions is not None:
            base_versions = [int(v) for v in base_versions]
            if len(base_versions) != len(self.clients):
                raise ValueError(f"base_versions has {len(base_versions)} entries, not one per "
                                 f"shard ({len(self.clients)})")
        per_shard: List[Dict[str, Tuple["torch.Tensor", "torch.Tensor"]]] = [
            {} for _ in self.clients]
        for name, value in rows.items():
            full = prefix + str(name)
            keys, grads = _table_gradient(full, value)
            dim = self._table(full).dim
            grads = grads.reshape(-1, dim) if grads.numel() == 0 else grads
            local = self._local_keys(full, keys)
            for s, picked in enumerate(self._split(full, keys)):
                per_shard[s][full] = (local[picked], grads[picked.to(grads.device)])
        plan_hash = self._table_plan_hash()
        return self._fan_out(lambda s, c: c.push_rows(
            per_shard[s], grad_dtype=grad_dtype, grad_scale=grad_scale,
            sequence_number=sequence_number, plan_hash=plan_hash,
            base_version=None if base_versions is None else base_versions[s]))

    def lookup_rows(self, table: str, keys, *, dtype="float32", field: str = "param",
                    prefix: str = "") -> ShardedLookedUpRows:
        """Reads rows of a sharded table by key: each shard's keys from it, at once, put back
        in the keys' order. ``keys``, ``dtype`` and ``field`` as Client.lookup_rows'. Raises
        as Client.lookup_rows, and ValueError for a dense-id key outside [0, rows), KeyError
        for a table not registered through this ShardedClient."""
        full = prefix + table
        keys = _keys_tensor(keys, full)
        picks = self._split(full, keys)
        local = self._local_keys(full, keys)
        got = self._fan_out(lambda s, c: c.lookup_rows(full, local[picks[s]], dtype=dtype,
                                                       field=field))
        out = torch.empty(keys.numel(), self._table(full).dim, dtype=got[0].rows.dtype)
        for s, picked in enumerate(picks):
            out[picked] = got[s].rows
        steps = {g.step for g in got}
        return ShardedLookedUpRows(out, tuple(g.version for g in got), max(steps))
