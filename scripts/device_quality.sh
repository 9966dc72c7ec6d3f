#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack (fusedps-server, fusedps,
# libfusedps_c.so and their libraries, the corpus) and build/python carried: training quality
# of each storage option (issue 16) on real data, in one run. examples/train_digits.py and
# examples/train_gpt.py (the byte-level GPT "small" preset on the Jargon File), each against a
# fresh CUDA server, for fp32, bf16 and int8 state (fp32 params), bf16 params with stochastic
# rounding (fp32 state), and int8 state with bf16 params, each with SEEDS (0 1 2). Several runs
# share the GPU at once (WAVE at a time). Logs to $OUT/quality; the table last
# (bench/quality_report.py).
# Env: SEEDS, STEPS (GPT steps, 200), DIGITS_EPOCHS (10), WAVE (8), ONLY (digits|gpt),
# STORAGES (state:params pairs, default all five: "fp32:fp32 bf16:fp32 int8:fp32 fp32:bf16
# int8:bf16").
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out/quality"
source scripts/device_lib.sh
python_env
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=2
read -r -a storages <<<"${STORAGES:-fp32:fp32 bf16:fp32 int8:fp32 fp32:bf16 int8:bf16}"
seeds=(${SEEDS:-0 1 2})

# run_one EXAMPLE STATE PARAMS SEED: one training run against a fresh CUDA server.
run_one() {
  local example=$1 state=$2 params=$3 seed=$4 cmd
  if [[ $example == digits ]]; then
    cmd="python3 examples/train_digits.py --target {target} --epochs ${DIGITS_EPOCHS:-10}
      --seed $seed --state-dtype $state --params-dtype $params --min-accuracy 0"
  else
    cmd="python3 examples/train_gpt.py --optimizer remote --target {target} --device cuda
      --steps ${STEPS:-200} --seed $seed --amp bf16 --deterministic --grad-dtype bfloat16
      --streams 4 --sample-bytes 0 --data ${GPT_DATA:-.device-pack/corpus.txt.gz}
      --state-dtype $state --params-dtype $params"
  fi
  # shellcheck disable=SC2086  # one argument per word
  timeout 900 python3 tests/e2e/server_fixture.py --device=cuda -- $cmd \
    > "$out/quality/$example-$state-$params-$seed.log" 2>&1 ||
    echo "$example $state $params seed $seed failed: $(tail -1 "$out/quality/$example-$state-$params-$seed.log")"
}

for example in digits gpt; do
  [[ -n ${ONLY:-} && $ONLY != "$example" ]] && continue
  start=$SECONDS
  running=0
  for storage in "${storages[@]}"; do
    for seed in "${seeds[@]}"; do
      run_one "$example" "${storage%%:*}" "${storage##*:}" "$seed" &
      if ((++running >= ${WAVE:-8})); then
        wait -n
        ((running--))
      fi
    done
  done
  wait
  echo "== $example: $((SECONDS - start)) s"
done
python3 bench/quality_report.py "$out"/quality/*.log | tee "$out/quality_table.md"
