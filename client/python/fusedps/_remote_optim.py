"""Helpers of fusedps.torch.RemoteAdamW: named param groups, hyperparameters, the GradScaler
contract, torch.optim.AdamW's state_dict format, and state reads and writes on one server or
a sharded set. Internal module; see fusedps/torch.py for the public behaviour.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import torch

from fusedps import _dtypes
from fusedps import _hyperparameters as _hp
from fusedps._protocol import ParameterServiceClient
from fusedps._requests import checked_rounding_seed, storage_name
from fusedps.client import Client
from fusedps.sharded import ShardedClient

# torch.optim.AdamW arguments that pick an implementation; the server is the implementation, so
# only their off values are accepted, and a loaded state_dict's values are not taken.
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")

# Per-group hyperparameters the server keeps and set_hyperparameters can change at run time.
# The hyperparameters of a torch param group that the server takes and a loop may change during
# training: fusedps._hyperparameters.NAMES but amsgrad, the decay's kind and the storage (fixed
# at registration): lr, betas, eps, weight_decay, maximize.
MUTABLE = tuple(n for n in _hp.NAMES
                if n not in ("amsgrad", "decoupled_weight_decay") + _hp.STORAGE)
HyperTuple = Tuple[Tuple[str, Any], ...]  # (name, value) of each of MUTABLE a group has

STATE_FIELDS = ("exp_avg", "exp_avg_sq")
AMSGRAD_FIELD = "max_exp_avg_sq"

# A group's storage on the server, fixed at registration: taken from the group's dict or the
# optimizer's arguments, never from a loaded state_dict (the server converts loaded values).
STORAGE_KEYS = ("state_dtype", "params_dtype", "rounding_seed")


@dataclass(frozen=True)
class Storage:
    """How the server stores a param group: state_dtype "fp32" | "bf16" | "int8",
    params_dtype "fp32" | "bf16", and the seed of bf16 params' stochastic rounding."""

    state_dtype: str = "fp32"
    params_dtype: str = "fp32"
    rounding_seed: int = 0


def group_storage(group: Mapping[str, Any], default: Storage, where: str) -> Storage:
    """The Storage of a param group: its own STORAGE_KEYS over ``default``.

    Raises:
      ValueError: a value register_param_group does not take (naming the key and ``where``),
        or amsgrad with a state_dtype other than fp32.
    """
    try:
        state, params = (storage_name(group.get(key, getattr(default, key)), key) or "fp32"
                         for key in ("state_dtype", "params_dtype"))
        storage = Storage(state, params, checked_rounding_seed(
            group.get("rounding_seed", default.rounding_seed)) or 0)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if group.get("amsgrad") and storage.state_dtype != "fp32":
        raise ValueError(f"{where}: state_dtype={storage.state_dtype!r} with amsgrad=True: "
                         "amsgrad needs state_dtype 'fp32'")
    return storage


def check_server_storage(name: str, server: Any, ours: Storage) -> None:
    """ValueError when a server param group (a ParamGroup) that exists already stores its
    tensors otherwise than ``ours`` asks (fields it does not report are not compared)."""
    for key in STORAGE_KEYS:
        theirs = getattr(server, key, None)
        if theirs is not None and theirs != getattr(ours, key):
            raise ValueError(f"the server's param group {name!r} has {key}={theirs!r}; this "
                             f"optimizer's has {key}={getattr(ours, key)!r} (fixed at "
                             "registration: use another group name or a fresh server)")


# ----------------------------------------------------------------------------------------------
# Named parameters and groups
# ----------------------------------------------------------------------------------------------

def _named_pairs(params: Any, where: str) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a mapping or an iterable of pairs; TypeError for anything
    else (a bare tensor has no name, and the server keys everything by name)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{where}: RemoteAdamW needs named parameters, e.g. "
                        "model.named_parameters(), got a bare tensor")
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    out = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"{where}: RemoteAdamW needs (name, parameter) pairs, e.g. "
                            f"model.named_parameters(), got {type(item).__name__} "
                            f"{str(item)[:60]!r}")
        out.append(item)
    return out


def named_param_groups(params: Any) -> List[Dict[str, Any]]:
    """The param groups of ``params`` as dicts whose "params" is a list of (name, tensor).

    Accepts (name, param) pairs (model.named_parameters()), a mapping name -> param, or a list
    of dicts whose "params" is either of those (or tensors with a "param_names" list beside
    them, as torch >= 2.6 stores them). Other keys of a dict are kept.

    Raises:
      TypeError: unnamed tensors or other objects. ValueError: no groups, an empty group,
        params and param_names of different lengths.
    """
    items = params if isinstance(params, (list, tuple)) else list(
        params.items() if isinstance(params, Mapping) else params)
    if not items:
        raise ValueError("RemoteAdamW got an empty parameter list")
    if not all(isinstance(g, Mapping) for g in items):
        if any(isinstance(g, Mapping) for g in items):
            raise TypeError("RemoteAdamW: mix of param-group dicts and parameters")
        items = [{"params": items}]
    groups = []
    for i, g in enumerate(items):
        group = dict(g)
        if "params" not in group:
            raise ValueError(f"param group {i} has no 'params'")
        raw = group["params"]
        names = group.pop("param_names", None)
        if names is not None:
            tensors = [raw] if isinstance(raw, torch.Tensor) else list(raw)
            if len(tensors) != len(names) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"param group {i}: 'param_names' must name each param")
            pairs = list(zip(names, tensors))
        else:
            pairs = _named_pairs(raw, f"param group {i}")
        if not pairs:
            raise ValueError(f"param group {i} has no parameters")
        group["params"] = pairs
        groups.append(group)
    return groups


def check_implementation_flags(values: Mapping[str, Any], where: str) -> None:
    """ValueError for foreach/fused/capturable/differentiable set to True (the server runs the
    step; None and False are accepted)."""
    for key in IMPLEMENTATION_KEYS:
        if values.get(key):
            raise ValueError(f"{where}: {key}=True is not supported: the fusedps server runs "
                             "the AdamW step (pass None or False)")


@dataclass(frozen=True)
class TorchAdamWFacts:
    """What this torch version's torch.optim.AdamW records: its defaults (every group key, in
    its order, with values) and whether groups made from (name, param) pairs keep
    "param_names" (torch >= 2.6)."""

    defaults: Dict[str, Any]
    keeps_param_names: bool


def torch_adamw_facts(**hyperparameters) -> TorchAdamWFacts:
    """Builds a real torch.optim.AdamW over a dummy parameter with ``hyperparameters``: it
    validates them as torch does (ValueError) and tells this version's group keys."""
    dummy = torch.nn.Parameter(torch.zeros(1))
    try:
        ref = torch.optim.AdamW([("dummy", dummy)], **hyperparameters)
        keeps_names = "param_names" in ref.param_groups[0]
    except TypeError:  # torch < 2.6: parameters must be tensors
        ref = torch.optim.AdamW([dummy], **hyperparameters)
        keeps_names = False
    return TorchAdamWFacts(dict(ref.defaults), keeps_names)


def hyperparameters_of(group: Mapping[str, Any]) -> HyperTuple:
    """((name, value), ...) of the MUTABLE hyperparameters of a torch param group, as Python
    numbers (lr and betas may be tensors, as torch >= 2.2 allows and some schedulers store).
    TypeError or ValueError for a value that is no number."""
    return tuple((name, _hp.as_python(name, group[name])) for name in MUTABLE if name in group)


def hyperparameter_kwargs(h: HyperTuple) -> Dict[str, Any]:
    """Client.set_hyperparameters / register_param_group keywords of a HyperTuple."""
    return dict(h)


# ----------------------------------------------------------------------------------------------
# Clients and timings
# ----------------------------------------------------------------------------------------------

def wire_dtype(value: Any, argument: str, or_none: bool = False) -> str:
    """RemoteAdamW's grad_dtype or pull_dtype as a wire dtype name, "float32" or "bfloat16"
    (given in any spelling fusedps._dtypes takes: "fp32", "bf16", torch dtypes).

    Raises:
      ValueError: another value, naming ``argument`` and the values it takes (None too with
        ``or_none``: the caller handles None).
    """
    return _dtypes.wire_dtype(value, argument, _dtypes.PULL_DTYPES,
                              or_else="None" if or_none else "")


def new_timings() -> Dict[str, float]:
    """RemoteAdamW.last_step_timings with nothing done."""
    return {"push_seconds": 0.0, "pull_seconds": 0.0, "hyperparameters_seconds": 0.0,
            "load_state_seconds": 0.0, "buffers_seconds": 0.0}


# RemoteAdamW's data_plane values (fusedps._overlap, fusedps._workspace).
DATA_PLANES = ("auto", "device", "workspace", "grpc")


def stored_wire_dtype(storage: Sequence[Storage]) -> Optional[str]:
    """The wire name of the params dtype every group is stored in, None when they differ: a
    pull into a device workspace must be in it (RemoteAdamW's data_plane)."""
    stored = {s.params_dtype for s in storage}
    if len(stored) != 1:
        return None
    return "bfloat16" if stored.pop() == "bf16" else "float32"


def check_overlap_options(overlap: bool, bucket_bytes: Optional[int], delay: int,
                          delay_warmup: int, pull_dtype: Optional[str],
                          data_plane: str = "auto",
                          edge_bucket_bytes: Optional[int] = None) -> None:
    """ValueError for RemoteAdamW's overlap arguments out of range (delay without overlap,
    too)."""
    if data_plane not in DATA_PLANES:
        raise ValueError(f"data_plane must be one of {DATA_PLANES}, got {data_plane!r}")
    if bucket_bytes is not None and int(bucket_bytes) < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if edge_bucket_bytes is not None and int(edge_bucket_bytes) < 0:
        raise ValueError(f"edge_bucket_bytes must be >= 0, got {edge_bucket_bytes}")
    if delay not in (0, 1):
        raise ValueError(f"delay must be 0 or 1, got {delay!r}")
    if delay and not overlap:
        raise ValueError("delay=1 needs overlap=True")
    if int(delay_warmup) < 0:
        raise ValueError(f"delay_warmup must be >= 0, got {delay_warmup}")
    if pull_dtype is not None:
        wire_dtype(pull_dtype, "pull_dtype", or_none=True)


# The streams of a client RemoteAdamW(overlap=True) makes, unless client_options say: a push's
# parts and the pull's groups move over that many connections at once.
OVERLAP_STREAMS = 8


def overlap_client_options(options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The client options of RemoteAdamW(overlap=True): ``options`` with OVERLAP_STREAMS
    streams unless they set streams."""
    options = dict(options or {})
    options.setdefault("streams", OVERLAP_STREAMS)
    return options


def register_group(client: ParameterServiceClient, name: str, h: HyperTuple, amsgrad: bool,
                   storage: Storage) -> None:
    """Registers a server param group with these values; a group that exists already (a
    restarted trainer, an lr a schedule changed) takes them, unless its amsgrad or storage
    differs, which no call can change (ValueError)."""
    kwargs = hyperparameter_kwargs(h)
    try:
        client.register_param_group(
            name, amsgrad=amsgrad, decoupled_weight_decay=True,
            state_dtype=storage.state_dtype, params_dtype=storage.params_dtype,
            rounding_seed=storage.rounding_seed, **kwargs)
        return
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
    for info in client.server_infos():
        for g in info.param_groups:
            if g.name != name:
                continue
            if g.amsgrad is not None and bool(g.amsgrad) != amsgrad:
                raise ValueError(f"the server's param group {name!r} has amsgrad="
                                 f"{g.amsgrad}; this optimizer's has amsgrad={amsgrad}")
            check_server_storage(name, g, storage)
    client.set_hyperparameters(name, decoupled_weight_decay=True, **kwargs)


def register_tensors(client: ParameterServiceClient, pairs: Sequence[Tuple[str, torch.Tensor]],
                     groups: Sequence[str]) -> None:
    """Registers each (name, param) in its server group (groups[i]) with its current value,
    group by group, on one server or through a ShardedClient's plan (ValueError when a plan
    given with the ShardedClient puts a tensor in another group)."""
    detached = [(n, p.detach()) for n, p in pairs]
    group_of = {n: groups[i] for i, (n, _) in enumerate(detached)}
    if isinstance(client, ShardedClient):  # A plan given with it fixes the groups: check ours.
        plan = client.plan
        for s in plan.slices if plan is not None else ():
            if s.tensor in group_of and s.param_group != group_of[s.tensor]:
                raise ValueError(f"the ShardedClient's plan puts {s.tensor!r} in param "
                                 f"group {s.param_group!r}, this optimizer in "
                                 f"{group_of[s.tensor]!r} (make the plan with "
                                 "the optimizer's group names)")
    client.register_model(detached, param_group=group_of)


def make_client(targets: Union[str, Sequence[str]],
                options: Optional[Mapping[str, Any]]) -> Union[Client, ShardedClient]:
    """A Client for one target ("host:port" or a list of one), a ShardedClient for several;
    ``options`` are their keyword arguments. ValueError for no or non-str targets."""
    options = dict(options or {})
    if isinstance(targets, str):
        return Client(targets, **options)
    targets = list(targets)
    if not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"targets must be 'host:port' or a non-empty list of them, got "
                         f"{targets!r}")
    if len(targets) == 1:
        return Client(targets[0], **options)
    return ShardedClient(targets, **options)


# ----------------------------------------------------------------------------------------------
# GradScaler
# ----------------------------------------------------------------------------------------------

@dataclass
class ScalerPlan:
    """What one step does about loss scaling.

    grad_scale: what the server divides the gradients by (None: they are unscaled already).
    skip: True when the scaler already found inf/NaN locally (after scaler.unscale_): the step
      is skipped without pushing, as torch skips optimizer.step().
    report: called with the server's verdict (True: the step was skipped) so that the scaler's
      update() sees it.
    """

    grad_scale: Optional[float]
    skip: bool
    report: Callable[[bool], None]


def _no_report(skipped: bool) -> None:
    pass


def scaler_plan(grad_scaler: Any, optimizer: Any, extra_scale: Optional[float]) -> ScalerPlan:
    """The plan for ``GradScaler.step(optimizer)``, which calls ``optimizer.step(
    grad_scaler=scaler)`` because the optimizer has ``_step_supports_amp_scaling`` (the contract
    of torch.cuda.amp.GradScaler in torch 1.x and of torch.amp.GradScaler in torch 2.x).

    The scaler's stage for this optimizer says what happened: READY, the gradients are still
    scaled, so the server divides them by the scale (and checks them); UNSCALED, the user called
    scaler.unscale_(optimizer) (e.g. to clip), which divided them and recorded the inf check,
    so nothing is divided again and a local inf skips the step. Either way the outcome goes
    into the scaler's record for this optimizer (found_inf_per_device), which update() reads.
    """
    if grad_scaler is None or not getattr(grad_scaler, "_enabled", True):
        return ScalerPlan(extra_scale, False, _no_report)
    opt_state = grad_scaler._per_optimizer_states[id(optimizer)]
    if opt_state["stage"].name == "UNSCALED":
        found = opt_state["found_inf_per_device"]
        local_inf = any(float(v.item()) != 0.0 for v in found.values())

        def report_unscaled(skipped: bool) -> None:
            if skipped and not local_inf:
                if found:
                    next(iter(found.values())).fill_(1.0)
                else:
                    scale = grad_scaler._get_scale_async()
                    found[scale.device] = torch.ones_like(scale)

        return ScalerPlan(extra_scale, local_inf, report_unscaled)
    scale = grad_scaler._get_scale_async()
    grad_scale = float(scale.double().item())
    if extra_scale is not None:
        grad_scale *= extra_scale

    def report_scaled(skipped: bool) -> None:
        # The same layout as GradScaler.unscale_ records: per device a float32 tensor shaped
        # like the scale (shape (1,) in torch 1.x, () in 2.x); 1.0 means inf/NaN found.
        opt_state["found_inf_per_device"] = {
            scale.device: torch.full_like(scale, 1.0 if skipped else 0.0)}

    return ScalerPlan(grad_scale, False, report_scaled)


def attribute_plan(grad_scale: Any, found_inf: Any) -> ScalerPlan:
    """The plan for GradScaler's newer contract (torch may call step() without grad_scaler and
    set ``optimizer.grad_scale`` / ``optimizer.found_inf`` instead), and for a loss scale the
    user set with ``optimizer.grad_scale = S``."""
    skip = found_inf is not None and float(found_inf.sum().item()) != 0.0
    scale = None if grad_scale is None else float(
        grad_scale.double().item() if isinstance(grad_scale, torch.Tensor) else grad_scale)
    return ScalerPlan(scale, skip, _no_report)


def warn_timed_out_round(result: Any, logger: logging.Logger) -> None:
    """Logs a WARNING for a push answered by a sync round that closed by its timeout, naming
    the replicas it waited for (a PushResult, or a ShardedPushResult's results)."""
    for r in getattr(result, "results", None) or (result,):
        if getattr(r, "round_timed_out", False):
            missing = ", ".join(r.missing_replicas) or "none the server knows of"
            logger.warning(
                "the sync round at version %d closed by its timeout with %d push(es); it waited "
                "for: %s. A trainer that died or is stuck slows every round to the timeout "
                "(docs/consistency.md)", r.version, r.round_workers, missing)


def check_grad_scale(value: Optional[float]) -> Optional[float]:
    """ValueError unless None or > 0 and finite."""
    if value is None:
        return None
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"grad_scale must be > 0 and finite, got {value}")
    return value


# ----------------------------------------------------------------------------------------------
# state_dict format
# ----------------------------------------------------------------------------------------------

def scalar_step(step: int) -> torch.Tensor:
    """torch.optim.AdamW's "step" entry: a 0-dim tensor of the default scalar dtype (float32,
    or float64 when that is torch's default dtype), on the CPU."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(step), dtype=dtype)


def param_indices(param_groups: Sequence[Mapping[str, Any]]) -> Dict[int, int]:
    """id(param) -> its index in torch's state_dict, as torch.optim.Optimizer.state_dict
    numbers them: counted over all groups in order, a param seen in an earlier group keeping
    that group's index (within one group, torch's mapping keeps the last position)."""
    indices: Dict[int, int] = {}
    start = 0
    for group in param_groups:
        indices.update({id(p): i for i, p in enumerate(group["params"], start)
                        if id(p) not in indices})
        start += len(group["params"])
    return indices


def pack_groups(param_groups: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """torch's packed param groups: every key but "params", then "params" as the indices of
    param_indices()."""
    indices = param_indices(param_groups)
    packed = []
    for group in param_groups:
        p = {k: v for k, v in group.items() if k != "params"}
        p["params"] = [indices[id(param)] for param in group["params"]]
        packed.append(p)
    return packed


@dataclass
class LoadedState:
    """A validated torch.optim.AdamW state_dict, waiting to be written to the server.

    groups: the new param groups (the optimizer's "params" and names kept).
    entries: flat param index -> {"step": int, field: fp32 CPU tensor}; params without an
      entry start again from zero state and step 0, as after torch's load_state_dict.
    """

    groups: List[Dict[str, Any]]
    entries: Dict[int, Dict[str, Any]]


def validate_state_dict(state_dict: Mapping[str, Any], param_groups: Sequence[Dict[str, Any]],
                        amsgrad: Sequence[bool]) -> LoadedState:
    """Checks a torch.optim.AdamW state_dict against the optimizer and converts its state.

    Raises:
      ValueError: missing "state"/"param_groups", another number of groups or of params in a
        group (torch's messages), a group whose amsgrad differs from the optimizer's (the
        server fixes it at registration), a state index out of range, an entry without "step",
        "exp_avg", "exp_avg_sq" (and "max_exp_avg_sq" for amsgrad), or of another shape.
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or \
            "param_groups" not in state_dict:
        raise ValueError("expected a torch.optim.AdamW state_dict with 'state' and "
                         "'param_groups'")
    saved_groups = list(state_dict["param_groups"])
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups "
                         f"({len(saved_groups)}, the optimizer has {len(param_groups)})")
    params: List[torch.Tensor] = []
    group_of: List[int] = []
    new_groups = []
    for i, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        if len(saved.get("params", ())) != len(group["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             f"the size of optimizer's group (group {i}: "
                             f"{len(saved.get('params', ()))} != {len(group['params'])})")
        if bool(saved.get("amsgrad", False)) != amsgrad[i]:
            raise ValueError(f"group {i}: the state_dict has amsgrad={saved.get('amsgrad')}, the "
                             f"optimizer {amsgrad[i]}; amsgrad cannot change on the server")
        new_group = dict(group)
        # A key the saved group lacks takes torch's default, as AdamW.__setstate__ gives it
        # when torch loads (a state_dict of an older torch has no "maximize").
        new_group["maximize"] = False
        for k, v in saved.items():
            if k not in ("params", "param_names") and k not in IMPLEMENTATION_KEYS + \
                    STORAGE_KEYS:
                new_group[k] = v
        hyperparameters_of(new_group)  # TypeError/ValueError now rather than at step()
        new_groups.append(new_group)
        params.extend(group["params"])
        group_of.extend([i] * len(group["params"]))
    # Saved index -> the positions it stands for: several when a param appears twice (torch
    # then files one state under one index, which every appearance of that param takes).
    positions_of: Dict[Any, List[int]] = {}
    start = 0
    for saved in saved_groups:
        for j, saved_index in enumerate(saved["params"]):
            positions_of.setdefault(saved_index, []).append(start + j)
        start += len(saved["params"])
    entries: Dict[int, Dict[str, Any]] = {}
    for key, entry in state_dict["state"].items():
        if key not in positions_of:
            raise ValueError(f"state entry {key!r} names no parameter of the param groups")
        index = positions_of[key][0]
        fields = STATE_FIELDS + ((AMSGRAD_FIELD,) if amsgrad[group_of[index]] else ())
        missing = [f for f in ("step",) + fields if f not in entry]
        if missing:
            raise ValueError(f"state entry {key}: missing {missing}")
        step = entry["step"]
        step = float(step.item() if isinstance(step, torch.Tensor) else step)
        if not (step >= 0 and step == int(step)):
            raise ValueError(f"state entry {key}: step must be a whole number >= 0, got {step}")
        converted: Dict[str, Any] = {"step": int(step)}
        shape = tuple(params[index].shape)
        for f in fields:
            t = entry[f]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"state entry {key}: {f} must be a tensor of shape {shape}, "
                                 f"got {got}")
            converted[f] = t.detach().to("cpu", torch.float32, copy=True)
        for position in positions_of[key]:
            entries[position] = converted
    return LoadedState(new_groups, entries)


def state_entry(step: int, fields: Mapping[str, torch.Tensor], like: torch.Tensor
                ) -> Dict[str, torch.Tensor]:
    """One torch.optim.AdamW state entry: "step", then the fields in torch's order, each with
    the param's dtype and device (as torch keeps them)."""
    entry = {"step": scalar_step(step)}
    for f in STATE_FIELDS + (AMSGRAD_FIELD,):
        if f in fields:
            entry[f] = fields[f].to(device=like.device, dtype=like.dtype)
    return entry


# ----------------------------------------------------------------------------------------------
# Server state: reads and writes for Client and ShardedClient alike
# ----------------------------------------------------------------------------------------------

def pull_state(client: ParameterServiceClient, field: str, names: Sequence[str]
               ) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
    """(name -> fp32 CPU tensor of ``field``, name -> steps) of ``names``, from one server or
    gathered from the shards (the steps of a cut tensor: those of its first slice)."""
    tensors, _, steps = client.pull_state(field, list(names))
    return tensors, steps


def write_state(client: ParameterServiceClient, states: Mapping[str, Mapping[str, torch.Tensor]],
                steps: Mapping[str, int]) -> None:
    """Writes params and optimizer state, name -> {field -> tensor}, and steps, all or nothing
    on each server (Client.load_state / ShardedClient.load_state).

    Raises:
      RuntimeError: the client has no load_state (an older fusedps client).
    """
    load = getattr(client, "load_state", None)
    if load is None:
        raise RuntimeError(f"{type(client).__name__} has no load_state: this fusedps client "
                           "cannot write optimizer state")
    load(states, steps)
