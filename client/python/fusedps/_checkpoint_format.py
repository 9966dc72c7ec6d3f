"""The fusedps checkpoint format's names (docs/checkpoints.md): what fusedps.checkpoint's reader
(to_torch) and writer (from_torch, fusedps/_checkpoint_write.py) share. Internal module; the
public names are re-exported by fusedps.checkpoint.
"""

from __future__ import annotations

import numbers
import re

from . import _dtypes

FORMAT = "fusedps-checkpoint"
# The format written: 3, a group's hyperparameters as protobuf's JSON mapping of
# fusedps.v1.Hyperparameters. Read: 3, and 2 (each hyperparameter a key of its group).
FORMAT_VERSION = 3
READ_FORMAT_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
LATEST = "latest"
PARAMS = "params.safetensors"
EXP_AVG = "exp_avg.safetensors"
EXP_AVG_SQ = "exp_avg_sq.safetensors"
MAX_EXP_AVG_SQ = "max_exp_avg_sq.safetensors"
PARAM_COPY = "param_copy.safetensors"
BUFFERS = "buffers.safetensors"  # The model's buffers, when it has any.

_DIR_RE = re.compile(r"checkpoint-([0-9]{20})\Z")
# A manifest's param_copy_dtype: "none" or the short name of a param copy's dtype.
_PARAM_COPY_NAMES = ("none",) + tuple(_dtypes.short(n) for n in _dtypes.PARAM_COPY_DTYPES)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0

