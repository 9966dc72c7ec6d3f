"""One model over several fusedps servers: each server holds the slices the plan gives it.

The plan (fusedps.plan, docs/sharding.md) cuts tensors larger than ``slice_elements`` into
1-D slices named ``NAME[BEGIN:END]`` and spreads the slices over the servers; ShardedClient
registers each server's slices, scatters gradients into them and gathers parameters back, one
thread per server so that the servers work at the same time.

Example::

    from fusedps import ShardedClient

    with ShardedClient(["ps0:50051", "ps1:50051"], client_id="trainer-0") as ps:
        ps.register_param_group("default", lr=1e-3)
        ps.register_model(model)                # computes the plan; ps.plan.hash names it
        ...
        loss.backward()
        ps.push_gradients(model)                # one push per server, concurrently
        ps.pull_parameters(model)               # gathers the slices into model's params

Each server steps on its own: a push is atomic on each server, not across them (a non-finite
gradient in one server's slices skips that server's step only; ShardedPushResult shows each),
and a pull reads each server at its own version.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence, Tuple,
                    TypeVar, Union)

from fusedps import _dtypes
from fusedps._lazy import LazyModule
from fusedps._requests import (_FIELDS, ModelLike, _check_sendable, _named_tensors,
                               checked_group_hyperparameters, checked_states)
from fusedps._sharded_tables import ShardedLookedUpRows, TableShardCalls
from fusedps.client import Client
from fusedps.results import (ModelDeleted, ModelInfo, ParamGroup, PushResult, RegisterResult,
                             ServerInfo)
from fusedps.plan import DEFAULT_SLICE_ELEMENTS, PlanSlice, ShardPlan, make_plan

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

__all__ = ["PulledShards", "ShardedClient", "ShardedLookedUpRows", "ShardedPushResult"]

T = TypeVar("T")


@dataclass(frozen=True)
class ShardedPushResult:
    """The outcome of one sharded push.

    Attributes:
      results: per shard, its PushResult, or None for a shard that got no push (it holds
        none of the pushed tensors).
    """

    results: Tuple[Optional[PushResult], ...]

    @property
    def versions(self) -> List[Optional[int]]:
        """Each shard's version after the push (None where no push went)."""
        return [None if r is None else r.version for r in self.results]

    @property
    def step_skipped(self) -> bool:
        """True when some shard skipped its step (e.g. a non-finite gradient in its slices)."""
        return any(r is not None and r.step_skipped for r in self.results)

    @property
    def grad_bytes(self) -> int:
        """Gradient payload bytes the servers received, in all."""
        return sum(r.grad_bytes for r in self.results if r is not None)


class PulledShards(dict):
    """name -> torch.Tensor (CPU, the model tensor's shape), gathered from the shards.

    Attributes:
      versions: per shard, the version its slices were read at (None for a shard not read).
      dtype: the wire dtype name, "float32" or "bfloat16".
    """

    def __init__(self, items=(), versions: Sequence[Optional[int]] = (),
                 dtype: str = "float32"):
        super().__init__(items)
        self.versions = list(versions)
        self.dtype = dtype


class ShardedClient(TableShardCalls):
    """A connection to the S servers (shards) of one sharded model. Embedding tables are
    striped over every shard by key (fusedps/_sharded_tables.py: register_table,
    register_hashed_table, push_rows, lookup_rows).

    Args:
      targets: "host:port" of each server; shard i is targets[i].
      plan: the ShardPlan to use (its ``shards`` must equal len(targets)), or None to have
        register_model compute it from the model.
      client_id: client id of every push (the same on every shard; "" disables retry
        detection; sync mode needs one).
      client_kwargs: passed to each fusedps.Client (max_chunk_bytes, timeout, options,
        streams, transport, model, and the security options tls, tls_ca, tls_cert, tls_key,
        token, token_file, ...): the same for every shard (a model has one name on every
        shard, each shard holding its slices), so the shards share one CA and one token
        file (with --auth-tokens, ``client_id`` must be the token's principal on each).

    Methods that talk to the servers call them all at once, one thread per shard, and wait for
    all; when some fail, the error of the lowest shard index is raised (with a note naming the
    shard) after every call has ended. Use one ShardedClient from one thread at a time. Use it
    as a context manager, or call close(); calls after close() raise ValueError.

    Raises:
      ValueError: no targets, or a plan for another number of shards.
    """

    def __init__(self, targets: Sequence[str], plan: Optional[ShardPlan] = None, *,
                 client_id: str = "", **client_kwargs):
        targets = list(targets)
        if not targets:
            raise ValueError("no targets")
        if plan is not None and plan.shards != len(targets):
            raise ValueError(f"the plan has {plan.shards} shards, got {len(targets)} targets")
        self.targets = targets
        self.clients: List[Client] = []
        try:
            for target in targets:
                self.clients.append(Client(target, client_id=client_id, **client_kwargs))
        except BaseException:
            for c in self.clients:
                c.close()
            raise
        self._pool: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(
            max_workers=len(targets), thread_name_prefix="fusedps-shard")
        self.plan: Optional[ShardPlan] = None
        self._slices_of: Dict[str, List[PlanSlice]] = {}
        self._shape_of: Dict[str, Tuple[int, ...]] = {}
        self._tables: Dict = {}  # Table name -> how it is striped (_sharded_tables._Table).
        if plan is not None:
            self._set_plan(plan)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes every shard's channel. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for c in self.clients:
            c.close()

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until every shard answers (Client.wait_ready: fusedps.errors.Unavailable or
        DeadlineExceeded, naming the shard's target, if one does not)."""
        self._fan_out(lambda i, c: c.wait_ready(timeout))

    # -- param groups ---------------------------------------------------------------------------

    def register_param_group(self, name: str, **hyperparameters) -> List[ParamGroup]:
        """Registers a param group on every shard (Client.register_param_group's arguments,
        storage included: state_dtype, params_dtype, rounding_seed). Each shard applies the
        storage to its own tensors: a cut tensor's slices are tensors of their own there, so
        int8's 4096-element floor and the stochastic rounding's name key are per slice (and
        per shard's stripe of a table).

        Returns:
          Each shard's ParamGroup.
        Raises:
          ValueError: as Client.register_param_group, before any shard is called.
        """
        checked_group_hyperparameters(**hyperparameters)
        return self._fan_out(lambda i, c: c.register_param_group(name, **hyperparameters))

    def set_hyperparameters(self, group: str, **hyperparameters) -> List[ParamGroup]:
        """Changes a group's hyperparameters on every shard (Client.set_hyperparameters's
        arguments); each shard's next push uses them. Returns each shard's ParamGroup."""
        return self._fan_out(lambda i, c: c.set_hyperparameters(group, **hyperparameters))

    # -- tensors --------------------------------------------------------------------------------

    def register_model(self, model_or_named_params: ModelLike,
                       param_group: Union[str, Mapping[str, str]] = "default",
                       slice_elements: int = DEFAULT_SLICE_ELEMENTS, *,
                       prefix: str = "") -> List[Optional[RegisterResult]]:
        """Registers the model's slices, each on its shard, with their initial values.

        Args:
          model_or_named_params: an nn.Module, a mapping name -> tensor or (name, tensor)
            pairs, as for Client.register_model.
          param_group: every tensor's group, or a mapping name -> group (absent names:
            "default"). The groups must be registered (register_param_group).
          slice_elements: C, the largest slice in elements (docs/sharding.md).
          prefix: prepended to every name.

        Without a plan, computes it (``self.plan``). With one, the model must have exactly the
        plan's tensors and shapes, and each slice goes to the plan's param group (param_group
        and slice_elements are then unused). Every registration carries the plan's hash. A
        shard that holds no slice (more shards than slices) is not called.

        Returns:
          Per shard, its RegisterResult (counts over its slices), or None for a shard not called.
        Raises:
          ValueError / TypeError: as make_plan and Client.register_model; a model that does
            not match the plan. FusedPSError: as Client.register_model; FAILED_PRECONDITION
            from a shard of another plan.
        """
        items = _named_tensors(model_or_named_params, prefix)
        if not items:
            raise ValueError("no tensors to register")
        for name, t in items:
            _check_sendable(name, t)
        if self.plan is None:
            groups = ({} if isinstance(param_group, str) else dict(param_group))
            default = param_group if isinstance(param_group, str) else "default"
            entries = [(n, tuple(t.shape), groups.get(n, default)) for n, t in items]
            self._set_plan(make_plan(entries, len(self.clients), slice_elements))
        plan = self._require_plan()  # Set just above when there was none.
        tensors = dict(items)
        self._check_matches_plan({n: tuple(t.shape) for n, t in items}, exact=True)
        flat = _Flattened(tensors, plan)

        def register(shard: int, client: Client) -> Optional[RegisterResult]:
            created = existing = version = 0
            runs = _group_runs(plan.shard_slices(shard))
            for group, slices in runs:
                batch = {s.server_tensor: flat.slice(s) for s in slices}
                r = client.register_model(batch, param_group=group, plan_hash=plan.hash)
                created += r.tensors_created
                existing += r.tensors_existing
                version = r.version
            return RegisterResult(created, existing, version) if runs else None

        return self._fan_out(register)

    def push_gradients(self, model_or_dict: ModelLike, *, grad_dtype=None,
                       grad_scale: Optional[float] = None, sequence_number: int = 0,
                       base_versions: Optional[Sequence[int]] = None,
                       prefix: str = "") -> ShardedPushResult:
        """Pushes gradients: each shard gets the slices of them it holds, as one push.

        Args:
          model_or_dict: an nn.Module or (name, param) pairs (their ``.grad``; parameters
            without one are not pushed), or a mapping name -> gradient, as for
            Client.push_gradients. Gradients must have the plan's shapes.
          grad_dtype: wire dtype, as for Client.push_gradients; None: float16 when every
            gradient is float16, else bfloat16 (the same on every shard).
          grad_scale: the servers divide the gradients by it (loss scaling).
          sequence_number: of every shard's push (with the client's client_id).
          base_versions: per shard, the version the gradients were computed from; None: the
            version of that shard's last pull_parameters.
          prefix: prepended to the names taken from the model.

        A shard that holds none of the pushed tensors gets no push. Sync mode needs every
        tensor of a shard in its push, so push the whole model there.

        Returns:
          ShardedPushResult: each shard's PushResult (or None).
        Raises:
          RuntimeError: no plan yet (register_model first, or give one). KeyError: a tensor
            the plan does not have. ValueError: no gradients, a gradient of another shape,
            base_versions of another length, as Client.push_gradients.
          FusedPSError: as Client.push_gradients, from any shard.
        """
        plan = self._require_plan()
        if grad_dtype is not None:
            grad_dtype = _dtypes.wire_dtype(grad_dtype, "grad_dtype")
        grads = {}
        for name, t in _named_tensors(model_or_dict, prefix):
            g = t if isinstance(model_or_dict, Mapping) and not isinstance(
                t, torch.nn.Parameter) else t.grad
            if g is not None:
                _check_sendable(name, g)
                grads[name] = g
        if not grads:
            raise ValueError("no gradients to push (no parameter has .grad)")
        self._check_matches_plan({n: tuple(g.shape) for n, g in grads.items()}, exact=False)
        if base_versions is not None:
            base_versions = [int(v) for v in base_versions]
            if len(base_versions) != plan.shards:
                raise ValueError(f"base_versions has {len(base_versions)} entries, the plan "
                                 f"{plan.shards} shards")
        if grad_dtype is None:
            all_fp16 = all(g.dtype == torch.float16 for g in grads.values())
            grad_dtype = "float16" if all_fp16 else "bfloat16"
        flat = _Flattened(grads, plan)

        def push(shard: int, client: Client) -> Optional[PushResult]:
            batch = {s.server_tensor: flat.slice(s) for s in plan.shard_slices(shard)
                     if s.tensor in grads}
            if not batch:
                return None
            return client.push_gradients(
                batch, grad_dtype=grad_dtype, grad_scale=grad_scale,
                sequence_number=sequence_number, plan_hash=plan.hash,
                base_version=None if base_versions is None else base_versions[shard])

        return ShardedPushResult(tuple(self._fan_out(push)))

    def pull_parameters(self, model_or_names=None, dtype="float32", *,
                        prefix: str = "") -> PulledShards:
        """Pulls parameters from the shards and gathers the slices into whole tensors.

        Args:
          model_or_names: an nn.Module, a mapping name -> tensor or (name, tensor) pairs: those
            tensors are pulled and copied into in place (as Client.pull_parameters does);
            a list of names or one name: those are returned only; None: every tensor of the
            plan. Only the shards holding a slice of them are read.
          dtype: "float32" or "bfloat16" (or "fp32", "bf16", a torch dtype).
          prefix: prepended to the names taken from a module/mapping/pairs.

        Each shard read sets the base_version of that shard's next push.

        Returns:
          PulledShards: name -> CPU tensor (torch.float32 or torch.bfloat16), model shapes,
          in the order asked for (the plan's for None), with ``.versions`` per shard.
        Raises:
          RuntimeError: no plan yet. KeyError: a name the plan does not have. ValueError: a
            local tensor of another shape. FusedPSError: as Client.pull_parameters.
        """
        plan = self._require_plan()
        dtype = _dtypes.wire_dtype(dtype, "dtype", _dtypes.PULL_DTYPES)
        targets, names = Client._targets_and_names(model_or_names, prefix)
        if model_or_names is None:
            names = [t.name for t in plan.tensors]
        for name in names:
            if name not in self._slices_of:
                raise KeyError(f"no tensor named {name!r} in the plan")
        if targets:
            self._check_matches_plan({n: tuple(t.shape) for n, t in targets}, exact=False)
        wanted = set(names)

        def pull(shard: int, client: Client):
            server_names = [s.server_tensor for s in plan.shard_slices(shard)
                            if s.tensor in wanted]
            return client.pull_parameters(server_names, dtype) if server_names else None

        pulled = self._fan_out(pull)
        out = PulledShards(versions=[None if p is None else p.version for p in pulled],
                           dtype=next((p.dtype for p in pulled if p is not None), dtype))
        for name in names:
            out[name] = self._gather(name, pulled)
        if targets:
            with torch.no_grad():
                for name, t in targets:
                    t.copy_(out[name])
        return out

    def pull_state(self, field: str = "exp_avg", names=None, *, prefix: str = ""
                   ) -> Tuple[Dict[str, "torch.Tensor"], List[Optional[int]], Dict[str, int]]:
        """Reads one stored array per tensor as fp32, gathered from the shards that hold its
        slices, as Client.pull_state does on one server.

        Args:
          field: "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (amsgrad groups only) or "param".
          names: names, one name, a module/mapping/pairs (their names, with ``prefix``), or
            None for every tensor of the plan. Only the shards holding a slice of them are read.

        Returns:
          (tensors, versions, steps): name -> torch.float32 CPU tensor with the model's shape,
          in the order asked for; per shard, the version it was read at (None for a shard not
          read); name -> steps applied (of a cut tensor: those of its first slice). Each shard
          is read at its own version.
        Raises:
          RuntimeError: no plan yet. KeyError: a name the plan does not have. ValueError:
            unknown field. FusedPSError: as Client.pull_state.
        """
        plan = self._require_plan()
        if field not in _FIELDS:
            raise ValueError(f"field must be one of {sorted(_FIELDS)}, got {field!r}")
        if names is None:
            names = [t.name for t in plan.tensors]
        else:
            _, names = Client._targets_and_names(names, prefix)
        for name in names:
            if name not in self._slices_of:
                raise KeyError(f"no tensor named {name!r} in the plan")
        wanted = set(names)

        def pull(shard: int, c: Client):
            server_names = [s.server_tensor for s in plan.shard_slices(shard)
                            if s.tensor in wanted]
            if not server_names:
                return None
            return c.pull_state(field, server_names)

        pulled = self._fan_out(pull)
        tensors_of = [None if p is None else p[0] for p in pulled]
        out = {n: self._gather(n, tensors_of) for n in names}
        steps = {}
        for n in names:
            first = self._slices_of[n][0]
            steps[n] = pulled[first.shard][2][first.server_tensor]
        return out, [None if p is None else p[1] for p in pulled], steps

    def load_state(self, states: Mapping[str, Mapping[str, "torch.Tensor"]],
                   steps: Mapping[str, int]) -> List[Optional[int]]:
        """Overwrites whole tensors' params, AdamW state and steps on the shards that hold
        their slices, as Client.load_state does on one server.

        Args:
          states: name -> {field: tensor}, with the plan's names and FULL shapes; each shard
            gets its slices' elements. Fields and dtypes as for Client.load_state.
          steps: name -> the tensor's step afterwards; every slice of a tensor gets it. Every
            name of states must be in steps, and every name of steps in states.

        Everything is checked on the client before any shard is called. Then the shards are
        loaded one after another, in shard order, each with the plan's hash. Each shard's load
        is all or nothing, but the whole is NOT atomic across shards: when a shard fails, the
        shards before it have been loaded and those after it have not (the error's note names
        the shard); load again to finish.

        Returns:
          Per shard, its version after the load, or None for a shard that holds none of the
          tensors (it is not called).
        Raises:
          RuntimeError: no plan yet (register_model first, or give one). KeyError: a tensor
            the plan does not have. ValueError: a shape other than the plan's; as
            Client.load_state. TypeError: as Client.load_state.
          fusedps.errors.FusedPSError: as Client.load_state, from the first shard that fails.
        """
        plan = self._require_plan()
        if self._pool is None:
            raise ValueError("the ShardedClient is closed")
        checked_states(states, steps)
        for name, fields in states.items():
            for t in fields.values():
                self._check_matches_plan({name: tuple(t.shape)}, exact=False)
        flat = {field: _Flattened({n: f[field] for n, f in states.items() if field in f}, plan)
                for field in _FIELDS}
        versions: List[Optional[int]] = []
        for shard, client in enumerate(self.clients):
            slices = [s for s in plan.shard_slices(shard) if s.tensor in states]
            if not slices:
                versions.append(None)
                continue
            shard_states = {s.server_tensor: {f: flat[f].slice(s) for f in states[s.tensor]}
                            for s in slices}
            shard_steps = {s.server_tensor: steps[s.tensor] for s in slices}
            try:
                versions.append(client.load_state(shard_states, shard_steps, plan_hash=plan.hash))
            except Exception as e:
                if hasattr(e, "add_note"):
                    e.add_note(f"fusedps: from shard {shard} ({self.targets[shard]}); the shards "
                               "before it were loaded, those after it were not")
                raise
        return versions

    # -- facts ----------------------------------------------------------------------------------

    def write_buffers(self, buffers, *, prefix: str = "") -> int:
        """Client.write_buffers on the first shard, which keeps every buffer of the model
        (buffers are small and not cut); its checkpoints hold them. Returns its version."""
        return self.clients[0].write_buffers(buffers, prefix=prefix)

    def pull_buffers(self, buffers=None, *, prefix: str = "") -> Dict[str, "torch.Tensor"]:
        """Client.pull_buffers from the first shard (see write_buffers)."""
        return self.clients[0].pull_buffers(buffers, prefix=prefix)

    def info(self) -> List[ServerInfo]:
        """Each shard's ServerInfo (version, consistency, plan_hash, ...)."""
        return self._fan_out(lambda i, c: c.info())

    def server_infos(self) -> List[ServerInfo]:
        """Each shard's ServerInfo, as info(): the name Client.server_infos shares
        (fusedps.ParameterServiceClient)."""
        return self.info()

    def versions(self) -> List[int]:
        """Each shard's current version."""
        return [i.version for i in self.info()]

    # -- models ---------------------------------------------------------------------------------

    def create_model(self, name: str, **consistency) -> List[Tuple[bool, ModelInfo]]:
        """Client.create_model on every shard: (created, ModelInfo) of each."""
        return self._fan_out(lambda i, c: c.create_model(name, **consistency))

    def list_models(self) -> List[List[ModelInfo]]:
        """Client.list_models of each shard."""
        return self._fan_out(lambda i, c: c.list_models())

    def delete_model(self, name: str, timeout: Optional[float] = 60.0) -> List[ModelDeleted]:
        """Client.delete_model on every shard (each is tried; the lowest shard's error is
        raised after all have ended)."""
        return self._fan_out(lambda i, c: c.delete_model(name, timeout))

    # -- internals ------------------------------------------------------------------------------

    def _set_plan(self, plan: ShardPlan) -> None:
        self.plan = plan
        self._slices_of = {}
        self._shape_of = {t.name: t.shape for t in plan.tensors}
        for s in plan.slices:
            self._slices_of.setdefault(s.tensor, []).append(s)

    def _table_plan_hash(self) -> str:
        """The plan hash tables are registered and pushed with: the model's plan's, or, for a
        ShardedClient of tables alone, the empty plan's over these shards (register the model
        first when there is one: a shard keeps the first plan it is registered with)."""
        plan = self.plan if self.plan is not None else make_plan([], len(self.clients))
        return plan.hash

    def _require_plan(self) -> ShardPlan:
        if self.plan is None:
            raise RuntimeError("no plan: call register_model first, or pass a plan")
        return self.plan

    def _check_matches_plan(self, shapes: Mapping[str, Tuple[int, ...]], exact: bool) -> None:
        """Raises KeyError for a name the plan lacks, ValueError for another shape or (exact)
        for plan tensors missing from ``shapes``."""
        planned = self._shape_of
        for name, shape in shapes.items():
            if name not in planned:
                raise KeyError(f"no tensor named {name!r} in the plan")
            if shape != planned[name]:
                raise ValueError(f"{name}: shape {shape} != the plan's {planned[name]}")
        missing = [n for n in planned if n not in shapes]
        if exact and missing:
            raise ValueError(f"{len(missing)} tensors of the plan are missing, e.g. "
                             f"{missing[0]!r}")

    def _gather(self, name: str, pulled) -> torch.Tensor:
        slices = self._slices_of[name]
        if len(slices) == 1:  # The whole tensor, with its shape.
            return pulled[slices[0].shard][slices[0].server_tensor]
        first = pulled[slices[0].shard][slices[0].server_tensor]
        flat = torch.empty(slices[-1].end, dtype=first.dtype)
        for s in slices:
            flat[s.begin:s.end] = pulled[s.shard][s.server_tensor].reshape(-1)
        return flat.reshape(self._shape_of[name])

    def _fan_out(self, call: Callable[[int, Client], T]) -> List[T]:
        """call(shard, client) for every shard at once; the results in shard order."""
        if self._pool is None:
            raise ValueError("the ShardedClient is closed")
        futures = [self._pool.submit(call, i, c) for i, c in enumerate(self.clients)]
        errors = [f.exception() for f in futures]  # Waits for every call.
        for i, e in enumerate(errors):
            if e is not None:
                if hasattr(e, "add_note"):
                    e.add_note(f"fusedps: from shard {i} ({self.targets[i]})")
                raise e
        return [f.result() for f in futures]


class _Flattened:
    """The slices of named tensors: a whole tensor as it is, a part as a 1-D view of its
    flattened elements. Each cut tensor is flattened once, up front (a copy only when it is
    not contiguous), so that the shards' threads only read."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], plan: ShardPlan):
        self._tensors = {n: t.detach() for n, t in tensors.items()}
        self._flat = {s.tensor: self._tensors[s.tensor].reshape(-1) for s in plan.slices
                      if s.server_tensor != s.tensor and s.tensor in self._tensors}

    def slice(self, s: PlanSlice) -> torch.Tensor:
        if s.server_tensor == s.tensor:
            return self._tensors[s.tensor]
        return self._flat[s.tensor][s.begin:s.end]


def _group_runs(slices: Sequence[PlanSlice]) -> List[Tuple[str, List[PlanSlice]]]:
    """Consecutive slices of one param group, as (group, slices), keeping the order."""
    runs: List[Tuple[str, List[PlanSlice]]] = []
    for s in slices:
        if runs and runs[-1][0] == s.param_group:
            runs[-1][1].append(s)
        else:
            runs.append((s.param_group, [s]))
    return runs
