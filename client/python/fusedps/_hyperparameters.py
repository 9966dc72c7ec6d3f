"""A param group's AdamW hyperparameters between torch's vocabulary and the proto's message
(fusedps.v1.Hyperparameters, the one schema), made from the message's descriptor.

Internal module; imports no torch.

Torch's names are the proto's field names but three: torch's ``betas`` is the proto's
(beta1, beta2); ``decoupled_weight_decay`` (a bool, as torch.optim.Adam's in torch 2.x) is the
proto's weight_decay_mode enum; ``state_dtype`` and ``params_dtype`` are dtype names ("fp32",
"bf16", "int8": fusedps._dtypes) where the proto has enum codes. Every other field of the
message is taken and given under its own name, with its own type (a double as float, a bool as
bool, an integer as int), so a field added to the proto needs nothing written here.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from google.protobuf import descriptor as _descriptor

from fusedps import _dtypes
from fusedps._torch_defaults import ADAMW
from fusedps.v1 import parameter_service_pb2 as pb

_FD = _descriptor.FieldDescriptor
# The fields converted by name (see the module doc); every other field is a scalar of its own
# name.
_SPECIAL = ("beta1", "beta2", "weight_decay_mode", "state_dtype", "params_dtype")
_SCALARS: Dict[str, Any] = {
    f.name: (float if f.cpp_type in (_FD.CPPTYPE_DOUBLE, _FD.CPPTYPE_FLOAT)
             else bool if f.cpp_type == _FD.CPPTYPE_BOOL else int)
    for f in pb.Hyperparameters.DESCRIPTOR.fields if f.name not in _SPECIAL}

# Every name a param group's hyperparameters take in torch's vocabulary, in the proto's order.
NAMES: Tuple[str, ...] = tuple(dict.fromkeys(
    "betas" if f.name in ("beta1", "beta2") else
    "decoupled_weight_decay" if f.name == "weight_decay_mode" else f.name
    for f in pb.Hyperparameters.DESCRIPTOR.fields))


# The fields that say how a group is stored, fixed at registration (not torch's).
STORAGE: Tuple[str, ...] = ("state_dtype", "params_dtype", "rounding_seed")
# What the server takes for a field left unset at registration: torch.optim.AdamW's defaults,
# decoupled decay, fp32 storage, seed 0; a field torch lacks, the proto's zero.
DEFAULTS: Dict[str, Any] = {**{name: _SCALARS[name]() for name in _SCALARS},
                            **ADAMW._asdict(), "decoupled_weight_decay": True,
                            "state_dtype": "fp32", "params_dtype": "fp32"}


def as_python(name: str, value: Any) -> Any:
    """A hyperparameter's value (by torch's name) as the Python type of its field: betas a
    tuple of two floats, a double a float, a bool a bool (a 0-dim tensor converts). TypeError or
    ValueError for a value that does not convert."""
    if name == "betas":
        beta1, beta2 = value
        return (float(beta1), float(beta2))
    return _SCALARS[name](value)


def to_proto(fields: Mapping[str, Any]) -> "pb.Hyperparameters":
    """The message with the fields given, by torch's names; a value of None leaves its field
    unset (betas may be (beta1, None)). Dtype names are checked names (fusedps._dtypes).

    Raises:
      TypeError: a name that is not a hyperparameter.
    """
    h = pb.Hyperparameters()
    for key, value in fields.items():
        if value is None:
            continue
        if key == "betas":
            for field, beta in zip(("beta1", "beta2"), value):
                if beta is not None:
                    setattr(h, field, float(beta))
        elif key == "decoupled_weight_decay":
            h.weight_decay_mode = (pb.WEIGHT_DECAY_MODE_DECOUPLED if value
                                   else pb.WEIGHT_DECAY_MODE_L2)
        elif key == "state_dtype":
            h.state_dtype = _dtypes.STATE_CODES[_dtypes.canonical(value)]
        elif key == "params_dtype":
            h.params_dtype = _dtypes.WIRE_CODES[_dtypes.canonical(value)]
        elif key in _SCALARS:
            setattr(h, key, _SCALARS[key](value))
        else:
            raise TypeError(f"{key!r} is not a hyperparameter (they are {', '.join(NAMES)})")
    return h


def from_proto(h: "pb.Hyperparameters") -> Dict[str, Any]:
    """The fields the message sets, by torch's names: betas as (beta1, beta2) with None for one
    unset, decoupled_weight_decay a bool, the dtypes by short name ("fp32", "bf16", "int8";
    UNSPECIFIED is "fp32"; a code this client does not know, from a newer server,
    "unknown(<code>)")."""
    out: Dict[str, Any] = {}
    for f in pb.Hyperparameters.DESCRIPTOR.fields:
        if not h.HasField(f.name):
            continue
        value = getattr(h, f.name)
        if f.name in ("beta1", "beta2"):
            betas = out.get("betas", (None, None))
            out["betas"] = (value, betas[1]) if f.name == "beta1" else (betas[0], value)
        elif f.name == "weight_decay_mode":
            out["decoupled_weight_decay"] = value != pb.WEIGHT_DECAY_MODE_L2
        elif f.name in ("state_dtype", "params_dtype"):
            out[f.name] = _dtypes.storage_name(
                value, _dtypes.STATE_NAMES if f.name == "state_dtype" else _dtypes.WIRE_NAMES)
        else:
            out[f.name] = value
    return out
