"""fusedps checkpoints <-> PyTorch state dicts (the format: docs/checkpoints.md).

A fusedps server with ``--checkpoint-dir=DIR`` writes checkpoints of its shard (fp32 params,
AdamW state, steps, param groups) as safetensors files plus a ``manifest.json``, the message
fusedps.v1.CheckpointManifest in protobuf's JSON mapping (format 4; 2 and 3 are read too). This
module
reads one into a torch model state_dict and a torch.optim.AdamW state_dict (to_torch), and
writes one from them (from_torch) that a server loads at start.

The math: the server's update is torch.optim.AdamW's single-tensor (foreach=False) step, and
torch.optim.Adam's for a group with decoupled_weight_decay=False (L2 decay). A checkpoint holds
that update's complete state, exactly: fp32 params, exp_avg, exp_avg_sq, max_exp_avg_sq
(amsgrad groups) and each tensor's step; so a torch optimizer loaded from to_torch continues
the run with torch's own math, and a server started from from_torch's output continues a torch
run. Nothing is rounded on the way in either direction (hyperparameters are JSON doubles,
printed with Python's shortest round-trip repr).

Example::

    from fusedps import checkpoint
    model_state, optim_state = checkpoint.to_torch("/ckpt")        # the newest one in /ckpt
    params = {n: torch.nn.Parameter(t) for n, t in model_state.items()}
    opt = torch.optim.AdamW([{"params": [params[n] for n in g["param_names"]]}
                             for g in optim_state["param_groups"]])
    opt.load_state_dict(optim_state)

    checkpoint.from_torch(model.state_dict(), opt.state_dict(), "/ckpt")

Safetensors files are written and read by fusedps._safetensors (write_safetensors,
decode_safetensors and read_safetensors are re-exported here): written as the server writes
them, read with the ``safetensors`` package when it is importable.

The reader is this module; from_torch lives in fusedps/_checkpoint_write.py, and what both
use (file names, FORMAT, FORMAT_VERSION, manifest.json <-> the message) in
fusedps/_checkpoint_format.py.
"""

from __future__ import annotations

import collections
import math
import os
import zlib
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, cast

import torch

from . import _checkpoint_format, _checkpoint_write, _dtypes, _hyperparameters
from . import _stored_state as stored
from ._checkpoint_format import (BUFFERS, EXP_AVG, EXP_AVG_SQ, FORMAT, FORMAT_VERSION,
                                 HASHED_TABLES, LATEST, MANIFEST, MAX_EXP_AVG_SQ, PARAMS, _DIR_RE,
                                 _PARAM_COPY_CODES)
from ._checkpoint_write import from_torch
from ._safetensors import decode_safetensors, read_safetensors, write_safetensors
from .v1 import checkpoint_pb2 as ckpt_pb

__all__ = ["FORMAT", "FORMAT_VERSION", "HashedTableState", "decode_safetensors", "from_torch",
           "hashed_tables", "read_safetensors", "resolve_checkpoint", "to_torch",
           "write_safetensors"]

# Names of the format and of the writer that this module had before they moved.
PARAM_COPY = _checkpoint_format.PARAM_COPY
_default_group = _checkpoint_write._default_group


# ----------------------------------------------------------------------------------------------
# Reading a checkpoint
# ----------------------------------------------------------------------------------------------

def _has_manifest(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MANIFEST))


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory that ``path`` names.

    ``path`` is a checkpoint directory (it has a manifest.json) or a checkpoint root (a
    ``--checkpoint-dir``). For a root: the complete checkpoint (one with a manifest.json) of
    the highest serial, ``checkpoint-<20 digits>``; that is the one ``latest`` names, except
    after a crash between a manifest's commit and ``latest``'s move, when ``latest`` still
    names the older one (the manifest is the commit point, as for the server). ``latest`` is
    also followed where it names a complete directory of another name.

    Raises:
      FileNotFoundError: no such directory, or no complete checkpoint in it.
    """
    path = os.fspath(path)
    if _has_manifest(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint directory or root")
    best: Tuple[int, Optional[str]] = (-1, None)
    for entry in os.listdir(path):
        m = _DIR_RE.match(entry)
        full = os.path.join(path, entry)
        if m and int(m.group(1)) > best[0] and _has_manifest(full):
            best = (int(m.group(1)), full)
    if best[1] is None:
        try:
            with open(os.path.join(path, LATEST), encoding="utf-8") as f:
                target = f.read().strip()
        except OSError:
            target = ""
        if target and "/" not in target and target not in (".", "..") and \
                _has_manifest(os.path.join(path, target)):
            return os.path.join(path, target)
        raise FileNotFoundError(f"no complete checkpoint under {path} (no {MANIFEST} there "
                                f"nor in a checkpoint-<serial> directory)")
    return best[1]


class _Manifest(NamedTuple):
    """A checkpoint's manifest as to_torch reads it: the message, and its param_groups as
    {"name", **hyperparameters by torch's names (absent fields: the server's defaults)}."""

    message: "ckpt_pb.CheckpointManifest"
    groups: List[Dict[str, Any]]


def _read_manifest(directory: str) -> _Manifest:
    """The manifest of ``directory``, of any format read (_checkpoint_format.parse_manifest),
    checked for what to_torch relies on: unique names, each tensor's group, shape, step and
    layout, the groups' storage, the files' names."""
    path = os.path.join(directory, MANIFEST)
    with open(path, "rb") as f:
        m = _checkpoint_format.parse_manifest(f.read(), path)

    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: {why}")

    if m.param_copy_dtype not in _PARAM_COPY_CODES.values():
        copy = _dtypes.WIRE_NAMES.get(m.param_copy_dtype, m.param_copy_dtype)
        raise bad(f"param_copy_dtype {copy!r} is not none (DTYPE_UNSPECIFIED), bfloat16 or "
                  "float16")
    groups: List[Dict[str, Any]] = []
    for i, g in enumerate(m.param_groups):
        if not g.name or any(h["name"] == g.name for h in groups):
            raise bad(f"param_groups[{i}] has no name, or a repeated one")
        where = f"param_groups[{i}] ({g.name!r})"
        if not g.HasField("hyperparameters"):
            raise bad(f"{where}: 'hyperparameters' is missing or not an object")
        group = {"name": g.name, **_hyperparameters.DEFAULTS,
                 **_hyperparameters.from_proto(g.hyperparameters)}
        stored.check_group_storage(group, bad, where)
        groups.append(group)
    group_of = {g["name"]: g for g in groups}
    names = set()
    for i, t in enumerate(m.tensors):
        if not t.name or t.name in names:
            raise bad(f"tensors[{i}] has no name, or a repeated one")
        names.add(t.name)
        where = f"tensors[{i}] ({t.name!r})"
        if not all(d >= 0 for d in t.shape):
            raise bad(f"{where}: bad shape {list(t.shape)!r}")
        if t.table and (len(t.shape) != 2 or t.shape[1] < 1):
            raise bad(f"{where}: a table's shape must be [rows, dim] with dim >= 1, got "
                      f"{list(t.shape)!r}")
        if t.param_group not in group_of:
            raise bad(f"{where}: unknown param_group {t.param_group!r}")
        if t.step < 0:
            raise bad(f"{where}: step is not a non-negative integer")
        listed = {key: _dtypes.storage_name(getattr(t, key), table) for key, table in (
            ("params_dtype", _dtypes.WIRE_NAMES), ("state_dtype", _dtypes.STATE_NAMES))
            if getattr(t, key) != 0}  # UNSPECIFIED: not listed.
        stored.check_tensor_layout(
            listed, stored.layout_of(group_of[t.param_group], math.prod(t.shape)), bad, where)
    for name in m.files:
        if not name or "/" in name or name in (".", "..", MANIFEST):
            raise bad(f"a bad entry in 'files' for {name!r}")
    return _Manifest(m, groups)


def _read_verified(directory: str, name: str, entry: "ckpt_pb.CheckpointManifest.File"
                   ) -> bytes:
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path} is missing (listed in {MANIFEST})") from None
    if len(data) != entry.bytes:
        raise ValueError(f"{path} has {len(data)} bytes, {MANIFEST} says {entry.bytes}")
    if zlib.crc32(data) != entry.crc32:
        raise ValueError(f"{path} does not match its crc32 in {MANIFEST}")
    return data


def to_torch(path: str) -> Tuple["collections.OrderedDict[str, torch.Tensor]", Dict[str, Any]]:
    """Reads a checkpoint into ``(model_state, optim_state)``.

    Args:
      path: a checkpoint directory, or a checkpoint root (then its newest complete
        checkpoint, see resolve_checkpoint; unlike the server, an older one is never tried
        when that one is bad: pass its directory to read an older one).

    Returns:
      model_state: OrderedDict name -> CPU tensor: the params as float32, in registration
        order, with the registered shapes (() for a 0-dim tensor; bf16 params widened exactly);
        then the model's buffers (buffers.safetensors, written by RemoteAdamW(buffers=...) or
        Client.write_buffers), by name, each in its own dtype and shape. For a module whose
        params and buffers were all kept, ``module.load_state_dict(model_state)`` is strict.
      optim_state: a torch.optim.AdamW state_dict::

          {"state": {index: {"step": torch.tensor(float(step)),     # default dtype, 0-dim
                             "exp_avg": fp32, "exp_avg_sq": fp32,
                             "max_exp_avg_sq": fp32}},               # amsgrad groups only
           "param_groups": [{"lr", "betas": (beta1, beta2), "eps", "weight_decay", "amsgrad",
                             "maximize", "foreach": None, "capturable": False,
                             "differentiable": False, "fused": None,
                             "decoupled_weight_decay": bool,
                             "params": [index, ...], "param_names": [name, ...]}]}

        One param group per manifest group that has tensors, in group index order: groups
        without tensors (often the server's "default") are left out, so that the optimizer's
        groups, which load_state_dict matches one for one, are the ones in use. Indices run
        0, 1, ... group by group, and within a group in registration order: build the
        optimizer's groups from ``[model_state[n] for n in group["param_names"]]`` (or named
        params, torch >= 2.6).
        ``state`` has an entry for each tensor with step > 0 only (torch creates state at a
        tensor's first step; a tensor never stepped has zero state on the server).

      A group with decoupled_weight_decay=False is L2 decay, torch.optim.Adam's weight_decay:
      load it into torch.optim.Adam, never AdamW (AdamW always decouples; torch 2.11's Adam
      follows the loaded key either way, torch 1.13's Adam ignores it and does L2). "foreach":
      None lets torch choose (the single-tensor step on CPU); set ``group["foreach"] = False``
      after load_state_dict to pin it. The manifest's group names are not in optim_state
      (torch groups have no names): read manifest.json for them.

      Low-precision storage (docs/checkpoints.md) comes back as fp32, exactly what a server
      pulls: BF16 widened, int8 codes dequantized (the manifest's int8_codebooks[code] *
      absmax[i // block], in float32; block 256, or an embedding table's dim: a scale per
      row). The storage settings are in manifest.json.

    Raises:
      FileNotFoundError: no checkpoint at ``path``.
      ValueError: a manifest that does not parse, of another format or an unknown
        format_version, with a key the message lacks or a value of the wrong type (format 4:
        naming the key), or without a key it needs (int8_codebooks with int8 state); bad
        storage keys, or a tensor layout its group does not give; a file the manifest lists
        that is missing or whose size or crc32 differs (the message names the file); a data
        file that is not valid safetensors or whose tensors, dtypes or shapes disagree with
        the manifest.
    """
    directory = resolve_checkpoint(path)
    m, groups = _read_manifest(directory)
    raw = {name: _read_verified(directory, name, e) for name, e in sorted(m.files.items())}
    group_of = {g["name"]: g for g in groups}
    shapes = {t.name: tuple(t.shape) for t in m.tensors}
    # Elements per int8 scale: 256, or a table's dim (a scale per row).
    blocks = {t.name: stored.scale_block(t.shape, t.table) for t in m.tensors}
    layouts = {t.name: stored.layout_of(group_of[t.param_group], math.prod(t.shape))
               for t in m.tensors}
    int8_names = [n for n, lay in layouts.items() if lay.state == "int8"]
    books = stored.read_codebooks(m, bool(int8_names),
                                  lambda why: ValueError(f"{directory}/{MANIFEST}: {why}"))
    fields = [("param", PARAMS, list(shapes)), ("exp_avg", EXP_AVG, list(shapes)),
              ("exp_avg_sq", EXP_AVG_SQ, list(shapes)),
              ("max_exp_avg_sq", MAX_EXP_AVG_SQ,
               [t.name for t in m.tensors if group_of[t.param_group]["amsgrad"]])]
    fields += [(f"{f}_absmax", file, int8_names) for f, file in stored.ABSMAX_FILES.items()]
    data: Dict[str, Dict[str, torch.Tensor]] = {}
    for field, file, want in fields:
        if file not in raw:
            if want:
                raise ValueError(f"{os.path.join(directory, file)}: not in {MANIFEST}'s files")
            data[field] = {}
            continue
        what = os.path.join(directory, file)
        tensors = decode_safetensors(raw[file], what)
        if set(tensors) != set(want):
            extra, missing = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
            raise ValueError(f"{what} holds other tensors than {MANIFEST} lists: missing "
                             f"{missing[:5]}, not listed {extra[:5]}")
        for name, t in tensors.items():
            dtype = layouts[name].stored_dtype(field)
            shape = shapes[name]
            if field.endswith("_absmax"):
                shape = (stored.scale_count(math.prod(shape), blocks[name]),)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"{what}: {name!r} is {t.dtype} {tuple(t.shape)}, expected "
                                 f"{dtype} {shape}")
        data[field] = tensors
    for field in ("param", "exp_avg", "exp_avg_sq"):
        for name, t in data[field].items():
            data[field][name] = (  # int8 state: books were read (int8_names).
                stored.dequantize(t, data[f"{field}_absmax"][name],
                                  cast(Dict[str, Any], books)[field], blocks[name])
                if t.dtype == torch.uint8 else stored.to_fp32(t))

    model_state = collections.OrderedDict((n, data["param"][n]) for n in shapes)
    if BUFFERS in raw:
        what = os.path.join(directory, BUFFERS)
        for name, t in decode_safetensors(raw[BUFFERS], what).items():
            if name in model_state:
                raise ValueError(f"{what}: buffer {name!r} has the name of a tensor")
            model_state[name] = t
    by_group: Dict[str, List["ckpt_pb.CheckpointManifest.Tensor"]] = \
        collections.defaultdict(list)
    for t in m.tensors:
        by_group[t.param_group].append(t)
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    param_groups = []
    index = 0
    for g in groups:
        members = by_group[g["name"]]
        if not members:
            continue
        ids = list(range(index, index + len(members)))
        index += len(members)
        for i, t in zip(ids, members):
            if t.step == 0:
                continue
            st = {"step": torch.tensor(float(t.step)),
                  "exp_avg": data["exp_avg"][t.name],
                  "exp_avg_sq": data["exp_avg_sq"][t.name]}
            if g["amsgrad"]:
                st["max_exp_avg_sq"] = data["max_exp_avg_sq"][t.name]
            state[i] = st
        param_groups.append({
            **{k: v for k, v in g.items() if k != "name" and k not in _hyperparameters.STORAGE},
            "foreach": None, "capturable": False, "differentiable": False, "fused": None,
            "params": ids, "param_names": [t.name for t in members]})
    return model_state, {"state": state, "param_groups": param_groups}


class HashedTableState(NamedTuple):
    """The rows a hashed embedding table held at a checkpoint (docs/checkpoints.md), by key.

    Attributes:
      keys: [n] int64, the keys it held, in slot order.
      param, exp_avg, exp_avg_sq: [n, dim] float32 (bf16 moments widened, int8 ones
        dequantized with their row's scale), row i keys[i]'s.
      stamps: [n] int64, the table step at which each row was last created or updated (the
        eviction order: smallest first, ties to the earlier slot).
      step: the table's step count. seed, init_std: its initializer's (a key not held reads
        as kernels/row_init.h's row for them, with zero moments).
      evictions_total, lookups_total, lookup_misses_total: its counters.
    """

    keys: torch.Tensor
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    stamps: torch.Tensor
    step: int
    seed: int
    init_std: float
    evictions_total: int
    lookups_total: int
    lookup_misses_total: int


def hashed_tables(path: str) -> Dict[str, HashedTableState]:
    """Reads the hashed embedding tables of a checkpoint as (keys, rows): name ->
    HashedTableState, in registration order; empty when it has none. to_torch reads such a
    table as its [capacity, dim] slots, without their keys; this pairs each held slot's row
    with its key (hashed_tables.safetensors).

    Raises: as to_torch; ValueError for a hashed table whose slot entries are missing or of
    another dtype or shape than I64 [capacity].
    """
    directory = resolve_checkpoint(path)
    m, _ = _read_manifest(directory)
    hashed = [t for t in m.tensors if t.HasField("hashed")]
    if not hashed:
        return {}
    if HASHED_TABLES not in m.files:
        raise ValueError(f"{os.path.join(directory, HASHED_TABLES)}: not in {MANIFEST}'s files")
    what = os.path.join(directory, HASHED_TABLES)
    slots = decode_safetensors(_read_verified(directory, HASHED_TABLES, m.files[HASHED_TABLES]),
                               what)
    model_state, optim_state = to_torch(directory)
    index = {n: i for g in optim_state["param_groups"]
             for i, n in zip(g["params"], g["param_names"])}
    out: Dict[str, HashedTableState] = {}
    for t in hashed:
        capacity, dim = int(t.shape[0]), int(t.shape[1])
        keys, stamps = slots.get(f"{t.name}.slot_keys"), slots.get(f"{t.name}.slot_stamps")
        for name, v in ((f"{t.name}.slot_keys", keys), (f"{t.name}.slot_stamps", stamps)):
            if v is None or v.dtype != torch.int64 or tuple(v.shape) != (capacity,):
                raise ValueError(f"{what}: no int64 {name!r} of shape ({capacity},)")
        held = torch.nonzero(cast(torch.Tensor, stamps) >= 0).reshape(-1)
        st = optim_state["state"].get(index[t.name])
        moments = [st[f][held] if st else torch.zeros(held.numel(), dim)
                   for f in ("exp_avg", "exp_avg_sq")]
        out[t.name] = HashedTableState(
            cast(torch.Tensor, keys)[held], model_state[t.name][held], moments[0], moments[1],
            cast(torch.Tensor, stamps)[held], int(t.step), int(t.hashed.seed),
            float(t.hashed.init_std), int(t.hashed.evictions_total),
            int(t.hashed.lookups_total), int(t.hashed.lookup_misses_total))
    return out
