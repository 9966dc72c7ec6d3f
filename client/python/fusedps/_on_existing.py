"""RemoteAdamW(on_existing=...): what construction does when the server(s) already hold some of
the model's tensors (a second run of the same script, a restarted trainer, a trainer joining a
sync job). Internal module of fusedps.torch; the choices are documented in RemoteAdamW's
docstring and docs/python.md, "Running a script again".

The check lists the tensors of every server before anything is registered or written, and
counts the model's tensors found there (on a sharded set, a tensor counts when any of its slices
is there).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Sequence, Tuple

from fusedps import errors
from fusedps.sharded import ShardedClient

# The values RemoteAdamW(on_existing=...) takes; "error" is the default.
ON_EXISTING = ("error", "resume", "replace")

# A slice of a cut tensor on a shard: "name[begin:end]" (fusedps.plan, docs/sharding.md).
_SLICE_NAME = re.compile(r"^(.*)\[\d+:\d+\]$")


def check_on_existing(value: Any) -> str:
    """``value`` when it is one of ON_EXISTING, else ValueError naming the valid ones."""
    if not isinstance(value, str) or value not in ON_EXISTING:
        raise ValueError(f"on_existing must be one of {', '.join(map(repr, ON_EXISTING))}, got "
                         f"{value!r}")
    return value


@dataclass(frozen=True)
class Existing:
    """The model's tensors that the servers hold already.

    targets, versions: each server's target and its version when listed (applied pushes).
    found: the names of the model's tensors held already, in the model's order.
    total: how many tensors the model has.
    """

    targets: Tuple[str, ...]
    versions: Tuple[int, ...]
    found: Tuple[str, ...]
    total: int
    model: str = "default"

    def where(self) -> str:
        """"the server at T (version V) holds", or the servers' list and "hold"."""
        each = [f"{t} (version {v})" for t, v in zip(self.targets, self.versions)]
        if len(each) == 1:
            return f"the server at {each[0]} holds"
        return f"the servers at {', '.join(each)} hold"


def find_existing(client: Any, names: Sequence[str]) -> Existing:
    """Lists every server's tensors (Client.list_tensors, on each shard of a ShardedClient)
    and returns which of ``names`` (server names of the model's tensors) are there.

    Raises:
      FusedPSError: from the listing (UNAVAILABLE, PERMISSION_DENIED, ...).
    """
    if isinstance(client, ShardedClient):
        listings = client._fan_out(lambda shard, c: c.list_tensors())
        targets = tuple(client.targets)
    else:
        listings = [client.list_tensors()]
        targets = (client.target,)
    held = set()
    for listing in listings:
        for info in listing:
            held.add(info.name)
            match = _SLICE_NAME.match(info.name)
            if match:
                held.add(match.group(1))
    found = tuple(n for n in names if n in held)
    model = client.clients[0].model if isinstance(client, ShardedClient) else client.model
    return Existing(targets, tuple(int(l.version) for l in listings), found, len(names),
                    model or "default")


def existing_error(existing: Existing) -> errors.AlreadyExists:
    """The error of on_existing="error": where, at which version, how many, and the choices."""
    shown = ", ".join(repr(n) for n in existing.found[:3])
    if len(existing.found) > 3:
        shown += ", ..."
    return errors.AlreadyExists(
        f"{existing.where()} {len(existing.found)} of this model's {existing.total} tensors "
        f"already ({shown}), from an earlier run or another job. "
        "RemoteAdamW(on_existing=...) says what to do: 'error' (the default) raises this; "
        "'resume' continues from the server's values and optimizer state, which are pulled "
        "into the model (a restarted trainer, a trainer joining a sync job); 'replace' deletes "
        f"the server's model {existing.model!r} (every tensor in it, its state and its "
        "checkpoints) and starts over from the local values.")


def check(client: Any, names: Sequence[str], on_existing: str, logger: logging.Logger) -> None:
    """RemoteAdamW's check, before anything is registered. The client's model is created first
    when it is not "default" (idempotent: an existing one is kept, whatever its consistency).
    Then, when the server(s) hold some of ``names``: AlreadyExists with on_existing "error";
    with "resume", logs (INFO, on ``logger``) the version it resumes from; with "replace",
    deletes the model on every server (and makes it again, empty) and logs it."""
    model = client.clients[0].model if isinstance(client, ShardedClient) else client.model
    if model not in ("", "default"):
        client.create_model(model)
    existing = find_existing(client, names)
    if not existing.found:
        return
    if on_existing == "error":
        raise existing_error(existing)
    if on_existing == "replace":
        client.delete_model(existing.model)
        if existing.model != "default":
            client.create_model(existing.model)
        logger.info("RemoteAdamW replaces: %s %d of this model's %d tensors; model %r was "
                    "deleted and starts over", existing.where(), len(existing.found),
                    existing.total, existing.model)
        return
    logger.info("RemoteAdamW resumes: %s %d of this model's %d tensors, whose values and "
                "optimizer state it continues from", existing.where(), len(existing.found),
                existing.total)
