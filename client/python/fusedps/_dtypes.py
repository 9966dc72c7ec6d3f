"""Every dtype of the Python client, built from the proto's enums: names <-> codes, element
sizes, torch dtypes and the spellings a dtype argument takes.

Internal module; nothing here imports torch until a torch dtype is asked for.

Names: a proto member's name without its enum's prefix, in lower case (DTYPE_BFLOAT16 ->
"bfloat16", STATE_DTYPE_INT8 -> "int8"); UNSPECIFIED is no dtype. Each name has a short
spelling: "float" becomes "fp" and "bfloat" "bf" ("fp32", "bf16", "fp16", "int8"), the
spelling of checkpoint manifests and of the storage the server reports. The element size is
the name's bit count over 8. So a value added to DType or StateDType gets its name, code, size
and spellings with nothing written here (which arguments take it is below: the server's rules).
The C++ code's one table (common/dtype_names.h) follows the same rules.

Spellings: every dtype argument of the package (grad_dtype, pull_dtype, a pull's dtype,
state_dtype, params_dtype, param_copy_dtype) takes a name in either spelling, in any case
("float32" or "fp32", "bfloat16" or "bf16", "float16" or "fp16"); the wire dtypes of pushes
and pulls also take a torch dtype (torch.float32, ...). checked() turns any of them into the
name, or raises a ValueError that names the argument and the values it takes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

from fusedps._lazy import LazyModule
from fusedps.v1 import parameter_service_pb2 as pb

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")


def _members(enum: Any, prefix: str) -> Dict[str, int]:
    """name -> code of a proto enum's members, UNSPECIFIED left out (see the module doc)."""
    return {key[len(prefix):].lower(): value for key, value in enum.items()
            if key != prefix + "UNSPECIFIED"}


def short(name: str) -> str:
    """The short spelling of a dtype name: "float32" -> "fp32", "bfloat16" -> "bf16",
    "float16" -> "fp16", "int8" -> "int8"."""
    return name.replace("bfloat", "bf").replace("float", "fp")


# The wire dtypes (DType: pushes, pulls, a group's params_dtype, the param copy), name -> code,
# and back.
WIRE_CODES: Dict[str, int] = _members(pb.DType, "DTYPE_")
WIRE_NAMES: Dict[int, str] = {code: name for name, code in WIRE_CODES.items()}
# How a group stores exp_avg and exp_avg_sq (StateDType), name -> code, and back.
STATE_CODES: Dict[str, int] = _members(pb.StateDType, "STATE_DTYPE_")
STATE_NAMES: Dict[int, str] = {code: name for name, code in STATE_CODES.items()}
# Which stored array a pull or a state load names (TensorField): "param", "exp_avg",
# "exp_avg_sq", "max_exp_avg_sq" -> code.
TENSOR_FIELDS: Dict[str, int] = _members(pb.TensorField, "TENSOR_FIELD_")

# The values each argument takes, by the server's rules (which the enums do not carry).
WIRE_DTYPES = tuple(WIRE_CODES)               # a push's grad_dtype, pull_into's dtype
STATE_DTYPES = tuple(STATE_CODES)             # state_dtype: every StateDType
PARAMS_DTYPES = ("float32", "bfloat16")       # params_dtype
PULL_DTYPES = ("float32", "bfloat16")         # pull_parameters; RemoteAdamW's wire dtypes
PARAM_COPY_DTYPES = ("bfloat16", "float16")   # a checkpoint's param copy

# Bytes per element of every name: its bit count over 8 (per chunk and per tensor on the push
# and pull paths, so made once).
_SIZES: Dict[str, int] = {n: int(re.findall(r"\d+", n)[-1]) // 8
                          for n in {**WIRE_CODES, **STATE_CODES}}
# Spelling (lower case) -> name, for every name of either enum.
_SPELLINGS: Dict[str, str] = {s: n for n in {**WIRE_CODES, **STATE_CODES}
                              for s in (n, short(n))}
# What the wire dtypes take besides: torch dtypes, by their str() ("torch.float32", so that
# naming one does not import torch), and the older spellings the client has always taken.
_WIRE_EXTRA: Dict[str, str] = {**{f"torch.{n}": n for n in WIRE_CODES},
                               "f32": "float32", "f16": "float16", "half": "float16"}


def canonical(spelling: str) -> str:
    """The name of a spelling already checked ("bf16" -> "bfloat16"); KeyError for others."""
    return _SPELLINGS[spelling.lower()]


def lookup(value: Any, *, torch_dtypes: bool = False) -> Optional[str]:
    """The dtype name a spelling stands for, or None for anything else (a torch dtype, or its
    str(), only with ``torch_dtypes``)."""
    if isinstance(value, str):
        key = value.lower()
    elif torch_dtypes and value is not None:
        key = str(value)
    else:
        return None
    name = _SPELLINGS.get(key)
    if name is None and torch_dtypes:
        name = _WIRE_EXTRA.get(key)
    return name


def checked(value: Any, argument: str, names: Sequence[str], *, torch_dtypes: bool = False,
            or_else: str = "") -> str:
    """The name of ``value``, a spelling of one of ``names`` (see the module doc; a torch
    dtype too with ``torch_dtypes``). ``or_else``: a value the caller takes besides and handles
    itself ("None", "'none'"), named in the error only.

    Raises:
      ValueError: anything else, naming ``argument``, ``names`` as given (their spelling is
        the one the argument documents) and the other spelling of each.
    """
    want = {_SPELLINGS[n] for n in names}
    name = lookup(value, torch_dtypes=torch_dtypes)
    if name in want:
        return name
    given = ", ".join(repr(n) for n in names) + (f" or {or_else}" if or_else else "")
    others = ", ".join(dict.fromkeys(repr(s) for n in names
                                     for s in (_SPELLINGS[n], short(_SPELLINGS[n])) if s != n))
    if torch_dtypes:
        others += " or a torch dtype" if others else "a torch dtype"
    also = f" (also {others})" if others else ""
    raise ValueError(f"{argument} must be one of {given}{also}, got {value!r}")


def wire_dtype(value: Any, argument: str, names: Sequence[str] = WIRE_DTYPES, *,
               or_else: str = "") -> str:
    """checked() for a wire dtype argument (a push's or a pull's): torch dtypes are taken too;
    ``names`` are every wire dtype unless the call takes fewer."""
    return checked(value, argument, names, torch_dtypes=True, or_else=or_else)


def element_size(name: str) -> int:
    """Bytes per element of a dtype name ("float32" -> 4, "bfloat16" -> 2, "int8" -> 1)."""
    return _SIZES[canonical(name)]


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of a wire dtype name (torch.float32, torch.bfloat16, torch.float16);
    imports torch."""
    return getattr(torch, canonical(name))


def storage_name(code: int, names: Dict[int, str]) -> str:
    """The short name ("fp32", "bf16", "int8") of a storage code the server reports, with
    ``names`` WIRE_NAMES (params_dtype) or STATE_NAMES (state_dtype): UNSPECIFIED is "fp32"
    (what a server older than the field stores), a code this client does not know (from a
    newer server) "unknown(<code>)"."""
    if code == 0:  # UNSPECIFIED, in either enum.
        return short("float32")
    name = names.get(code)
    return f"unknown({code})" if name is None else short(name)
