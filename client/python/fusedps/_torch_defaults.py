"""torch.optim.AdamW's defaults, written once for the Python package: RemoteAdamW's signature
and the "default" group fusedps.checkpoint.from_torch writes take them from here (the server
registers the same values for an unset field: proto/fusedps/v1/parameter_service.proto,
Hyperparameters). A test compares them with torch's own signature.

Internal module; imports nothing.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple


class AdamWDefaults(NamedTuple):
    """torch.optim.AdamW's keyword defaults, by torch's names."""

    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False
    maximize: bool = False


ADAMW = AdamWDefaults()
