"""Run by install_test.sh with a venv's python: the installed fusedps imports from the venv
(not the checkout), without torch, and pushes and pulls through the expected transport with
the results torch.optim.AdamW gives.

    install_check.py --target HOST:PORT --venv DIR --transport native|grpcio
"""

import argparse
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--venv", required=True)
    parser.add_argument("--transport", choices=("native", "grpcio"), required=True)
    args = parser.parse_args()

    import fusedps

    where = os.path.realpath(fusedps.__file__)
    assert where.startswith(os.path.realpath(args.venv)), f"fusedps imported from {where}"
    assert "torch" not in sys.modules, "import fusedps imported torch"
    import fusedps.v1.parameter_service_pb2  # noqa: F401  (the generated stubs are installed)

    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    reference = torch.nn.Linear(16, 4)
    reference.load_state_dict(model.state_dict())
    # transport="auto" picks the native transport for several streams, where it is installed.
    with fusedps.Client(args.target, streams=2) as client:
        assert client.transport_in_use == args.transport, client.transport_in_use
        client.register_model(model)
        for m in (model, reference):
            m(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).sum().backward()
        result = client.push_gradients(model, grad_dtype="float32")
        assert result.version == 1 and not result.step_skipped, result
        pulled = torch.nn.Linear(16, 4)
        client.pull_parameters(pulled)
    torch.optim.AdamW(reference.parameters()).step()
    for name, p in pulled.named_parameters():
        expected = dict(reference.named_parameters())[name]
        torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7)
    try:
        with fusedps.Client(args.target) as client:
            client.pull_parameters(["no_such_tensor"])
    except fusedps.errors.NotFound as e:
        assert "no_such_tensor" in e.details(), e.details()
    else:
        raise AssertionError("pulling an unknown tensor did not raise NotFound")
    print(f"install check: ok ({args.transport}, {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
