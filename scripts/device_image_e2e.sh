#!/usr/bin/env bash
# Runs on the GPU machine (device tool; no Docker engine there) with build-deploy/cuda-image and
# build/python carried: the server and CLI copied out of the CUDA image by `make test-deploy`
# (docker create + docker cp), with the image's own libraries, under the PyTorch-oracle e2e suite
# (tests/e2e) on --device=cuda, and the digits example through it. Logs go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
here=$(pwd)
image=$here/build-deploy/cuda-image
for exe in fusedps-server fusedps; do
  printf '#!/usr/bin/env bash\nLD_LIBRARY_PATH=%s/lib exec %s/bin/%s "$@"\n' "$image" "$image" \
    "$exe" >"$image/$exe-wrapper"
  chmod +x "$image/$exe-wrapper"
done
export FUSEDPS_SERVER=$image/fusedps-server-wrapper FUSEDPS_CLI=$image/fusedps-wrapper
export PYTHONPATH=$here/build/python PYTHONDONTWRITEBYTECODE=1 FUSEDPS_TEST_DEVICE=cuda
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== the image's libraries, as the loader resolves them"
LD_LIBRARY_PATH=$image/lib ldd "$image/bin/fusedps-server" | grep -E "fusedps|not found|cuda" | head
echo "== e2e (PyTorch oracle) on --device=cuda, the image's fusedps-server and fusedps CLI"
python3 -m pytest -q -p no:cacheprovider tests/e2e 2>&1 | tee "$out/e2e_image_cuda.log" | tail -4
echo "== digits example on --device=cuda"
python3 tests/e2e/server_fixture.py --device=cuda -- python3 examples/train_digits.py \
  --target '{target}' 2>&1 | tee "$out/digits_image_cuda.log" | tail -3
grep -h "backend" "$out/digits_image_cuda.log" | head -1
