"""fusedps.Client's reads and writes of whole stored state: optimizer state (pull_state,
load_state) and the model's buffers. Internal module: Client (fusedps/client.py) inherits them;
their docstrings are Client's documentation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from fusedps import _chunks, errors
from fusedps._requests import _FIELDS, checked_states
from fusedps.results import PulledTensors
from fusedps.v1 import parameter_service_pb2 as pb

if TYPE_CHECKING:
    import torch


@errors.translate_public_methods
class StateCalls:
    """Client's optimizer state and buffer calls."""

    if TYPE_CHECKING:  # Client's, set by its __init__ or defined there.
        model: str
        max_chunk_bytes: int
        _stub: Any
        _load_state: Any

        def _timeout(self, payload_bytes: int = 0) -> Optional[float]: ...

        @staticmethod
        def _targets_and_names(obj, prefix: str) -> Tuple[list, List[str]]: ...

        def _pull(self, names: List[str], wire: str, field: int,
                  targets: Sequence[Tuple[str, "torch.Tensor"]] = ()) -> PulledTensors: ...

    def pull_state(self, field: str = "exp_avg", names=None, *, prefix: str = ""
                   ) -> Tuple[Dict[str, torch.Tensor], int, Dict[str, int]]:
        """Reads one stored array per tensor as fp32 (for checkpoints, tests and debugging):
        bf16 state and params widened, int8 state dequantized (map value x block scale; an
        embedding table's block is a row).

        Args:
          field: "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (amsgrad groups only) or "param".
          names: names, one name, a module/mapping/pairs (their names, with ``prefix``), or
            None for every tensor of the shard.

        Returns:
          (tensors, version, steps): name -> torch.float32 CPU tensor with the registered
          shape; the shard version it was read at; name -> steps applied (int). Names follow
          the server's order. The optimizer state of a tensor that was never stepped is zeros,
          as torch's would be after its first (zero-gradient-free) initialization.
        Raises:
          ValueError: unknown field. FusedPSError: NOT_FOUND for unknown names;
          INVALID_ARGUMENT / FAILED_PRECONDITION for max_exp_avg_sq without amsgrad.
        """
        if field not in _FIELDS:
            raise ValueError(f"field must be one of {sorted(_FIELDS)}, got {field!r}")
        _, names = self._targets_and_names(names, prefix)
        out = self._pull(names, "float32", _FIELDS[field])
        return dict(out), out.version, out.steps

    def load_state(self, states: Mapping[str, Mapping[str, "torch.Tensor"]],
                   steps: Mapping[str, int], *, plan_hash: str = "") -> int:
        """Overwrites registered tensors' params, AdamW state and steps on the server, all or
        nothing: the counterpart of torch.optim.Optimizer.load_state_dict (e.g. to resume a
        job from a torch checkpoint into a running server).

        Args:
          states: name -> {field: tensor}, fields among "param", "exp_avg", "exp_avg_sq" and
            "max_exp_avg_sq" (amsgrad groups only). Each tensor has the tensor's registered
            shape (the server checks its element count) and any floating dtype and device; it
            travels as float32, rounded as tensor.to(torch.float32) rounds. A field not given
            keeps its value on the server; an empty mapping sets the step alone. The server
            stores the values as its group does: bf16 params and state rounded to nearest
            even, int8 state quantized block by block (a pull_state afterwards returns the
            quantized values).
          steps: name -> the tensor's step afterwards (an int >= 0, or a 0-dim tensor holding
            one, as torch's state["step"]); the next push's bias correction counts on from it.
            Every name of states must be in steps, and every name of steps in states.
          plan_hash: the shard's sharding plan hash, as given to register_model.

        The load is one call: the server receives and checks all of it before it changes
        anything, then applies it in order with pushes (after every push acknowledged before
        this call, before any push sent after it returns) and advances the shard version by 1.
        Its header (about 20 bytes plus the name per tensor) must fit in one message of the
        server's max_message_bytes, and its values in the server's staging pool.

        Returns:
          The shard version after the load.
        Raises:
          ValueError: no tensors; states and steps with other names; an unknown field; a step
            that is not an int >= 0. TypeError: a value that is not a dense floating tensor.
          fusedps.errors.NotFound (NOT_FOUND): a tensor the server does not have.
          fusedps.errors.InvalidArgument (INVALID_ARGUMENT): a tensor of another element count
            than the registered one.
          fusedps.errors.FailedPrecondition (FAILED_PRECONDITION): max_exp_avg_sq of a tensor
            whose group has no amsgrad; another plan_hash than the shard's; in sync mode, a
            round that holds pushes (load between rounds).
          fusedps.errors.ResourceExhausted (RESOURCE_EXHAUSTED): values larger than the
            server's whole staging pool (--staging-pool-bytes), or a header over its message
            size. Each of these leaves the server's state as it was.
        """
        int_steps = checked_states(states, steps)
        by_field: Dict[str, List[Tuple[str, "torch.Tensor"]]] = {f: [] for f in _FIELDS}
        header = pb.LoadStateHeader(plan_hash=plan_hash, model=self.model)
        payload = 0
        for name, fields in states.items():
            state = header.tensors.add(name=name, step=int_steps[name])
            for field, t in fields.items():
                state.fields.append(_FIELDS[field])
                by_field[field].append((name, t))
                payload += t.numel() * 4

        def requests():
            yield pb.LoadStateRequest(header=header).SerializeToString()
            for field, items in by_field.items():
                # The field's two bytes a chunk fit in _chunks.CHUNK_FRAMING_BYTES.
                yield from _chunks.chunk_messages(items, "float32", self.max_chunk_bytes,
                                                  field=_FIELDS[field])

        return int(self._load_state(requests(), timeout=self._timeout(payload)).version)

    def write_buffers(self, buffers, *, prefix: str = "") -> int:
        """Writes the model's buffers to the server (docs/api.md, "Buffers"): module state that
        is not a parameter, such as BatchNorm's running statistics, kept with the model and in
        its checkpoints, never optimized. Each in its own dtype and shape, bit for bit; buffers
        not given keep their values on the server. In stream order with pushes: a checkpoint
        taken after this call holds these values. Returns the model's version.

        Args:
          buffers: an nn.Module (the buffers its state_dict holds, by those names), a mapping
            name -> tensor or (name, tensor) pairs; any device, dtypes float32, float64,
            float16, bfloat16, int64, int32, int16, int8, uint8 and bool.
          prefix: prepended to each name.
        Raises:
          TypeError: a value that is not a tensor, or of another dtype. ValueError: a name
            twice, or no buffers.
          fusedps.errors.InvalidArgument: a bad name, more than 4096 buffers or 256 MiB.
        """
        from fusedps import _buffers  # torch: not imported by `import fusedps`.

        pairs = _buffers.named_buffers(buffers, prefix)
        if not pairs:
            raise ValueError("no buffers to write")
        return _buffers.write(self._stub, self.model, pairs, self._timeout())

    def pull_buffers(self, buffers=None, *, prefix: str = "") -> Dict[str, "torch.Tensor"]:
        """The model's buffers from the server (name -> CPU tensor in its dtype and shape).

        Args:
          buffers: None (every buffer), a list of names, or an nn.Module / mapping / pairs
            (as write_buffers): then the server's values are also copied into those tensors,
            in place; those the server does not have keep theirs.
        Raises:
          fusedps.errors.NotFound: a name the model has no buffer of.
          ValueError: a local buffer whose shape differs from the server's.
        """
        from fusedps import _buffers  # torch: not imported by `import fusedps`.

        if buffers is None:
            return _buffers.pull(self._stub, self.model, [], self._timeout())
        if isinstance(buffers, str) or (isinstance(buffers, (list, tuple))
                                        and all(isinstance(b, str) for b in buffers)):
            names = [buffers] if isinstance(buffers, str) else list(buffers)
            return _buffers.pull(self._stub, self.model, names, self._timeout())
        pairs = _buffers.named_buffers(buffers, prefix)
        pulled = _buffers.pull(self._stub, self.model, [], self._timeout())
        _buffers.copy_into(pairs, pulled)
        return pulled
