"""fusedps.torch.RemoteAdamW: a torch.optim.Optimizer whose AdamW step runs on fusedps servers.

Swap ``torch.optim.AdamW(model.parameters(), ...)`` for ``RemoteAdamW(model.named_parameters(),
..., targets=...)`` and keep the rest of the training loop: ``zero_grad``, ``step`` (with a
closure or through a GradScaler), lr schedulers, ``state_dict`` / ``load_state_dict``. Each
step pushes the gradients to the server(s), which apply one fused AdamW step to their fp32
master copy (the math of torch.optim.AdamW), and pulls the new parameters back into the model.
``state_dtype="bf16"`` or ``"int8"`` and ``params_dtype="bf16"`` keep the server's copy of the
optimizer state and params in less memory (RemoteAdamW's docstring says what each costs).

Example::

    import torch
    from fusedps.torch import RemoteAdamW

    model = torch.nn.Linear(64, 10)
    opt = RemoteAdamW(model.named_parameters(), lr=1e-3, weight_decay=0.01,
                      targets="127.0.0.1:50051")          # or a list: one shard per server
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()                                       # push, server AdamW, pull
        sched.step()
    print(opt.last_step_timings)   # {"push_seconds": ..., "pull_seconds": ..., ...}

GradScaler (torch.cuda.amp.GradScaler in torch 1.x, torch.amp.GradScaler in 2.x) works
unchanged: ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``. RemoteAdamW
sets ``_step_supports_amp_scaling``, the contract both versions share: the scaler then calls
``opt.step(grad_scaler=scaler)`` without unscaling or checking anything itself, the server
divides the gradients by the scaler's scale (PushGradients' grad_scale) and skips the step
when one is inf/NaN, and the optimizer writes that verdict where ``scaler.update()`` reads it,
so the scale backs off after a skipped step exactly as with torch's own check. After
``scaler.unscale_(opt)`` (to clip) the gradients are already divided and checked: they are
pushed as they are, and a step with inf/NaN is skipped without a push. torch >= 2.3 warns (a
FutureWarning from ``scaler.step(opt)``, shown once under Python's default filters) that this
keyword contract will go; RemoteAdamW also follows the newer contract (``opt.grad_scale`` /
``opt.found_inf`` set by the scaler). The warning is the caller's to silence: importing this
module changes no warning filter, and ``warnings.filterwarnings("ignore", message="GradScaler is
going to stop passing itself", category=FutureWarning)`` silences it.

The optimizer state lives on the server(s): ``opt.state`` stays empty; ``state_dict()`` reads
it in torch.optim.AdamW's format and ``load_state_dict()`` writes it at the next step, together
with the model's values then (so model and optimizer loads may come in either order). Those
two methods are in fusedps/_adamw_state_dict.py (StateDictMethods, which RemoteAdamW inherits).

Errors from the servers are fusedps.errors.FusedPSError subclasses (grpc.RpcError, with the
gRPC status code). This module is not imported by ``import fusedps``; import it as
``fusedps.torch``. Inside it, ``import torch`` is PyTorch (absolute imports).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import torch

from fusedps import _buffers, _on_existing
from fusedps import _remote_optim as ro
from fusedps._adamw_state_dict import StateDictMethods
from fusedps._torch_defaults import ADAMW
from fusedps.client import Client
from fusedps.sharded import ShardedClient

if TYPE_CHECKING:  # imported at run time only by overlap=True
    from fusedps._overlap import OverlapEngine

# Embedding tables (fusedps/_embedding.py): drop-ins for nn.Embedding/EmbeddingBag(sparse=True)
# and torch.optim.SparseAdam.
from fusedps._embedding import (RemoteEmbedding, RemoteEmbeddingBag,  # noqa: E402
                                RemoteSparseAdam, remote_tables)

__all__ = ["RemoteAdamW", "RemoteEmbedding", "RemoteEmbeddingBag", "RemoteSparseAdam",
           "remote_tables"]

logger = logging.getLogger(__name__)

# torch >= 2.3 warns, at every GradScaler.step, that passing the scaler as the grad_scaler
# keyword is going away. RemoteAdamW uses that keyword on purpose (the one contract torch 1.x
# and 2.x share) and also follows the newer one (optimizer.grad_scale / found_inf). Nothing here
# silences it: GradScaler.step warns from the caller's own ``scaler.step(opt)`` before it calls
# RemoteAdamW.step, so no code of this module is running then to catch it locally, and a filter
# set at import would change the warnings of the whole process. The module docstring says how
# the caller silences it.


class RemoteAdamW(StateDictMethods, torch.optim.Optimizer):
    """torch.optim.AdamW whose state and step live on fusedps servers.

    Args:
      params: named parameters: ``model.named_parameters()``, (name, param) pairs, a mapping
        name -> param, or a list of param-group dicts whose "params" is one of those (plus any
        per-group AdamW keys, e.g. ``{"params": ..., "weight_decay": 0.0}``, and an optional
        "name": the group's name on the server, and the storage keys below). Params may
        have any floating dtype and any device; the server keeps them as params_dtype says.
      lr, betas, eps, weight_decay, amsgrad, maximize: as torch.optim.AdamW (the same defaults
        and the same ValueErrors for out-of-range values). lr and betas may be tensors.
      foreach, capturable, differentiable, fused: accepted for compatibility as None/False
        only; True raises ValueError (the server runs the step).
      targets: "host:port" of one server (a fusedps.Client), or a list of several (a
        fusedps.ShardedClient: tensors are cut and spread over them, docs/sharding.md).
      client: an existing Client or ShardedClient to use instead of ``targets`` (not closed
        by close()).
      client_options: keyword arguments for the Client / ShardedClient made from ``targets``
        (e.g. client_id, timeout, max_chunk_bytes, streams, and the security options tls,
        tls_ca, tls_cert, tls_key, token, token_file), passed through unchanged. Against a
        server with --auth-tokens, construction registers param groups and tensors and a
        changed lr is sent with SetHyperparameters, which need an admin token, and pushes
        need ``client_id`` = the token's principal: e.g. ``client_options=dict(
        token_file=..., client_id="trainer-0", tls_ca=...)`` with an admin token for
        trainer-0 (docs/python.md, "Security").
      grad_dtype: wire dtype of the gradients, "float32" (the default: the server then does
        exactly what torch.optim.AdamW does) or "bfloat16" (half the bytes; the gradients are
        rounded to nearest even first). Every dtype argument takes either spelling, "float32"
        or "fp32", "bfloat16" or "bf16"; grad_dtype and pull_dtype take torch dtypes too.
      prefix: prepended to every tensor name and to the default group names, so that several
        models can share servers.
      connect_timeout: seconds to wait for the server(s) when ``targets`` is given (None: do
        not wait; the first call then fails at once when a server is not up).
      overlap: hide the remote step behind compute (docs/python.md, "Overlap"). Each
        param's gradient leaves (unless push_during_backward is False, below) as soon as
        backward has accumulated it, in buckets of about
        ``bucket_bytes`` wire bytes, and the server stages them; step() commits the push with
        the step's scale and returns once it is applied, and the parameters come back in the
        order the forward uses them while the next forward runs (each module's forward waits
        for its own). Every recipe of the loop stays exact: lr schedulers,
        clip_grad_norm_ and GradScaler (with or without unscale_) between backward and
        step() (found by comparing the gradients with what was sent, on the device, when a
        gradient's version counter moved: a common factor goes to the server as the step's
        scale; writes through ``.data`` move no counter and are not seen), ``with
        opt.no_sync():`` around the
        earlier micro-batches of gradient accumulation. Anything else that changes a gradient
        after it left, or a changed set of params with a gradient, is found too: that step is
        pushed again in full after backward (correct, not hidden; warned once, counted in
        ``overlap_fallbacks``). Parameters are current inside a forward and after
        wait_parameters() (and model.state_dict() waits); read them elsewhere only after
        wait_parameters(). Works on torch 1.13 and 2.x, with one server or several.
      bucket_bytes: see overlap (default None: 32 MiB through a same-host workspace, 8 MiB
        over gRPC); the pulls go in groups of this size too.
      edge_bucket_bytes: with overlap, the size of the two exposed ends of a step: the last
        bucket of a backward (what is left to push when it ends) and the first pull group of
        a forward (what its first layers wait for). The buckets before the last, and the
        groups after the first, double in size up to ``bucket_bytes``. DDP's first bucket
        (1 MiB) is the same idea at its one end. Default None: 4 MiB; 0: every bucket and
        group ``bucket_bytes``.
      delay: with overlap, 1 turns on the one-step-delayed update (ZeRO-Offload's DPU): after
        ``delay_warmup`` steps, step() returns at once and the push, the server's step and
        the pull complete behind the next forward and backward, which run on the parameters
        of the step before: the gradient of step t is computed at the parameters of step
        t - 2 and applied to those of step t - 1 (bounded staleness 1). Once delayed, the
        gradient and forward hooks are removed and step() stages the gradients itself. 0
        (default): none.
      delay_warmup: steps run without delay first (default 10).
      push_during_backward: with overlap, True: each bucket leaves during backward (above);
        False: no gradient hooks, step() sends every gradient at once (the pull still lands
        during the next forward, and every recipe stays exact, since nothing left before the
        loop was done with the gradients). None (default): False on a device workspace, where
        the whole push takes well under a millisecond and the hooks' Python would cost a
        CPU-bound backward more (docs/python.md, "Overlap"), True otherwise.
      data_plane: with overlap, where the gradients' and parameters' bytes travel. "auto"
        (default): a same-host workspace (docs/python.md, "Same-host workspaces") when the
        params live on one server on this host that offers one, else gRPC. On a GPU, auto
        tries a device workspace first (the server GPU's memory, mapped here through CUDA
        IPC: device-to-device copies, no pinned memory) when the server runs on this GPU,
        stores the params in fp32, and the pull dtype is fp32 (as by default) or that of its
        --param-copy-dtype, then a host one (shared memory). "device" / "workspace": that
        kind or RuntimeError; "grpc": always gRPC. ``data_plane_in_use`` says which was taken.
      pull_dtype: with overlap, the dtype parameters are pulled in: None (default) "float32"
        (exact) unless every group keeps bf16 params; "bfloat16" halves the pull's bytes, the
        model then holding the fp32 master rounded to bf16 (the server keeps fp32).
      grad_scaler: accepted for compatibility and ignored: the scale of a GradScaler comes
        with the step (scaler.step(opt)).
      state_dtype, params_dtype, rounding_seed: how the server stores each group, fixed at
        registration (Client.register_param_group; a group's dict may set its own; costs in
        docs/python.md, "Low-precision optimizer state"). state_dtype "fp32" (the default:
        torch.optim.AdamW's results), "bf16" or "int8" (block-wise; tensors under 4096
        elements keep fp32): the step's math is fp32, but the stored state is rounded, so
        results drift from torch's; not with amsgrad. params_dtype "bf16": no fp32 master,
        each step's result rounded to bf16 stochastically (deterministic by rounding_seed,
        the tensor's name, its step and the element); the model's params then hold bf16
        values. Device bytes per parameter, fp32 / bf16 params: fp32 state 12 / 10, bf16
        state 8 / 6, int8 state 6.03 / 4.03.
      on_existing: what to do when the server(s) hold some of this model's tensors already
        (a second run of the script, a restarted trainer, a trainer joining a sync job),
        checked by listing every server's tensors before anything is registered or written:
        "error" (the default) raises fusedps.errors.AlreadyExists, whose message names the
        server(s), their version, how many of the tensors are there and these choices;
        "resume" continues from the server's values and optimizer state (below) and logs the
        version resumed from (INFO, logger "fusedps.torch"); "replace" deletes the server's
        model (``model``: every tensor in it, its state and its checkpoints, on every server)
        and starts over from the local values. Every trainer of a sync job passes "resume".
      model: the server model (namespace; docs/api.md, "Models") this optimizer's tensors
        live in, created on every server when it does not exist (with the servers' consistency
        flags; an existing one is used as it is). None (default): the client's (``model`` in
        client_options, or of the given client), else "default". Jobs that share servers each
        use a model of their own: their tensors, versions and checkpoints never mix, and one
        can be deleted without touching the others.
      buffers: the model's buffers to keep on the server with its params (docs/python.md,
        "Buffers"): usually the module itself (the buffers its state_dict holds: BatchNorm's
        running statistics), or a mapping / (name, tensor) pairs; names get ``prefix``. At
        construction, buffers the server has are copied into them (a resumed run continues
        with the server's running statistics), the others are written. Every step writes
        their values (as backward left them) before its push, so that every server checkpoint
        holds params and buffers that the module had together, and
        ``fusedps.checkpoint.to_torch`` gives a state_dict that ``model.load_state_dict``
        takes strictly. None (default): no buffers are kept. With several servers the first
        keeps them.

    On construction, each torch param group becomes a server param group named by its "name"
    key or ``f"{prefix}group{i}"``, registered with the group's hyperparameters (decoupled
    weight decay), and every param is registered with its current value. A group that exists
    already gets this optimizer's hyperparameters (its amsgrad and storage must match).
    With on_existing="resume", tensors that exist already keep the server's values, NOT the
    local ones: after registering, the optimizer always pulls every param, so that the model
    holds exactly the server's values (local == server) before the first step.

    Raises (construction):
      ValueError: bad hyperparameters (as torch), an implementation flag set to True, neither
        or both of targets and client, an unknown grad_dtype, state_dtype, params_dtype,
        rounding_seed or on_existing, amsgrad with state_dtype other than "fp32", repeated
        names, a server group whose amsgrad or storage differs. TypeError: parameters
        without names.
      grpc.RpcError (fusedps.errors.*): from the server(s) (UNAVAILABLE: not reachable;
        ALREADY_EXISTS: tensors of the model exist and on_existing is "error", or a tensor
        registered with another shape or group; FAILED_PRECONDITION: a shard of another
        plan; UNAVAILABLE or DEADLINE_EXCEEDED from connecting, naming the
        target and the cause: a refused connection is tried again until connect_timeout, any
        other failure to connect is raised at once, see Client.wait_ready).

    Differences from torch.optim.AdamW:
      * The optimizer state (exp_avg, exp_avg_sq, max_exp_avg_sq, step) lives on the servers;
        ``self.state`` stays empty. ``state_dict()`` reads it from the servers.
      * step() writes the server's values into the params (in place, under no_grad), so the
        params are always a copy of the fp32 master (rounded to the params' dtype), or of
        the bf16 params with params_dtype="bf16".
      * With state_dtype "bf16" or "int8", state_dict() returns the stored state as fp32
        (bf16 widened, int8 dequantized), and load_state_dict() rounds or quantizes what it
        loads on the server, as a step's results are (a round trip through state_dict is
        then within that rounding, not bit-exact; server checkpoints are).
      * A gradient with inf/NaN (after grad_scale) makes the server skip the whole step: the
        params and state stay as they were (``last_step_skipped``), where torch.optim.AdamW
        would write NaN. With several servers each skips on its own (ShardedClient).
      * load_state_dict() is applied at the next step() (below).
      * state_dict/load_state_dict hooks (torch >= 2.0 register_*_hook) are not run; params
        cannot be added after construction (add_param_group raises NotImplementedError).

    Attributes:
      client: the Client or ShardedClient.
      group_names: the server param group of each torch param group.
      tensor_names: the server name of each param, in param_groups order.
      storage: each param group's Storage (state_dtype, params_dtype, rounding_seed).
      last_step_timings: the last step()'s {"push_seconds", "pull_seconds",
        "hyperparameters_seconds", "load_state_seconds"} (wall-clock seconds; 0.0 for what it
        did not do). With overlap also: "push_exposed_seconds" (what step() waited for the
        push) and "push_hidden_seconds" (the rest of push_seconds, during backward);
        "pull_seconds", "pull_exposed_seconds" (what the forward passes and step() waited
        for it) and "pull_hidden_seconds", of the pull that brought this step's forward its
        parameters; "check_seconds" (comparing the gradients with what was sent);
        "step_wait_seconds" (all of step()); "exposed_seconds" (step_wait_seconds plus
        pull_exposed_seconds: all the loop waited for fusedps).
      overlap_fallbacks: steps that overlap=True had to push again in full (see overlap).
      last_step_skipped: True when the last step() changed nothing because of inf/NaN
        gradients (found by the scaler, or by the server).
      last_push_result: the last push's PushResult (ShardedPushResult for several servers).
    """

    # GradScaler.step(opt) then calls opt.step(grad_scaler=scaler) and leaves the unscaling and
    # the inf check to the optimizer: here, to the server (see step()).
    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: Union[float, torch.Tensor] = ADAMW.lr,
                 betas=ADAMW.betas, eps: float = ADAMW.eps,
                 weight_decay: float = ADAMW.weight_decay, amsgrad: bool = ADAMW.amsgrad, *,
                 maximize: bool = ADAMW.maximize,
                 foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 targets: Union[str, Sequence[str], None] = None,
                 client: Union[Client, ShardedClient, None] = None,
                 client_options: Optional[Mapping[str, Any]] = None,
                 grad_dtype: Union[str, torch.dtype] = "float32", prefix: str = "",
                 connect_timeout: Optional[float] = 30.0, overlap: bool = False,
                 bucket_bytes: Optional[int] = None,
                 edge_bucket_bytes: Optional[int] = None, delay: int = 0,
                 delay_warmup: int = 10,
                 pull_dtype: Optional[str] = None, grad_scaler: Any = None,
                 state_dtype: str = "fp32", params_dtype: str = "fp32",
                 rounding_seed: int = 0, on_existing: str = "error",
                 model: Optional[str] = None, buffers: Any = None,
                 data_plane: str = "auto", push_during_backward: Optional[bool] = None):
        _on_existing.check_on_existing(on_existing)
        ro.check_implementation_flags(dict(foreach=foreach, fused=fused, capturable=capturable,
                                           differentiable=differentiable), "RemoteAdamW")
        wire = ro.wire_dtype(grad_dtype, "grad_dtype")
        if (targets is None) == (client is None):
            raise ValueError("give exactly one of targets= and client=")
        ro.check_overlap_options(overlap, bucket_bytes, delay, delay_warmup, pull_dtype,
                                 data_plane, edge_bucket_bytes)
        facts = ro.torch_adamw_facts(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                     amsgrad=amsgrad, maximize=maximize)
        groups = ro.named_param_groups(params)
        default_storage = ro.group_storage(dict(state_dtype=state_dtype,
                                                params_dtype=params_dtype,
                                                rounding_seed=rounding_seed), ro.Storage(),
                                           "RemoteAdamW")
        for i, g in enumerate(groups):
            ro.check_implementation_flags(g, f"param group {i}")
        self.grad_dtype = wire
        self.prefix = prefix
        self.tensor_names: List[str] = [prefix + n for g in groups for n, _ in g["params"]]
        if len(set(self.tensor_names)) != len(self.tensor_names):
            raise ValueError("a parameter name appears twice")
        torch_groups = []
        for g in groups:
            tg = dict(g)
            tg["params"] = g["params"] if facts.keeps_param_names else [p for _, p in g["params"]]
            torch_groups.append(tg)
        self._initializing = True
        super().__init__(torch_groups, facts.defaults)
        self._initializing = False
        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._pairs = list(zip(self.tensor_names, self._params))
        self._group_of: List[int] = [i for i, g in enumerate(self.param_groups)
                                     for _ in g["params"]]
        self._amsgrad: List[bool] = [bool(g["amsgrad"]) for g in self.param_groups]
        self.storage: List[ro.Storage] = [ro.group_storage(g, default_storage, f"param group {i}")
                                          for i, g in enumerate(self.param_groups)]
        # bf16 on the wire when every param is bf16 on the server (exact, half the bytes);
        # else fp32, also exact (bf16 params widened), in one pull at one version.
        self._pull_dtype = "bfloat16" if all(s.params_dtype == "bf16"
                                             for s in self.storage) else "float32"
        if pull_dtype is not None:
            self._pull_dtype = ro.wire_dtype(pull_dtype, "pull_dtype")
        self.group_names: List[str] = self._group_names(prefix)
        self._pending: Optional[ro.LoadedState] = None
        self.last_step_timings: Dict[str, float] = ro.new_timings()
        self.last_step_skipped = False
        self.last_push_result = None

        self._owns_client = client is None
        self._overlap: Optional[OverlapEngine] = None
        if client is None and overlap:
            client_options = ro.overlap_client_options(client_options)
        if model is not None:
            if client is not None:
                raise ValueError("model= is for targets=; a given client has its own model")
            client_options = dict(client_options or {}, model=model)
        if client is None:
            assert targets is not None  # exactly one of the two, checked above
            client = ro.make_client(targets, client_options)
        self.client: Union[Client, ShardedClient] = client
        try:
            if self._owns_client and connect_timeout is not None:
                self.client.wait_ready(connect_timeout)
            _on_existing.check(self.client, self.tensor_names, on_existing, logger)
            self._sent: List[ro.HyperTuple] = [ro.hyperparameters_of(g)
                                               for g in self.param_groups]
            for i, name in enumerate(self.group_names):
                ro.register_group(self.client, name, self._sent[i], self._amsgrad[i],
                                  self.storage[i])
            ro.register_tensors(self.client, self._pairs,
                                [self.group_names[g] for g in self._group_of])
            self._pull_parameters()
            self._buffers = _buffers.ModuleBuffers(self.client, () if buffers is None
                                                   else buffers, prefix)
            self._buffers.attach()
            if overlap:
                from fusedps._overlap import OverlapEngine

                self._overlap = OverlapEngine(
                    self, self._pairs, self.grad_dtype, self._pull_dtype, bucket_bytes,
                    pull_group_bytes=None, delay=delay,
                    delay_warmup=delay_warmup, data_plane=data_plane,
                    edge_bytes=edge_bucket_bytes, stored_dtype=ro.stored_wire_dtype(self.storage),
                    push_during_backward=push_during_backward)
        except BaseException:
            self.close()
            raise

    # -- torch.optim.Optimizer ------------------------------------------------------------------

    def step(self, closure: Optional[Callable[[], Any]] = None, grad_scaler: Any = None, *,
             grad_scale: Optional[float] = None):
        """One AdamW step on the server(s) for the params that have a ``.grad``.

        Args:
          closure: re-evaluates the model and returns the loss; called under
            torch.enable_grad() before anything else (as torch.optim.AdamW does).
          grad_scaler: given by ``GradScaler.step(optimizer)``; not for direct use. The
            gradients are still scaled (unless ``scaler.unscale_(optimizer)`` ran: then they
            are not divided again), so the server divides them by the scaler's scale and
            checks them for inf/NaN; its verdict goes into the scaler's record for this
            optimizer, so ``scaler.update()`` backs off after a skipped step as it would after
            torch's own check. When unscale_ already found inf/NaN the step is skipped without
            pushing.
          grad_scale: a fixed loss scale (> 0, finite) the server divides the gradients by,
            for manual loss scaling without a GradScaler (``(loss * S).backward();
            opt.step(grad_scale=S)``). Setting ``opt.grad_scale = S`` does the same for
            every step (it is also how newer torch GradScalers pass their scale); with a
            GradScaler the two scales multiply, as in torch.

        Steps: any state loaded by load_state_dict() is written to the server(s) first, with
        the current local params; hyperparameters that changed in param_groups (lr, betas,
        eps, weight_decay, maximize) are sent; the gradients of the params whose ``.grad`` is
        not None are pushed (their step counts advance; the others' do not, as in torch); then
        every param is pulled, in place. With no gradient at all nothing happens (as torch).
        With overlap=True the gradients left during backward: step() checks them against what
        was sent and commits; the pull then lands during the next forward (see overlap and
        delay in the class docstring).

        Returns:
          The closure's loss, or None.
        Raises:
          ValueError: amsgrad changed in a param group; a bad grad_scale.
          grpc.RpcError: from the server(s), as Client.push_gradients / pull_parameters; the
            params are then as before the step, or pulled, never half-written.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._overlap is not None:
            self.last_step_timings = self._overlap.step(grad_scaler, grad_scale)
            return loss
        timings = self.last_step_timings = ro.new_timings()
        self._step_in_full(self._scaling_plan(grad_scaler, grad_scale), timings)
        return loss

    def _step_in_full(self, plan: ro.ScalerPlan, timings: Dict[str, float]) -> None:
        """The step without overlap (and overlap's fallback): state and hyperparameters, the
        push of every gradient, then a pull of every param."""
        self.last_step_skipped = False
        names = [n for n, p in self._pairs if p.grad is not None]
        if not names:
            plan.report(False)
            return
        if plan.skip:
            self.last_step_skipped = True
            return
        self._before_push(timings)
        start = time.perf_counter()
        result = self._push(plan.grad_scale)
        timings["push_seconds"] = time.perf_counter() - start
        self.last_push_result = result
        ro.warn_timed_out_round(result, logger)
        self.last_step_skipped = bool(result.step_skipped)
        plan.report(self.last_step_skipped)
        start = time.perf_counter()
        self._pull_parameters()
        timings["pull_seconds"] = time.perf_counter() - start

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Only during construction: the server's tensors are registered then.

        Raises:
          NotImplementedError: after construction.
        """
        if not getattr(self, "_initializing", False):
            raise NotImplementedError("RemoteAdamW takes its param groups at construction; "
                                      "make a new optimizer to add params")
        super().add_param_group(param_group)

    @contextlib.contextmanager
    def no_sync(self):
        """overlap=True: backward passes inside the with-block push nothing (the earlier
        micro-batches of gradient accumulation, as DistributedDataParallel.no_sync); the
        gradients accumulate in ``.grad`` and the next backward outside it pushes their sum.
        Without overlap: does nothing."""
        if self._overlap is None:
            yield
            return
        previous, self._overlap.enabled = self._overlap.enabled, False
        try:
            yield
        finally:
            self._overlap.enabled = previous

    no_push = no_sync  # Its earlier name.

    def wait_parameters(self) -> None:
        """overlap=True: waits until the last step's parameters are all in the model (and, on
        a GPU, orders the current stream after their copies), and until the last commit has
        ended (delay=1: its values are installed at the next step, not here). Call it before
        reading parameters outside a forward pass. Without overlap: does nothing.

        Raises:
          FusedPSError: a pull or commit that failed.
        """
        if self._overlap is not None:
            self._overlap.wait_parameters()

    @property
    def data_plane_in_use(self) -> str:
        """With overlap: "device", "workspace" or "grpc" (see data_plane), also after close();
        "grpc" without overlap."""
        if self._overlap is not None:
            return self._overlap.data_plane
        return getattr(self, "_closed_data_plane", ("grpc", ""))[0]

    @property
    def push_during_backward_in_use(self) -> bool:
        """With overlap: whether gradients leave during backward (see push_during_backward),
        also after close(); False without overlap."""
        if self._overlap is not None:
            return self._overlap.push_during_backward
        return getattr(self, "_closed_push_during_backward", False)

    @property
    def data_plane_reason(self) -> str:
        """Why a faster data plane was not taken ("" when none was left to try)."""
        if self._overlap is not None:
            return self._overlap.data_plane_reason
        return getattr(self, "_closed_data_plane", ("grpc", "overlap=False"))[1]

    @property
    def overlap_fallbacks(self) -> int:
        """Steps overlap=True pushed again in full (0 without overlap)."""
        if self._overlap is None:
            return getattr(self, "_closed_fallbacks", 0)
        return self._overlap.fallbacks

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """overlap=True: waits for the last commit and pull, then stops the overlap worker
        (removing its hooks). Closes the client if the optimizer made it (from targets).
        Idempotent."""
        overlap: Optional[OverlapEngine] = getattr(self, "_overlap", None)
        if overlap is not None:
            self._overlap = None
            self._closed_fallbacks = overlap.fallbacks
            self._closed_data_plane = (overlap.data_plane, overlap.data_plane_reason)
            self._closed_push_during_backward = overlap.push_during_backward
            overlap.close()
        if getattr(self, "_owns_client", False) and getattr(self, "client", None) is not None:
            self.client.close()
            self._owns_client = False

    def __enter__(self) -> "RemoteAdamW":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _group_names(self, prefix: str) -> List[str]:
        names = []
        for i, g in enumerate(self.param_groups):
            name = g.get("name", f"{prefix}group{i}")
            if not isinstance(name, str) or not name:
                raise TypeError(f"param group {i}: 'name' must be a non-empty str, got "
                                f"{name!r}")
            names.append(name)
        if len(set(names)) != len(names):
            raise ValueError(f"two param groups have the same name: {names}")
        return names

    def _pull_parameters(self) -> None:
        """Pulls every param into the model, in place (see _pull_dtype)."""
        self.client.pull_parameters(self._pairs, dtype=self._pull_dtype)

    def _check_amsgrad(self) -> None:
        for i, g in enumerate(self.param_groups):
            if bool(g["amsgrad"]) != self._amsgrad[i]:
                raise ValueError(f"param group {i}: amsgrad cannot change after construction "
                                 "(the server keeps max_exp_avg_sq or not from registration)")

    def _changed_hyperparameters(self, mark: bool = False) -> List[Tuple[int, ro.HyperTuple]]:
        """(group index, hyperparameters) of each group whose values differ from the last
        ones sent or queued to be sent; ``mark`` records them as queued (the overlap engine's
        worker sends them in order; forget_sent_hyperparameters() if that fails)."""
        changed = []
        for i, g in enumerate(self.param_groups):
            h = ro.hyperparameters_of(g)
            if h != self._sent[i]:
                changed.append((i, h))
                if mark:
                    self._sent[i] = h
        return changed

    def _send_hyperparameters(self, changed: Optional[List[Tuple[int, ro.HyperTuple]]] = None,
                              mark: bool = True) -> None:
        """set_hyperparameters for each changed group (_changed_hyperparameters() when
        None), recording each as sent unless ``mark`` is False (marked when queued)."""
        for i, h in self._changed_hyperparameters() if changed is None else changed:
            self.client.set_hyperparameters(self.group_names[i], **ro.hyperparameter_kwargs(h))
            if mark:
                self._sent[i] = h

    def _forget_sent_hyperparameters(self) -> None:
        """After a failed send of queued ones: the next step sends every group's."""
        self._sent = [None] * len(self._sent)  # type: ignore[list-item]

    def _scaling_plan(self, grad_scaler: Any, grad_scale: Optional[float]) -> ro.ScalerPlan:
        own = ro.check_grad_scale(grad_scale)
        attr_scale = getattr(self, "grad_scale", None)
        if own is None and attr_scale is not None:
            own = ro.attribute_plan(attr_scale, None).grad_scale
        if grad_scaler is not None:
            return ro.scaler_plan(grad_scaler, self, own)
        plan = ro.attribute_plan(own, getattr(self, "found_inf", None))
        plan.grad_scale = ro.check_grad_scale(plan.grad_scale)
        return plan

    def _before_push(self, timings: Dict[str, float]) -> None:
        """What comes before a step's first push: the amsgrad check, a pending load_state_dict
        and changed hyperparameters, each timed into ``timings``."""
        self._check_amsgrad()
        if self._pending is not None:
            start = time.perf_counter()
            self.write_pending_state()
            timings["load_state_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        self._send_hyperparameters()
        timings["hyperparameters_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        self._buffers.send(self._buffers.snapshot())
        timings["buffers_seconds"] = time.perf_counter() - start

    def _push(self, grad_scale: Optional[float]):
        """Pushes the gradient of every param that has one."""
        with_grad = [(n, p) for n, p in self._pairs if p.grad is not None]
        return self.client.push_gradients(with_grad, grad_dtype=self.grad_dtype,
                                          grad_scale=grad_scale)

