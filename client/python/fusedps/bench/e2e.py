"""``python -m fusedps.bench e2e``: is training through these servers as fast as training here?

Trains a small GPT (fusedps.bench.gpt) on random bytes twice in one process, on the same device:
with torch.optim.AdamW, then with fusedps.torch.RemoteAdamW(overlap=True) through the servers
given, and prints the step time of each (means over the timed steps), the ratio, the remote
step's split (forward+backward, push and pull, each hidden behind compute or exposed), its time
over local's in three parts (the forward and backward slowed beside fusedps's work, the wait
for the pull, step()) and which part limits it: an exposed link, or that compute. Random
bytes: the speed of a step does not depend on the data.

    python -m fusedps.bench e2e --target 127.0.0.1:50051
    python -m fusedps.bench e2e --target HOST:PORT --preset gpt2 --grad-dtype bfloat16 --delay 1

The remote run registers the model under the prefix ``fusedps-selfcheck/<preset>/`` with fp32
storage; a run again resumes from those tensors (``on_existing="resume"``: the speed of a step
does not depend on their values; nothing deletes them until the server restarts).
Exit status 0, 2 on bad arguments or servers that cannot be reached.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Dict, List

import torch

from fusedps import _dtypes
from fusedps.bench.gpt import GPT, GPTConfig
from fusedps.bench.timing import synchronize

PRESETS = {
    "tiny": dict(n_layer=2, d_model=64, n_head=4, context=64, batch_size=16),
    "small": dict(n_layer=6, d_model=512, n_head=8, context=256, batch_size=64),  # 19.2M
    "gpt2": dict(n_layer=12, d_model=768, n_head=12, context=256, batch_size=32),  # 85.5M
}


# The limit when the forward and backward slowed beside fusedps more than any wait cost.
COMPUTE = "compute beside fusedps"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fusedps.bench e2e",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True,
                   help="host:port of the server, or a comma list of shards")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=30, help="timed steps of each run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "none"],
                   help="bf16 autocast (auto: on CUDA)")
    p.add_argument("--grad-dtype", default="float32", choices=_dtypes.PULL_DTYPES)
    p.add_argument("--pull-dtype", default=None, choices=_dtypes.PULL_DTYPES)
    p.add_argument("--delay", type=int, default=0, choices=[0, 1])
    p.add_argument("--streams", type=int, default=None, help="client streams (default 8)")
    p.add_argument("--bucket-mib", type=float,
                   help="RemoteAdamW's bucket_bytes in MiB (default: RemoteAdamW's)")
    p.add_argument("--push-during-backward", default="auto", choices=["auto", "on", "off"],
                   help="gradients leave during backward (on) or all at step() (off); auto: "
                        "RemoteAdamW's default (off on a device workspace)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p.parse_args(argv)


def copy_rates(device: torch.device) -> Dict[str, float]:
    """GB/s of pinned device-to-host and host-to-device copies of 256 MiB (CUDA only)."""
    if device.type != "cuda":
        return {}
    n = 64 << 20
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(n, dtype=torch.float32, device=device)
    rates = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        synchronize(device, every_stream=True)
        start = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        synchronize(device, every_stream=True)
        rates[name] = 3 * n * 4 / (time.perf_counter() - start) / 1e9
    return rates


def run(args, device, model, optimizer, amp: bool) -> List[Dict[str, float]]:
    """Trains; returns per timed step the wall time, forward+backward and the optimizer's
    timings (seconds)."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(1)
    records = []
    autocast = (torch.autocast(device_type="cuda", dtype=torch.bfloat16) if amp
                else contextlib.nullcontext())
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.context + 1),
                               generator=gen).to(device)
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        synchronize(device)
        fwd_bwd = time.perf_counter() - start
        optimizer.step()
        synchronize(device)
        if step >= args.warmup:
            record = dict(step_seconds=time.perf_counter() - start, fwd_bwd_seconds=fwd_bwd)
            record.update(getattr(optimizer, "last_step_timings", None) or {})
            records.append(record)
    return records


def mean(records, key: str) -> float:
    """ms: the mean over the timed steps. Means, not medians, so that the parts printed add up
    (a push's hidden and exposed time to its total, the parts over local to the difference)."""
    return statistics.fmean(r.get(key, 0.0) for r in records) * 1e3


def report(args, device, n_params: int, local, remote, rates, info) -> Dict:
    step_l, step_r = mean(local, "step_seconds"), mean(remote, "step_seconds")
    grad_bytes = n_params * _dtypes.element_size(args.grad_dtype)
    pull_bytes = n_params * _dtypes.element_size(args.pull_dtype or "float32")
    split = {k: mean(remote, k + "_seconds") for k in (
        "fwd_bwd", "push", "push_hidden", "push_exposed", "pull", "pull_hidden",
        "pull_exposed", "check", "step_wait")}
    push_ms, pull_ms = split["push"], split["pull"]
    local_fwd_bwd = mean(local, "fwd_bwd_seconds")
    # The remote step's time over local's, in three parts: the forward and backward beyond
    # local's, less the forward's wait for the pull (fusedps's work beside the loop: its hooks,
    # copies and pulls share the trainer's CPU and GPU with it); that wait; and step() (with
    # the rest of the loop) beyond local's.
    over = {"beside": split["fwd_bwd"] - split["pull_exposed"] - local_fwd_bwd,
            "pull_wait": split["pull_exposed"],
            "step": (step_r - split["fwd_bwd"]) - (step_l - local_fwd_bwd)}
    limits = {"push": split["push_exposed"], "pull": split["pull_exposed"],
              "the gradient check": split["check"], COMPUTE: over["beside"]}
    worst = max(limits, key=lambda k: limits[k])
    push_rate = grad_bytes / (push_ms / 1e3) / 1e9 if push_ms else 0.0
    pull_rate = pull_bytes / (pull_ms / 1e3) / 1e9 if pull_ms else 0.0
    return dict(
        preset=args.preset, params=n_params, device=str(device), server=info,
        grad_dtype=args.grad_dtype, pull_dtype=args.pull_dtype or "float32", delay=args.delay,
        local_ms=step_l, remote_ms=step_r, ratio=step_r / step_l,
        local_fwd_bwd_ms=local_fwd_bwd, split_ms=split, over_local_ms=over, push_gb_s=push_rate,
        pull_gb_s=pull_rate, copy_gb_s=rates, limit=worst,
        limit_ms=limits[worst], exposed_ms=step_r - split["fwd_bwd"] + split["pull_exposed"])


def print_report(r: Dict) -> None:
    s = r["split_ms"]
    print(f"fusedps self-check: GPT {r['preset']} ({r['params'] / 1e6:.1f}M params) on "
          f"{r['device']}; server {r['server']}; grads {r['grad_dtype']}, pulls "
          f"{r['pull_dtype']}, delay {r['delay']}")
    print(f"{'':24}{'ms/step':>9}{'vs local':>10}{'fwd+bwd':>9}   push hidden/exposed"
          f"   pull hidden/exposed")
    print(f"{'torch.optim.AdamW':24}{r['local_ms']:9.2f}{1.0:9.2f}x{r['local_fwd_bwd_ms']:9.2f}")
    print(f"{'RemoteAdamW overlap':24}{r['remote_ms']:9.2f}{r['ratio']:9.2f}x{s['fwd_bwd']:9.2f}"
          f"   {s['push']:6.2f} = {s['push_hidden']:5.2f} / {s['push_exposed']:5.2f}"
          f"   {s['pull']:6.2f} = {s['pull_hidden']:5.2f} / {s['pull_exposed']:5.2f}")
    rates = r["copy_gb_s"]
    copies = (f"; pinned copies D2H {rates['d2h']:.1f} GB/s, H2D {rates['h2d']:.1f} GB/s"
              if rates else "")
    plane = r.get("data_plane", "grpc")
    reason = r.get("data_plane_reason", "")
    when = ("during backward" if r.get("push_during_backward", True) else
            "at step() (no gradient hooks)")
    print(f"data plane: {plane}" + (f" ({reason})" if reason else "") + f"; gradients pushed "
          f"{when}")
    path = {"workspace": "same-host workspace",
            "device": "same-host device workspace"}.get(plane, "gRPC")
    print(f"links: {path} push {r['push_gb_s']:.2f} GB/s, pull {r['pull_gb_s']:.2f} GB/s"
          f"{copies}")
    o = r["over_local_ms"]
    print(f"over local: {r['remote_ms'] - r['local_ms']:+.2f} ms per step = forward+backward "
          f"beside fusedps {o['beside']:+.2f}, waiting for the pull {o['pull_wait']:+.2f}, "
          f"step() {o['step']:+.2f}")
    if r["limit"] == COMPUTE:
        beside = ("hooks, copies and pulls" if r.get("push_during_backward", True) else
                  "pull and its copies")
        print(f"limit: {COMPUTE}: the forward and backward took {r['limit_ms']:.2f} ms per step "
              f"more than local's while fusedps's {beside} ran beside them (the "
              f"loop waited {r['exposed_ms']:.2f} ms for fusedps itself); a loop bound by its "
              f"own CPU pays for that work in full; with --delay 1 (RemoteAdamW's delay=1, "
              f"staleness 1) fusedps stages nothing during backward and pulls nothing in the "
              f"forward")
    else:
        print(f"limit: {r['limit']} ({r['limit_ms']:.2f} ms exposed per step, of "
              f"{r['exposed_ms']:.2f} ms the loop waited for fusedps in all); the rest of the "
              f"push and pull ran behind compute")


def main(argv=None) -> int:
    args = parse_args(argv)
    from fusedps.torch import RemoteAdamW

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    amp = device.type == "cuda" if args.amp == "auto" else args.amp == "bf16"
    preset = dict(PRESETS[args.preset])
    args.batch_size = args.batch_size or preset.pop("batch_size")
    preset.pop("batch_size", None)
    torch.manual_seed(0)
    base = GPT(GPTConfig(**preset))
    n_params = sum(p.numel() for p in base.parameters())

    local_model = GPT(GPTConfig(**preset)).to(device)
    local_model.load_state_dict(base.state_dict())
    local = run(args, device, local_model, torch.optim.AdamW(local_model.parameters(), lr=1e-4),
                amp)
    del local_model

    targets = [t for t in args.target.split(",") if t]
    options = {} if args.streams is None else {"streams": args.streams}
    remote_model = GPT(GPTConfig(**preset)).to(device)
    remote_model.load_state_dict(base.state_dict())
    try:
        optimizer = RemoteAdamW(remote_model.named_parameters(), lr=1e-4,
                                targets=targets[0] if len(targets) == 1 else targets,
                                client_options=options, prefix=f"fusedps-selfcheck/{args.preset}/",
                                grad_dtype=args.grad_dtype, pull_dtype=args.pull_dtype,
                                overlap=True, bucket_bytes=(None if args.bucket_mib is None
                                     else int(args.bucket_mib * (1 << 20))),
                                delay=args.delay, delay_warmup=min(args.warmup, 3),
                                push_during_backward={"on": True, "off": False}.get(
                                    args.push_during_backward),
                                on_existing="resume")
    except Exception as e:  # noqa: BLE001 - the reason, for the user
        print(f"error: cannot train through {args.target}: {e}", file=sys.stderr)
        return 2
    with optimizer:
        clients = getattr(optimizer.client, "clients", [optimizer.client])
        infos = [c.info() for c in clients]
        info = ", ".join(f"{c.target} ({i.backend}, {i.device})" for c, i in zip(clients, infos))
        remote = run(args, device, remote_model, optimizer, amp)
    result = report(args, device, n_params, local, remote, copy_rates(device), info)
    result["data_plane"] = optimizer.data_plane_in_use
    result["data_plane_reason"] = optimizer.data_plane_reason
    result["push_during_backward"] = optimizer.push_during_backward_in_use
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0
