"""Where each parameter's elements live on the servers: one server, or the slices of a sharded
plan. Internal module of RemoteAdamW(overlap=True) (fusedps/_overlap.py, _pull_pipeline.py),
which moves flat runs of a step's elements and must know which server tensor each run
belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from fusedps.client import Client
from fusedps.sharded import ShardedClient

__all__ = ["Segment", "Route"]


@dataclass(frozen=True)
class Segment:
    """Elements [begin, begin + numel) of a parameter's flattened elements, which server
    ``shard`` keeps as tensor ``server_name`` (the whole tensor: begin 0)."""

    shard: int
    server_name: str
    begin: int
    numel: int


class Route:
    """The servers' clients, the plan hash, and each parameter's segments.

    Args:
      client: a Client (one server) or a ShardedClient with a plan.
      names: each parameter's server name (with the optimizer's prefix).
      numels: each parameter's element count.
    """

    def __init__(self, client: Any, names: Sequence[str], numels: Sequence[int]):
        self.segments: List[List[Segment]] = []
        if isinstance(client, ShardedClient):
            plan = client._require_plan()
            self.clients: List[Client] = list(client.clients)
            self.plan_hash = plan.hash
            for name in names:
                self.segments.append([Segment(s.shard, s.server_tensor, s.begin, s.numel)
                                      for s in plan.tensor_slices(name)])
        else:
            self.clients = [client]
            self.plan_hash = ""
            for name, numel in zip(names, numels):
                self.segments.append([Segment(0, name, 0, int(numel))])

    @property
    def shards(self) -> int:
        return len(self.clients)

    def tensors_by_shard(self, params: Sequence[int]
                         ) -> Tuple[List[List[Tuple[str, int]]], Dict[Tuple[int, int], int]]:
        """For a step of ``params`` (indices): each shard's (server name, numel) list, in the
        order given, and (param, segment number) -> index of its tensor in its shard's list."""
        by_shard: List[List[Tuple[str, int]]] = [[] for _ in self.clients]
        index: Dict[Tuple[int, int], int] = {}
        for p in params:
            for k, seg in enumerate(self.segments[p]):
                index[(p, k)] = len(by_shard[seg.shard])
                by_shard[seg.shard].append((seg.server_name, seg.numel))
        return by_shard, index
