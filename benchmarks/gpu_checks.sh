#!/usr/bin/env bash
# The checks that need a GPU, in one go, each command's output saved with the command:
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]          # on a CUDA machine
#   DEVICE=cpu bash benchmarks/gpu_checks.sh /tmp/x  # the same commands on CPU, small: a smoke test
#   NOTEBOOKS="solutions/*.ipynb" bash benchmarks/gpu_checks.sh OUT  # other notebooks (default 05, 11)
#
# PYTHON: the interpreter (default .venv/bin/python, else python3). No model hub is needed:
# HF_HUB_OFFLINE=1, so the gpu profile builds GPT-2 124M's architecture and warm-starts it
# (grpo_lab/policy.py), timed as its own step, before anything else loads it.
#
# 1. report 000 and 002 as device-side asserts, each in a fresh process, and what the next
#    CUDA call in that process does; then the warm start of GPT-2 124M (cached); 2. the
#    peak-memory table of GPT-2 124M; 3. grpo_lab vs TRL on GPT-2 124M: s/step, tokens/s,
#    MFU; 4. notebooks (05 and 11 unless NOTEBOOKS says) under the gpu profile, timed.
#    Copy the figures into benchmarks/RESULTS.md with the command that made them.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-benchmarks/gpu-$(date +%F)}
if [ -x .venv/bin/python ]; then py=${PYTHON:-.venv/bin/python}; else py=${PYTHON:-python3}; fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
device=${DEVICE:-cuda}
mkdir -p "$out"
failed=0

run() {  # run NAME CMD...: print and save the command and its output, keep going on failure
  local name=$1
  shift
  echo "\$ $*" | tee "$out/$name.txt"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "(exit $rc, $((SECONDS - start)) s)" | tee -a "$out/$name.txt"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

if [ "$device" = cuda ]; then
  profile=gpu; memory=(); bench=(--steps 50 --seeds 1)
  notebooks=${NOTEBOOKS:-solutions/05_break_it.ipynb solutions/11_capstone.ipynb}
else
  profile=cpu; memory=(--quick); bench=(--steps 2 --seeds 1)
  notebooks=${NOTEBOOKS:-solutions/00_setup_and_diagnostics.ipynb}
fi
run environment "$py" -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
for side in "" --fixed; do
  run "scenario-000$side" "$py" -m grpo_lab scenario nan-params-sampling-crash --device "$device" $side
  run "scenario-002$side" "$py" -m grpo_lab scenario pad-token-vocab-mismatch --device "$device" $side
done
if [ "$device" = cuda ]; then
  run warm-start "$py" -c "import time; t = time.time(); from grpo_lab.policy import gpu_policy; from grpo_lab.models import count_parameters; m, _ = gpu_policy(); print(f'GPT-2 124M ready: {count_parameters(m)} parameters, {time.time() - t:.1f} s')"
fi
run memory "$py" -m grpo_lab memory --device "$device" --profile "$profile" "${memory[@]}"
run bench "$py" -m grpo_lab bench --device "$device" --profile "$profile" "${bench[@]}"
# GPU_DEADLINE (seconds from the start, 0: none): the notebooks get what is left, then SIGINT,
# so pytest still writes its report and durations
limit=()
if [ "${GPU_DEADLINE:-0}" -gt 0 ]; then
  limit=(timeout -s INT -k 30 $((GPU_DEADLINE - SECONDS > 10 ? GPU_DEADLINE - SECONDS : 10)))
fi
# shellcheck disable=SC2086  # NOTEBOOKS is a list of paths (globs allowed)
run notebooks "${limit[@]}" env GRPO_LAB_PROFILE="$profile" "$py" -m pytest -q -p no:cacheprovider --durations=0 \
  -n "${NOTEBOOK_WORKERS:-auto}" --junitxml="$out/notebooks.xml" $notebooks
echo "outputs in $out; $failed command(s) failed"
exit $((failed > 0))
