"""Turning the caller's arguments into request pieces: named tensors from a model, mapping or
pairs; their checks; Hyperparameters messages; load_state's arguments. (The chunks themselves
are serialized by fusedps._chunks.)

Internal module of the fusedps client (fusedps.client, fusedps.sharded); no network.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from fusedps import _dtypes
from fusedps import _hyperparameters as _hp
from fusedps._lazy import LazyModule
from fusedps.v1 import parameter_service_pb2 as pb

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

_FIELDS = _dtypes.TENSOR_FIELDS  # "param", "exp_avg", ... -> TensorField

ModelLike = Union["torch.nn.Module", Mapping[str, "torch.Tensor"],
                  Iterable[Tuple[str, "torch.Tensor"]]]


def _named_tensors(obj: ModelLike, prefix: str = "") -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module (named_parameters), a mapping or an iterable of pairs.

    Raises:
      TypeError: for anything else. ValueError: for repeated names.
    """
    if isinstance(obj, torch.nn.Module):
        pairs = list(obj.named_parameters())
    elif isinstance(obj, Mapping):
        pairs = list(obj.items())
    else:
        try:
            pairs = [tuple(p) for p in obj]
        except TypeError:
            raise TypeError(
                "expected an nn.Module, a mapping name -> tensor or (name, tensor) pairs, got "
                f"{type(obj).__name__}") from None
    out = []
    seen = set()
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str) or not isinstance(pair[1], torch.Tensor):
            raise TypeError(f"expected (str, torch.Tensor) pairs, got {pair!r:.80}")
        name = prefix + pair[0]
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        out.append((name, pair[1]))
    return out


def _check_sendable(name: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"{name}: only dense tensors can be sent, got layout {t.layout}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating point tensor, got {t.dtype}")


_MAX_SEED = (1 << 64) - 1
# A param group's storage arguments (register_param_group's, RemoteAdamW's) -> the values
# each takes (fusedps._dtypes; fusedps.results names what the server reports).
_STORAGE = {"state_dtype": _dtypes.STATE_DTYPES, "params_dtype": _dtypes.PARAMS_DTYPES}


def storage_name(value, argument: str) -> Optional[str]:
    """The short name ("fp32", "bf16", "int8": the spelling of checkpoint manifests and of
    what the server reports) of a state_dtype / params_dtype argument, given in either
    spelling ("fp32" or "float32", "bf16" or "bfloat16"); None for None.

    Raises:
      ValueError: anything else (a torch dtype too), naming ``argument`` and the values it
        takes.
    """
    if value is None:
        return None
    names = [_dtypes.short(n) for n in _STORAGE[argument]]
    return _dtypes.short(_dtypes.checked(value, argument, names, or_else="None"))


def checked_rounding_seed(value) -> Optional[int]:
    """rounding_seed as an int in [0, 2**64), or None.

    Raises:
      ValueError: anything else (a bool, a float, a negative or too large int).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or \
            not 0 <= int(value) <= _MAX_SEED:
        raise ValueError(f"rounding_seed must be an int in [0, 2**64), got {value!r}")
    return int(value)


def _hyperparameters(lr=None, betas=None, eps=None, weight_decay=None, amsgrad=None,
                     maximize=None, decoupled_weight_decay=None, state_dtype=None,
                     params_dtype=None, rounding_seed=None, **more) -> "pb.Hyperparameters":
    """A Hyperparameters message with the fields given (None: unset), by torch's names
    (fusedps._hyperparameters; ``more``: any other field of the message by its name, TypeError
    for a name that is none). state_dtype and params_dtype are checked names ("fp32", ...:
    storage_name); rounding_seed an int (see the checks above)."""
    return _hp.to_proto(dict(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
        maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
        state_dtype=state_dtype, params_dtype=params_dtype, rounding_seed=rounding_seed, **more))


def checked_group_hyperparameters(lr=None, betas=None, eps=None, weight_decay=None,
                                  amsgrad=None, maximize=None, decoupled_weight_decay=None,
                                  state_dtype=None, params_dtype=None,
                                  rounding_seed=None, **more) -> "pb.Hyperparameters":
    """register_param_group's Hyperparameters message, its storage arguments checked first.

    Raises:
      ValueError: a state_dtype, params_dtype or rounding_seed the server does not take
        (naming the argument), or amsgrad with a state_dtype other than fp32.
    """
    state = storage_name(state_dtype, "state_dtype")
    params = storage_name(params_dtype, "params_dtype")
    seed = checked_rounding_seed(rounding_seed)
    if amsgrad and state not in (None, "fp32"):
        raise ValueError(f"state_dtype={state_dtype!r} with amsgrad=True: amsgrad keeps "
                         "max_exp_avg_sq in fp32 and needs state_dtype 'fp32'")
    return _hyperparameters(lr, betas, eps, weight_decay, amsgrad, maximize,
                            decoupled_weight_decay, state, params, seed, **more)


def checked_states(states: Mapping[str, Mapping[str, "torch.Tensor"]],
                   steps: Mapping[str, object]) -> Dict[str, int]:
    """Checks a load_state call's arguments (the same names in both, each entry as
    checked_state) and returns name -> step as an int.

    Raises:
      ValueError, TypeError: as checked_state; ValueError for no tensors, or names in one
        mapping only.
    """
    if not states:
        raise ValueError("no tensors to load")
    if set(states) != set(steps):
        odd = sorted(set(states) ^ set(steps))
        raise ValueError(f"states and steps must name the same tensors; {odd[0]!r} is in "
                         "one only")
    return {name: checked_state(name, fields, steps[name]) for name, fields in states.items()}


def checked_state(name: str, fields: Mapping[str, "torch.Tensor"], step) -> int:
    """Checks one tensor's entry of a load_state call (its fields and step) and returns the
    step as an int.

    Raises:
      ValueError: a step that is not an int >= 0, an unknown field name. TypeError: a value
        that is not a dense floating tensor.
    """
    as_int = int(step)
    if as_int < 0 or float(step) != as_int:
        raise ValueError(f"{name}: step must be an int >= 0, got {step!r}")
    for field, t in fields.items():
        if field not in _FIELDS:
            raise ValueError(f"{name}: field must be one of {sorted(_FIELDS)}, got {field!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} {field}: expected a torch.Tensor, got {type(t).__name__}")
        _check_sendable(f"{name} {field}", t)
    return as_int
