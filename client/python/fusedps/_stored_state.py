"""The stored forms of a checkpoint's low-precision params and optimizer state
(docs/checkpoints.md) and their conversion to fp32: the storage keys of a manifest, each
tensor's layout, and dequantization. Internal module of fusedps.checkpoint.

A param group stores its tensors as its manifest entry says (absent storage fields: fp32, as
written before they existed):
  * params: "fp32" (F32) or "bf16" (BF16, widened here exactly);
  * exp_avg, exp_avg_sq: "fp32" (F32), "bf16" (BF16) or "int8": U8 codes plus one F32 scale per
    block of elements (exp_avg_absmax / exp_avg_sq_absmax, shape [ceil(numel / block)]);
    value i = codebook[code i] * absmax[i // block], one fp32 multiply, with the manifest's
    int8_codebooks (signed for exp_avg, unsigned for exp_avg_sq; fp32 values, as the
    fusedps.v1.CheckpointManifest message holds them). The block is 256 elements of the flat
    tensor, or, for an embedding table (the manifest's tensor has ``table`` set, shape
    [rows, dim]), one row: dim elements, a scale per row (scale_block). A tensor under 4096
    elements of an int8 group has fp32 state (a table too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Sequence

import torch

from fusedps import _dtypes

if TYPE_CHECKING:
    from fusedps.v1 import checkpoint_pb2 as ckpt_pb

QUANT_BLOCK = 256        # Elements per scale of a dense tensor's int8 state (a table's: dim).
MIN_QUANT_NUMEL = 4096   # Smaller tensors of an int8 group keep fp32 state.
QUANT_MAP_SIZE = 256

# The storage names a manifest group takes (the short spellings of fusedps._dtypes).
STATE_DTYPES = tuple(_dtypes.short(n) for n in _dtypes.STATE_DTYPES)    # fp32, bf16, int8
PARAMS_DTYPES = tuple(_dtypes.short(n) for n in _dtypes.PARAMS_DTYPES)  # fp32, bf16
ABSMAX_FILES = {"exp_avg": "exp_avg_absmax.safetensors",
                "exp_avg_sq": "exp_avg_sq_absmax.safetensors"}
_MAX_SEED = (1 << 64) - 1


@dataclass(frozen=True)
class Layout:
    """How one tensor is stored: params "fp32" | "bf16", state "fp32" | "bf16" | "int8"."""

    params: str = "fp32"
    state: str = "fp32"

    def stored_dtype(self, field: str) -> torch.dtype:
        """The dtype of the field's entry in its file ("param" for the params)."""
        if field == "param":
            return _dtypes.torch_dtype(self.params)
        if field in ("exp_avg", "exp_avg_sq"):
            # int8 state is stored as its codes, U8.
            return torch.uint8 if self.state == "int8" else _dtypes.torch_dtype(self.state)
        return torch.float32  # max_exp_avg_sq and the scales


def layout_of(group: Mapping[str, Any], numel: int) -> Layout:
    """A tensor's layout from its (checked) manifest group and its element count."""
    state = group.get("state_dtype", "fp32")
    if state == "int8" and numel < MIN_QUANT_NUMEL:
        state = "fp32"
    return Layout(group.get("params_dtype", "fp32"), state)


def check_group_storage(g: Mapping[str, Any], bad: Callable[[str], Exception],
                        where: str) -> None:
    """Raises bad(why) for storage keys of a manifest group that are present and wrong, or
    amsgrad with state other than fp32."""
    if g.get("state_dtype", "fp32") not in STATE_DTYPES:
        raise bad(f"{where}: state_dtype {g['state_dtype']!r} is not one of {STATE_DTYPES}")
    if g.get("params_dtype", "fp32") not in PARAMS_DTYPES:
        raise bad(f"{where}: params_dtype {g['params_dtype']!r} is not one of {PARAMS_DTYPES}")
    seed = g.get("rounding_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise bad(f"{where}: rounding_seed {seed!r} is not an integer in [0, 2**64)")
    if g.get("amsgrad") and g.get("state_dtype", "fp32") != "fp32":
        raise bad(f"{where}: amsgrad with state_dtype {g['state_dtype']!r} (amsgrad needs fp32)")


def check_tensor_layout(t: Mapping[str, Any], layout: Layout, bad: Callable[[str], Exception],
                        where: str) -> None:
    """Raises bad(why) when a manifest tensor lists a layout other than its group gives it."""
    for key, want in (("params_dtype", layout.params), ("state_dtype", layout.state)):
        if key in t and t[key] != want:
            raise bad(f"{where}: {key} {t[key]!r}, but its group and size give {want!r}")


def read_codebooks(m: "ckpt_pb.CheckpointManifest", needed: bool,
                   bad: Callable[[str], Exception]) -> Optional[Dict[str, torch.Tensor]]:
    """The manifest's int8_codebooks as fp32 tensors {"exp_avg", "exp_avg_sq"} of 256 values
    each, or None when absent and not ``needed``. Raises bad(why) when missing but needed, or
    not 256 finite numbers in [-1, 1], ascending."""
    if not m.HasField("int8_codebooks"):
        if not needed:
            return None
        raise bad("int8_codebooks is missing or not an object (a tensor has int8 state)")
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        values = list(getattr(m.int8_codebooks, key))
        if not (len(values) == QUANT_MAP_SIZE and all(
                math.isfinite(v) and -1.0 <= v <= 1.0 for v in values)):
            raise bad(f"int8_codebooks[{key!r}] is not {QUANT_MAP_SIZE} numbers in [-1, 1]")
        book = torch.tensor(values, dtype=torch.float32)
        if not bool((book[1:] > book[:-1]).all()):
            raise bad(f"int8_codebooks[{key!r}] is not ascending fp32 values")
        out[key] = book
    return out


def scale_block(shape: Sequence[int], table: bool) -> int:
    """Elements per scale of a tensor's int8 state: a table's dim (shape [rows, dim]: a scale
    per row), else QUANT_BLOCK."""
    return int(shape[1]) if table else QUANT_BLOCK


def scale_count(numel: int, block: int) -> int:
    """Scales per int8 state field of a tensor of ``numel`` elements: ceil(numel / block)."""
    return -(-numel // block)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
               block: int = QUANT_BLOCK) -> torch.Tensor:
    """fp32 values of int8 state: codebook[code] * absmax[i // block] for each element i of
    ``codes`` (uint8, any shape; absmax of ceil(numel / block) fp32 scales), shaped as codes.
    ``block``: QUANT_BLOCK for a dense tensor, dim for an embedding table (scale_block)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    flat = codes.reshape(-1).long()
    scales = absmax.reshape(-1).repeat_interleave(block)[:flat.numel()]
    return (codebook[flat] * scales).reshape(codes.shape)


def to_fp32(stored: torch.Tensor) -> torch.Tensor:
    """An F32 or BF16 entry as float32 (BF16 widened, exactly)."""
    return stored if stored.dtype == torch.float32 else stored.to(torch.float32)
