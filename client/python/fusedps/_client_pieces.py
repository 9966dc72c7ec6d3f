"""fusedps.Client's transfers a piece at a time, which RemoteAdamW(overlap=True) makes
(fusedps/_overlap.py, _pull_pipeline.py): a push written in pieces and committed at the end
(begin_push), and a pull straight into raw buffers (pull_into). Internal module: Client
(fusedps/client.py) inherits them; their docstrings are Client's documentation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import grpc

from fusedps import _chunks, _dtypes, _push_transaction, _transport, errors
from fusedps._requests import _FIELDS
from fusedps.v1 import parameter_service_pb2 as pb, parameter_service_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

    from fusedps._native import NativeClient
    from fusedps._push_transaction import PushTransaction


@errors.translate_public_methods
class PieceCalls:
    """Client's begin_push and pull_into."""

    if TYPE_CHECKING:  # Client's, set by its __init__ or defined there.
        client_id: str
        model: str
        max_chunk_bytes: int
        timeout: Optional[float]
        min_bytes_per_second: float
        streams: int
        last_pulled_version: int
        _native: Optional[NativeClient]
        _channel: Optional[grpc.Channel]
        _extra_channels: List[grpc.Channel]

        def _name_push(self, header: "pb.PushHeader") -> None: ...

        def _observe_version(self, version: int) -> None: ...

    def begin_push(self, tensors: Sequence[Tuple[str, int]], *, grad_dtype="float32",
                   base_version: Optional[int] = None, plan_hash: str = "",
                   client_id: Optional[str] = None, sequence_number: int = 0,
                   workspace=None, max_parts: Optional[int] = None) -> "PushTransaction":
        """Begins a push of ``tensors`` ((name, numel) pairs) written a piece at a time and
        committed with its grad_scale at the end (fusedps.PushTransaction; the server applies
        it as one atomic step). It goes as one part per stream; client_id None and
        sequence_number 0 take this client's own, as pushes in parts do (see ``streams``).
        ``workspace``: a same-host workspace of this client's server (fusedps._workspace);
        pieces inside it travel as their place in it, not as bytes. ``max_parts``: at most this
        many parts (calls), None for one per stream; a push whose pieces all lie in a device
        workspace moves only their places, and one part saves the others' starts and ends.

        Raises:
          ValueError: no tensors, an unknown grad_dtype (spelled as for push_gradients),
            max_parts below 1.
            Server errors (NOT_FOUND for an unknown tensor, ABORTED for a stale sequence
            number) come from its write/commit.
        """
        if not tensors:
            raise ValueError("begin_push needs a tensor")
        if max_parts is not None and max_parts < 1:
            raise ValueError(f"max_parts must be at least 1 (or None), got {max_parts}")
        header = pb.PushHeader(client_id=self.client_id if client_id is None else client_id,
                               sequence_number=int(sequence_number))
        self._name_push(header)
        return _push_transaction.begin(
            self, [(str(n), int(k)) for n, k in tensors],
            _dtypes.wire_dtype(grad_dtype, "grad_dtype"),
            self.last_pulled_version if base_version is None else int(base_version), plan_hash,
            header.client_id, header.sequence_number, workspace, max_parts or 0)

    def pull_into(self, targets: Sequence[Tuple[str, "torch.Tensor"]], dtype="float32", *,
                  field: str = "param", stream: int = 0) -> Tuple[int, Dict[str, int]]:
        """Pulls one field of the targets' tensors at one version, over one call on stream
        ``stream`` (modulo ``streams``), writing raw wire elements straight into each target:
        a contiguous CPU tensor of the wire dtype (torch.float32 or torch.bfloat16) with the
        tensor's element count (any shape; a view into a larger buffer works). ``dtype``: as
        push_gradients' grad_dtype.

        Returns:
          (version, name -> steps).
        Raises:
          ValueError: a target that is not such a tensor, or whose element count differs from
            the server's. FusedPSError: as pull_parameters.
        """
        wire = _dtypes.wire_dtype(dtype, "dtype")
        if field not in _FIELDS:
            raise ValueError(f"field must be one of {sorted(_FIELDS)}, got {field!r}")
        for name, t in targets:
            if (t.device.type != "cpu" or not t.is_contiguous()
                    or t.dtype != _dtypes.torch_dtype(wire)):
                raise ValueError(f"{name}: pull_into writes into a contiguous CPU tensor of "
                                 f"{wire}, got {t.dtype} on {t.device}")
        if not targets:
            raise ValueError("nothing to pull")
        names = [n for n, _ in targets]
        if self._native is not None:
            version, steps = self._native.pull_raw(
                names, [t.data_ptr() for _, t in targets], [t.numel() for _, t in targets],
                dtype=_dtypes.WIRE_CODES[wire], field=_FIELDS[field],
                stream=int(stream) % self.streams)
            self._observe_version(version)
            return version, dict(zip(names, steps))
        channels = [self._channel] + self._extra_channels
        stub = pb_grpc.ParameterServiceStub(channels[int(stream) % len(channels)])
        direct = {n: (_chunks.tensor_as_wire_array(t.view(-1), wire), None)
                  for n, t in targets}
        out = _transport.pull(stub, names, wire, _FIELDS[field], direct,
                              max_chunk_bytes=self.max_chunk_bytes, timeout=self.timeout,
                              min_bytes_per_second=self.min_bytes_per_second, model=self.model)
        self._observe_version(out.version)
        return out.version, dict(out.steps)
