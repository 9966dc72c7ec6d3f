#!/usr/bin/env python3
"""Trains a small byte-level GPT on the Jargon File, with torch.optim.AdamW or through fusedps.

With --optimizer torch the AdamW step is torch.optim.AdamW in this process; with
--optimizer remote it is fusedps.torch.RemoteAdamW: every step pushes the gradients to the
server(s), which apply AdamW to their fp32 master copy, and pulls the new parameters back into
the model. The initial weights, the batches and the lr schedule depend only on --seed and the
flags, so two runs that differ only in --optimizer do the same math, and
bench/compare_gpt_curves.py puts their --log-json files side by side. The curves match to the
last bits only for a while: the server's AdamW rounds differently from torch's in the last
ulp, and training amplifies that (fp32 on an H100 with --deterministic: equal to 1e-6 for 50
steps, 1e-2 apart from step ~100 on, as far apart as two torch runs without --deterministic).

Presets (parameters, the tied embedding counted once): tiny 0.12M (2 layers, d_model 64, 4
heads, context 64), small 19.2M (the default: 6 layers, 512, 8 heads, context 256), medium
39.7M (8 layers, 640, 10 heads, context 256). The corpus is small: 1000 steps of the small
preset are ~10 epochs; the val loss is lowest near there (~1.45 nats per byte) and rises with
more steps. Weight decay applies to every parameter (one param group, the same in both
optimizers).

    /usr/bin/python3 examples/train_gpt.py --preset tiny --steps 200 --optimizer torch
    PYTHONPATH=build/python /usr/bin/python3 examples/train_gpt.py --preset tiny \\
        --optimizer remote --target 127.0.0.1:50051
    python3 examples/train_gpt.py --device cuda --amp bf16 --optimizer remote \\
        --target 127.0.0.1:50051 --data ./jargon.txt.gz --log-json remote.jsonl

Corpus: the Jargon File 4.4.7 (Eric S. Raymond et al., public domain), as Debian bookworm's
package jargon-text (section main) installs it: /usr/share/doc/jargon-text/jargon.txt.gz,
648 KB gzip, 1,681,817 bytes of UTF-8 text (about 1.6 MiB, 99.6% ASCII) once decompressed:
some 2,300 entries of English prose about hacker culture, with usage notes and quotations.
Chosen because it is one plain-text file of real running prose under no restrictions.
bible-kjv-text ships its text in the "EC02" compressed binary format of its own reader, and
fortunes / fortunes-min are some 60 files of short quotations (2.4 MB together, several
licences). --data takes any copy of the file, plain or gzip-compressed (read by its magic
bytes, whatever its name), or any other text file.

Tokens: bytes (vocabulary 256, no download). Split: the last --val-fraction (5%) of the bytes is
the validation set, the rest the training set. A batch is --batch-size windows of context + 1
bytes at offsets drawn from a torch.Generator seeded with --seed + 1 (inputs: the first
context bytes, targets: the last context bytes); the validation loss is the mean over
--eval-batches batches drawn from a generator seeded with --seed + 2, the same at every eval.

--log-json PATH writes JSON lines: one {"kind": "config", ...}; per step {"kind": "step", "step",
"loss", "lr", "data_seconds", "fwd_bwd_seconds", "optimizer_seconds", "item_seconds",
"push_seconds", "pull_seconds", "hyperparameters_seconds", "step_seconds"}; per eval {"kind":
"eval", "step", "val_loss"}; and a last {"kind": "summary", ...}. Losses are mean
cross-entropy in nats per byte; times are seconds of wall clock. On CUDA each phase ends when
the loop's own stream has done its work (--timing-sync stream, the default): work queued on
other streams, such as RemoteAdamW's gradient copies, goes on behind the next phase, as it does
in a loop that is not timed, and the next step() waits for it. --timing-sync device waits for
every stream instead, so such work counts in the phase that queued it (the timing of runs
before 2026-11-29). data is the batch's sampling and copy to the device;
push/pull/hyperparameters come from RemoteAdamW.last_step_timings (0 with --optimizer torch);
optimizer_seconds is all of optimizer.step(); item_seconds is the loss's loss.item() after it;
"other" in the summary is step - fwd_bwd - push - pull (so it holds the data, torch's local
AdamW, the lr schedule, the loss.item()).

--state-dtype bf16|int8 and --params-dtype bf16 (with --optimizer remote) have the server
store the optimizer state, or the params, in less memory (docs/python.md, "Low-precision
optimizer state"); --seed also seeds the bf16 params' stochastic rounding.

The last line of the output is "RESULT {json}": final_train_loss (the last step's),
train_loss_last5, final_val_loss, test_accuracy (null: a language model has none), steps,
step_ms, optimizer, preset, state_dtype, params_dtype, grad_dtype and seed.

Exit status: 0; 1 when --expect-loss-below or --expect-loss-drop is not met; 2 on bad input
(a missing corpus, CUDA or fusedps not available, a storage option with --optimizer torch).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

try:  # The model lives in the fusedps package (the self-check trains it too).
    from fusedps.bench.gpt import GPT, HAS_SDPA, GPTConfig
    from fusedps.bench.timing import synchronize as sync_device
except ImportError as e:
    sys.exit(f"error: {e}: run with PYTHONPATH=build/python (or wherever the fusedps client is "
             "built or installed)")

CORPUS_PACKAGE = "jargon-text"
DEFAULT_DATA = "/usr/share/doc/jargon-text/jargon.txt.gz"

# Model and training defaults per preset; the flags of the same names override them.
PRESETS = {
    # ~0.12M parameters: the ctest smoke test (20 steps), CPU runs (200 steps: ~40 s, 2 cores).
    "tiny": dict(n_layer=2, d_model=64, n_head=4, context=64, batch_size=16, lr=3e-3, steps=200,
                 eval_every=50, eval_batches=8),
    # ~19.2M parameters (the default): GPU runs.
    "small": dict(n_layer=6, d_model=512, n_head=8, context=256, batch_size=64, lr=1e-3,
                  steps=1000, eval_every=250, eval_batches=20),
    # ~39.7M parameters.
    "medium": dict(n_layer=8, d_model=640, n_head=10, context=256, batch_size=64, lr=6e-4,
                   steps=1000, eval_every=250, eval_batches=20),
    # ~85.4M parameters: GPT-2 small's shape (12 layers, d_model 768) over bytes.
    "gpt2": dict(n_layer=12, d_model=768, n_head=12, context=256, batch_size=64, lr=6e-4,
                 steps=1000, eval_every=250, eval_batches=20),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=DEFAULT_DATA,
                   help=f"the corpus, plain or gzip text (default: {DEFAULT_DATA}, from the "
                        f"Debian package {CORPUS_PACKAGE})")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--n-layer", type=int)
    p.add_argument("--d-model", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--context", type=int, help="sequence length in bytes")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="default 0, so that runs with either optimizer are the same math")
    p.add_argument("--optimizer", default="torch", choices=["torch", "remote"])
    p.add_argument("--target", action="append", default=[],
                   help="fusedps server host:port for --optimizer remote; repeat it or give a "
                        "comma list for shards (default 127.0.0.1:50051)")
    p.add_argument("--grad-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="gradient wire dtype; with --optimizer torch the gradients are rounded "
                        "to it too, so both runs see the same gradients")
    p.add_argument("--prefix", default="gpt.", help="tensor name prefix on the server")
    p.add_argument("--streams", type=int,
                   help="concurrent streams of the fusedps client (client_options['streams'])")
    p.add_argument("--overlap", action="store_true",
                   help="--optimizer remote: RemoteAdamW(overlap=True), the push during "
                        "backward and the pull during the next forward")
    p.add_argument("--delay", type=int, default=0, choices=[0, 1],
                   help="with --overlap: 1 for the one-step-delayed update (staleness 1)")
    p.add_argument("--delay-warmup", type=int, default=10,
                   help="with --delay 1: steps without delay first")
    p.add_argument("--pull-dtype", choices=["float32", "bfloat16"],
                   help="with --overlap: the dtype parameters are pulled in (default float32)")
    p.add_argument("--data-plane", default="auto",
                   choices=["auto", "device", "workspace", "grpc"],
                   help="with --overlap: where the bytes travel (RemoteAdamW's data_plane; "
                        "auto: a same-host workspace when the server offers one, on a GPU a "
                        "device one first)")
    p.add_argument("--bucket-mib", type=float,
                   help="with --overlap: gradient bucket size, MiB of wire bytes (default: "
                        "RemoteAdamW's, 32 through a workspace, 8 over gRPC)")
    p.add_argument("--edge-bucket-mib", type=float,
                   help="with --overlap: the last gradient bucket's and the first pull "
                        "group's size, MiB (RemoteAdamW's edge_bucket_bytes; default 4; 0: "
                        "all --bucket-mib)")
    p.add_argument("--push-during-backward", default="auto", choices=["auto", "on", "off"],
                   help="with --overlap: gradients leave during backward (on) or all at "
                        "step() (off); auto: RemoteAdamW's default (off on a device "
                        "workspace)")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine decays to lr * this at the last step")
    p.add_argument("--warmup-steps", type=int,
                   help="linear warmup steps (default min(100, steps // 10))")
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=0.0,
                   help="clip the global gradient norm to this before each step (0: off)")
    p.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16", "int8"],
                   help="--optimizer remote: how the server stores exp_avg and exp_avg_sq")
    p.add_argument("--params-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="--optimizer remote: the server's params, fp32 or bf16 (stochastic "
                        "rounding)")
    p.add_argument("--seed", type=int, default=0,
                   help="weights, batches, and the bf16 params' rounding")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--amp", default="none", choices=["none", "bf16"],
                   help="bf16: torch.autocast for forward and loss on CUDA")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms (and CUBLAS_WORKSPACE_CONFIG): "
                        "on CUDA, two runs of the same flags give the same losses")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, help="steps between val evals (0: only at the end)")
    p.add_argument("--eval-batches", type=int)
    p.add_argument("--timing-sync", default="stream", choices=["stream", "device"],
                   help="on CUDA, where each timed phase ends: when the loop's stream is done "
                        "(default) or every stream of the device (see --log-json)")
    p.add_argument("--timing-warmup", type=int, default=5,
                   help="first steps left out of the mean times (never all of them)")
    p.add_argument("--log-every", type=int, default=10, help="print every N steps")
    p.add_argument("--log-json", help="write JSON lines of per-step records here")
    p.add_argument("--sample-bytes", type=int, default=200,
                   help="bytes of text to generate at the end (0: none)")
    p.add_argument("--expect-loss-below", type=float,
                   help="exit 1 unless the mean train loss of the last 5 steps is below this")
    p.add_argument("--expect-loss-drop", type=float,
                   help="exit 1 unless the mean train loss of the last 5 steps is at least this "
                        "much (nats) below the first step's")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup_steps is None:
        args.warmup_steps = min(100, args.steps // 10)
    args.targets = [t.strip() for arg in args.target for t in arg.split(",") if t.strip()]
    if not args.targets:
        args.targets = ["127.0.0.1:50051"]
    return args


class UsageError(Exception):
    """Bad input the user can fix; main() prints it and exits 2."""


def load_corpus(path: str) -> torch.Tensor:
    """Reads the corpus as bytes: uint8 [n_bytes]. Gzip is recognised by its magic bytes."""
    if not os.path.isfile(path):
        raise UsageError(
            f"corpus not found: {path}; the default corpus {DEFAULT_DATA} comes from the "
            f"Debian package {CORPUS_PACKAGE} (`apt-get install {CORPUS_PACKAGE}`); on a "
            "machine without apt, copy that file there and pass --data COPY")
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4096:
        raise UsageError(f"corpus {path} has only {len(raw)} bytes")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def split_corpus(data: torch.Tensor, val_fraction: float, context: int):
    """(train, val): the leading and trailing bytes, uint8 [n]; each longer than context."""
    n_val = int(len(data) * val_fraction)
    if n_val <= context + 1 or len(data) - n_val <= context + 1:
        raise UsageError(f"corpus of {len(data)} bytes is too short for --context {context} "
                         f"and --val-fraction {val_fraction}")
    return data[:-n_val], data[-n_val:]


def sample_batch(data: torch.Tensor, batch_size: int, context: int,
                 generator: torch.Generator):
    """Random windows of data: (inputs, targets), int64 [batch_size, context] each, on data's
    device. The offsets come from the CPU generator (the same on every device); the windows
    are gathered where the corpus is, so that a GPU run does no per-step CPU tensor work that
    other threads (a fusedps client's) would slow down."""
    starts = torch.randint(0, len(data) - context, (batch_size,), generator=generator)
    offsets = starts.to(data.device).view(-1, 1) + torch.arange(context + 1, device=data.device)
    windows = data[offsets].long()
    return windows[:, :-1], windows[:, 1:]


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float):
    """LambdaLR factor of the step index i (0-based): linear warmup, then cosine to min_ratio."""
    def factor(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        progress = min(1.0, (i - warmup_steps) / max(1, total_steps - warmup_steps - 1))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def make_optimizer(args, model: torch.nn.Module) -> torch.optim.Optimizer:
    hyper = dict(lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                 weight_decay=args.weight_decay)
    if args.optimizer == "torch":
        if (args.state_dtype, args.params_dtype) != ("fp32", "fp32") or args.overlap:
            raise UsageError("--state-dtype, --params-dtype and --overlap are for "
                             "--optimizer remote")
        return torch.optim.AdamW(model.parameters(), **hyper)
    try:
        from fusedps.torch import RemoteAdamW
    except ImportError as e:
        raise UsageError(f"--optimizer remote needs fusedps.torch ({e}); run with "
                         "PYTHONPATH=build/python (or wherever the client is built)") from None
    targets = args.targets[0] if len(args.targets) == 1 else args.targets
    client_options = {} if args.streams is None else {"streams": args.streams}
    overlap = {}
    if args.overlap:
        overlap = dict(overlap=True, delay=args.delay, delay_warmup=args.delay_warmup,
                       pull_dtype=args.pull_dtype, data_plane=args.data_plane,
                       bucket_bytes=(None if args.bucket_mib is None
                                     else int(args.bucket_mib * (1 << 20))))
        if args.push_during_backward != "auto":
            overlap["push_during_backward"] = args.push_during_backward == "on"
        if args.edge_bucket_mib is not None:
            overlap["edge_bucket_bytes"] = int(args.edge_bucket_mib * (1 << 20))
    return RemoteAdamW(model.named_parameters(), targets=targets, grad_dtype=args.grad_dtype,
                       client_options=client_options, prefix=args.prefix,
                       state_dtype=args.state_dtype, params_dtype=args.params_dtype,
                       rounding_seed=args.seed, **overlap, **hyper)


def round_grads(model: torch.nn.Module, grad_dtype: str) -> None:
    """Rounds every .grad to the wire dtype and back (what the server receives), in place."""
    if grad_dtype == "float32":
        return
    dt = getattr(torch, grad_dtype)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.copy_(p.grad.to(dt))


def synchronize(device: torch.device, args) -> None:
    sync_device(device, every_stream=args.timing_sync == "device")


def autocast(args):
    if args.amp == "bf16":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def loss_of(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, args):
    """Mean cross-entropy (nats per byte), a float32 scalar tensor."""
    with autocast(args):
        logits = model(inputs)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, args, device) -> float:
    """Mean loss over args.eval_batches val batches, the same batches every call."""
    model.eval()
    generator = torch.Generator().manual_seed(args.seed + 2)
    total = 0.0
    for _ in range(args.eval_batches):
        inputs, targets = sample_batch(val, args.batch_size, args.context, generator)
        total += loss_of(model, inputs.to(device), targets.to(device), args).item()
    model.train()
    return total / args.eval_batches


class JsonLog:
    """Appends one JSON object per line to a file (or nowhere when path is None)."""

    def __init__(self, path):
        self.file = open(path, "w") if path else None

    def write(self, kind: str, **fields) -> None:
        if self.file:
            self.file.write(json.dumps({"kind": kind, **fields}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def check_device(args) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch.cuda.is_available() is False")
    if args.amp == "bf16" and args.device != "cuda":
        raise UsageError("--amp bf16 is for --device cuda")
    if args.deterministic:
        # Read by cuBLAS when its first handle is made, so before any CUDA work.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return torch.device(args.device)


def train_step(model, optimizer, scheduler, train, batch_gen, args, device) -> dict:
    """One optimizer step; returns its record (loss in nats, times in seconds)."""
    t_start = time.perf_counter()
    inputs, targets = sample_batch(train, args.batch_size, args.context, batch_gen)
    inputs, targets = inputs.to(device), targets.to(device)
    data_seconds = time.perf_counter() - t_start
    lr = optimizer.param_groups[0]["lr"]
    optimizer.zero_grad(set_to_none=True)
    synchronize(device, args)
    t_fwd = time.perf_counter()
    loss = loss_of(model, inputs, targets, args)
    loss.backward()
    synchronize(device, args)
    fwd_bwd = time.perf_counter() - t_fwd
    if args.clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    if args.optimizer == "torch":
        round_grads(model, args.grad_dtype)
    synchronize(device, args)
    t_opt = time.perf_counter()
    optimizer.step()
    synchronize(device, args)
    opt_seconds = time.perf_counter() - t_opt
    # The loss as a loop logs it: a small device-to-host copy, which waits for a free copy
    # engine (behind a large copy that fusedps queued, say).
    t_item = time.perf_counter()
    loss_value = loss.item()
    item_seconds = time.perf_counter() - t_item
    scheduler.step()
    timings = getattr(optimizer, "last_step_timings", None) or {}
    return dict(loss=loss_value, lr=lr, data_seconds=data_seconds, fwd_bwd_seconds=fwd_bwd,
                optimizer_seconds=opt_seconds, item_seconds=item_seconds,
                step_seconds=time.perf_counter() - t_start,
                **{key: float(timings.get(key, 0.0)) for key in TIMING_KEYS})


# RemoteAdamW.last_step_timings kept per step (0 with --optimizer torch). With --overlap the
# pull that the forward waited for is the one the previous step started.
TIMING_KEYS = ("push_seconds", "pull_seconds", "hyperparameters_seconds", "push_exposed_seconds",
               "push_hidden_seconds", "pull_exposed_seconds", "pull_hidden_seconds",
               "check_seconds")


def summarize(records, val_loss: float, args) -> dict:
    """Final losses and mean milliseconds per step (after the timing warmup)."""
    skip = min(args.timing_warmup, len(records) - 1)
    timed = records[skip:]

    def mean_ms(key):
        return 1e3 * sum(r[key] for r in timed) / len(timed)

    last = [r["loss"] for r in records[-5:]]
    step_ms = mean_ms("step_seconds")
    split = dict(fwd_bwd_ms=mean_ms("fwd_bwd_seconds"), push_ms=mean_ms("push_seconds"),
                 pull_ms=mean_ms("pull_seconds"))
    overlap = {key.replace("_seconds", "_ms"): mean_ms(key) for key in TIMING_KEYS[3:]}
    if args.overlap:
        # Pushes and pulls ran beside the forward and backward: the step's own time is its
        # compute plus what was exposed.
        split["push_ms"], split["pull_ms"] = overlap["push_exposed_ms"], 0.0
    return dict(steps=len(records), first_loss=records[0]["loss"],
                final_train_loss=records[-1]["loss"], train_loss_last5=sum(last) / len(last),
                val_loss=val_loss, timed_steps=len(timed), step_ms=step_ms,
                data_ms=mean_ms("data_seconds"), optimizer_ms=mean_ms("optimizer_seconds"),
                item_ms=mean_ms("item_seconds"),
                hyperparameters_ms=mean_ms("hyperparameters_seconds"),
                other_ms=step_ms - sum(split.values()), **split,
                push_total_ms=mean_ms("push_seconds"), pull_total_ms=mean_ms("pull_seconds"),
                **overlap)


def print_sample(model, val: torch.Tensor, args, device) -> None:
    prompt = val[:32].long().to(device)
    generator = torch.Generator(device=device).manual_seed(args.seed + 3)
    model.eval()
    with autocast(args):
        out = model.generate(prompt, args.sample_bytes, generator)
    model.train()
    text = bytes(out.cpu().to(torch.uint8).tolist()).decode("utf-8", errors="replace")
    print(f"--- sample ({len(prompt)} bytes of val as the prompt, then {args.sample_bytes} "
          f"generated) ---\n{text}\n---")


def check_expectations(summary: dict, args) -> int:
    final = summary["train_loss_last5"]
    if args.expect_loss_below is not None and not final < args.expect_loss_below:
        print(f"FAIL: train loss of the last 5 steps {final:.4f} is not below "
              f"{args.expect_loss_below}", file=sys.stderr)
        return 1
    drop = summary["first_loss"] - final
    if args.expect_loss_drop is not None and not drop >= args.expect_loss_drop:
        print(f"FAIL: train loss fell by {drop:.4f} (from {summary['first_loss']:.4f} to "
              f"{final:.4f}), less than {args.expect_loss_drop}", file=sys.stderr)
        return 1
    return 0


def train(args) -> int:
    device = check_device(args)
    data = load_corpus(args.data)
    train_data, val_data = split_corpus(data, args.val_fraction, args.context)
    train_data, val_data = train_data.to(device), val_data.to(device)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                    context=args.context, dropout=args.dropout)
    model = GPT(cfg).to(device)  # built on CPU: the same weights on every device
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(set(names)) == len(list(model.parameters())), names
    optimizer = make_optimizer(args, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.warmup_steps, args.steps, args.min_lr_ratio))
    batch_gen = torch.Generator().manual_seed(args.seed + 1)

    n_params = model.num_parameters()
    corpus_sha = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    transport = getattr(getattr(optimizer, "client", None), "transport_in_use", None)
    where = ""
    if args.optimizer == "remote":
        where = f" via {','.join(args.targets)}" + (f" ({transport} transport)"
                                                     if transport else "")
    print(f"corpus {args.data}: {len(data)} bytes ({len(train_data)} train, {len(val_data)} "
          f"val), sha256 {corpus_sha[:12]}")
    print(f"model {args.preset}: {n_params / 1e6:.3f}M parameters, {cfg.n_layer} layers, "
          f"d_model {cfg.d_model}, {cfg.n_head} heads, context {cfg.context}; attention "
          f"{'sdpa' if HAS_SDPA else 'masked matmul'}; torch {torch.__version__} on {device}")
    print(f"optimizer {args.optimizer}{where}: AdamW lr {args.lr} (warmup {args.warmup_steps}, "
          f"cosine to x{args.min_lr_ratio}), betas ({args.beta1}, {args.beta2}), weight decay "
          f"{args.weight_decay}, grad dtype {args.grad_dtype}, state {args.state_dtype}, "
          f"params {args.params_dtype}; {args.steps} steps of {args.batch_size} x "
          f"{args.context} bytes")
    log = JsonLog(args.log_json)
    log.write("config", args=vars(args), n_params=n_params, corpus_bytes=len(data),
              corpus_sha256=corpus_sha, torch_version=torch.__version__, sdpa=HAS_SDPA,
              transport=transport,
              device_name=(torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu"))

    records = []
    val_loss = float("nan")
    try:
        for step in range(1, args.steps + 1):
            record = train_step(model, optimizer, scheduler, train_data, batch_gen, args,
                                device)
            if not math.isfinite(record["loss"]):
                raise RuntimeError(f"loss is {record['loss']} at step {step}")
            records.append(record)
            log.write("step", step=step, **record)
            if step % args.log_every == 0 or step == 1:
                print(f"step {step:5d}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                      f"{1e3 * record['step_seconds']:.1f} ms (fwd+bwd "
                      f"{1e3 * record['fwd_bwd_seconds']:.1f}, push "
                      f"{1e3 * record['push_seconds']:.1f}, pull "
                      f"{1e3 * record['pull_seconds']:.1f})")
            if step == args.steps or (args.eval_every and step % args.eval_every == 0):
                val_loss = evaluate(model, val_data, args, device)
                log.write("eval", step=step, val_loss=val_loss)
                print(f"step {step:5d}  val loss {val_loss:.4f}")
        summary = summarize(records, val_loss, args)
        log.write("summary", **summary)
    finally:
        log.close()
        close = getattr(optimizer, "close", None)
        if callable(close):
            close()
    print(f"final: train loss {summary['final_train_loss']:.4f} (last 5 steps "
          f"{summary['train_loss_last5']:.4f}), val loss {summary['val_loss']:.4f}; ms per step "
          f"{summary['step_ms']:.2f} = fwd+bwd {summary['fwd_bwd_ms']:.2f} + push "
          f"{summary['push_ms']:.2f} + pull {summary['pull_ms']:.2f} + other "
          f"{summary['other_ms']:.2f} (mean of steps {args.steps - summary['timed_steps'] + 1}"
          f"..{args.steps})")
    if args.overlap:
        print(f"overlap: push {summary['push_total_ms']:.2f} ms per step (hidden "
              f"{summary['push_hidden_ms']:.2f}, exposed {summary['push_exposed_ms']:.2f}), pull "
              f"{summary['pull_total_ms']:.2f} (hidden {summary['pull_hidden_ms']:.2f}, exposed "
              f"{summary['pull_exposed_ms']:.2f}, inside fwd+bwd), check "
              f"{summary['check_ms']:.2f}; fallbacks {optimizer.overlap_fallbacks}; data plane "
              f"{optimizer.data_plane_in_use}"
              f"{' (' + optimizer.data_plane_reason + ')' if optimizer.data_plane_reason else ''}")
    if args.sample_bytes > 0:
        print_sample(model, val_data, args, device)
    print("RESULT " + json.dumps(dict(
        final_train_loss=summary["final_train_loss"],
        train_loss_last5=summary["train_loss_last5"], final_val_loss=summary["val_loss"],
        test_accuracy=None, steps=summary["steps"], step_ms=summary["step_ms"],
        optimizer=args.optimizer, preset=args.preset, state_dtype=args.state_dtype,
        params_dtype=args.params_dtype, grad_dtype=args.grad_dtype, seed=args.seed,
        overlap=args.overlap, delay=args.delay)),
        flush=True)
    return check_expectations(summary, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
