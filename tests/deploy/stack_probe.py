#!/usr/bin/env python3
"""Prints, as one JSON line, what a fusedps server holds: its version, and a SHA-256 of every
tensor's parameters, exp_avg and exp_avg_sq (fp32, in the server's order) with each tensor's
step. tests/deploy/stack_test.py runs it in the trainer image (deploy/docker/Dockerfile.trainer)
before a server container stops and after it restarts on the same volume: equal lines mean the
restart restored the same state, bit for bit.

    python3 stack_probe.py HOST:PORT
"""

import hashlib
import json
import sys

import fusedps


def main() -> int:
    target = sys.argv[1]
    with fusedps.Client(target) as client:
        client.wait_ready(timeout=30)
        params = client.pull_parameters(None)
        digest = hashlib.sha256()
        for name, tensor in params.items():
            digest.update(name.encode() + b"\0" + tensor.contiguous().numpy().tobytes())
        for field in ("exp_avg", "exp_avg_sq"):
            state, version, steps = client.pull_state(field)
            if version != params.version:
                print(f"stack_probe: the server changed during the probe ({params.version} -> "
                      f"{version})", file=sys.stderr)
                return 1
            for name, tensor in state.items():
                digest.update(f"{field}:{name}:{steps[name]}".encode() + b"\0" +
                              tensor.contiguous().numpy().tobytes())
        print(json.dumps({"version": params.version, "tensors": len(params),
                          "sha256": digest.hexdigest()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
