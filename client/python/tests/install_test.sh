#!/usr/bin/env bash
# The install test of the fusedps package (ctest python_install_test).
#
#   install_test.sh PYTHON DIST_DIR SERVER
#
# In fresh venvs made by PYTHON with --system-site-packages (Debian's grpcio, protobuf, torch),
# from a directory outside the checkout, with no network and no PYTHONPATH:
#   1. `pip install` of a copy of client/python (the stubs generated from proto/ by setup.py):
#      import, no torch on import, then a push and a pull against a fresh SERVER (grpcio);
#   2. `pip install` of the wheel in DIST_DIR (with the native library): the same, through the
#      native transport.
set -euo pipefail
python=$1 dist=$(realpath "$2") server=$(realpath "$3")
repo=$(cd "$(dirname "$0")/../../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

# The copy keeps pip's in-tree build files out of the checkout; proto/ sits where setup.py looks.
mkdir -p "$work/src/client"
cp -r "$repo/client/python" "$work/src/client/python"
cp -r "$repo/proto" "$work/src/proto"
rm -rf "$work/src/client/python/fusedps/libfusedps_c.so"

check() {  # check VENV TRANSPORT
  local venv=$1 transport=$2
  (cd "$work" && FUSEDPS_SERVER=$server "$python" "$repo/tests/e2e/server_fixture.py" -- \
      "$venv/bin/python" "$repo/client/python/tests/install_check.py" --target '{target}' \
      --venv "$venv" --transport "$transport")
  # The checkpoint manifest's message (fusedps.v1.checkpoint_pb2) is installed beside the gRPC
  # stubs: from_torch writes a checkpoint through it, to_torch reads it back.
  (cd "$work" && "$venv/bin/python" - "$venv" "$work" <<'PY'
import os, sys, tempfile
import torch
import fusedps.v1.checkpoint_pb2 as manifest_pb2
from fusedps import checkpoint
where = os.path.realpath(manifest_pb2.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), where
model = torch.nn.Linear(3, 2)
opt = torch.optim.AdamW(model.parameters())
root = tempfile.mkdtemp(dir=sys.argv[2])
path = checkpoint.from_torch(model.state_dict(), opt.state_dict(), root,
                             param_names=["weight", "bias"])
state, _ = checkpoint.to_torch(path)
assert all(torch.equal(state[n], t) for n, t in model.state_dict().items()), state
print(f"install check: checkpoint round trip ok ({where})")
PY
  )
}

"$python" -m venv --system-site-packages "$work/venv-src"
"$work/venv-src/bin/pip" install --quiet --no-build-isolation "$work/src/client/python"
check "$work/venv-src" grpcio

wheel=$(ls "$dist"/fusedps-*.whl)
"$python" -m venv --system-site-packages "$work/venv-wheel"
"$work/venv-wheel/bin/pip" install --quiet "$wheel"
check "$work/venv-wheel" native
echo "install test: ok (source install: grpcio; $(basename "$wheel"): native)"
