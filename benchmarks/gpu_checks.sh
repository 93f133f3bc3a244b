#!/usr/bin/env bash
# Every check that needs a GPU, in one go, each command's output saved with the command, and
# one summary of them all, OUT_DIR/summary.json (commit it as benchmarks/gpu/summary.json):
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]          # on a CUDA machine: at most ~9.5 minutes
#   DEVICE=cpu bash benchmarks/gpu_checks.sh /tmp/x  # the same commands on CPU, small: a smoke test
#
# On a bare GPU machine with no network, the packages it lacks travel beside the repository as
# wheels in .whl/ (benchmarks/gpu_wheels.sh fetches them here, 36 MiB); this script installs them
# into a folder of its own first. No model hub is needed: HF_HUB_OFFLINE=1, so the gpu profile
# builds GPT-2 124M's architecture and warm-starts it (grpo_lab/policy.py), timed as its own step.
#
#   1. the environment, and the warm start of GPT-2 124M (cached for what follows);
#   2. every notebook, solutions and labs, under the gpu profile, in parallel on the one GPU
#      under nbval (NOTEBOOKS, NOTEBOOK_WORKERS to change), until GPU_DEADLINE - RESERVE s;
#   3. reports 000 and 002 as device-side asserts, each in a fresh process, and what the next
#      CUDA call in that process does; 4. the peak-memory table; 5. the sampler (its prompts'
#      forward and decode step), the reference's forward and the training pass as CUDA graphs
#      against the eager ones, bf16 and float32 (benchmarks/decode_graphs.py); grpo_lab vs
#      TRL: s/step, tokens/s, MFU, with the graphs on (BENCH_GRAPHS=0: off), then where
#      grpo_lab's step goes without them (benchmarks/step_profile.py);
#   6. summary.json: card, date, commit, notebooks passed and total, seconds, the bench per
#      side, the step-time ratio, the step's profile per phase.
# ONLY=notebooks: steps 1, 2 and 6 only (a rerun of the notebooks after a full run).
# ONLY=executed: steps 1 and 2, but each notebook run to its end with every error kept and
#   its outputs saved in OUT_DIR/executed/ (benchmarks/execute_keep_outputs.py): the numbers
#   a claim's threshold for the gpu profile is set from.
# COMMIT: the commit to record (default: git rev-parse HEAD where .git is there).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-benchmarks/gpu-$(date +%F)}
if [ -x .venv/bin/python ]; then py=${PYTHON:-.venv/bin/python}; else py=${PYTHON:-python3}; fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
device=${DEVICE:-cuda}
mkdir -p "$out"
failed=0
commit=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

if compgen -G ".whl/*.whl" >/dev/null && [ "${INSTALL_WHEELS:-1}" = 1 ]; then
  site=${TMPDIR:-/tmp}/grpo_lab_site
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || { echo "could not install .whl/*.whl"; exit 1; }
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

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

summarize() {  # 6. the one summary of what ran
  # shellcheck disable=SC2086  # NOTEBOOKS is a list of paths (globs allowed)
  run summary "$py" benchmarks/gpu_summary.py "$out" --commit "$commit" \
    --seconds "$SECONDS" --notebook-seconds "$notebook_seconds" --failed "$failed" \
    --notebooks $notebooks
}

if [ "$device" = cuda ]; then
  # the bench under bf16 autocast (BENCH_AMP=none: float32; 2026-11-27's H100 figure, 1.227,
  # was float32)
  profile=gpu; memory=(); bench=(--steps 50 --seeds 1 --amp "${BENCH_AMP:-bf16}")
  step_profile=(--steps 20 --amp "${BENCH_AMP:-bf16}")
  decode_graphs=(--batches 20 --amp "${BENCH_AMP:-bf16}")
  notebooks=${NOTEBOOKS:-solutions/*.ipynb labs/*.ipynb}
  deadline=${GPU_DEADLINE:-560}
else
  profile=cpu; memory=(--quick); bench=(--steps 2 --seeds 1); step_profile=(--steps 2 --warmup 1)
  decode_graphs=(--batches 2 --warmup 1)
  notebooks=${NOTEBOOKS:-solutions/00_setup_and_diagnostics.ipynb}
  deadline=${GPU_DEADLINE:-0}
fi
# one notebook process holds 5 to 14 GiB of CUDA memory under the gpu profile (measured on
# 2026-11-27: 14 workers on an 80 GiB H100 ran out of memory), so the workers are sized by
# the card: one per 11 GiB, at most 14 (an H100 80GB: 7; an H200: 12)
if [ "$device" = cuda ] && [ -z "${NOTEBOOK_WORKERS:-}" ]; then
  NOTEBOOK_WORKERS=$("$py" -c "import torch; print(max(1, min(14, torch.cuda.get_device_properties(0).total_memory // (11 << 30))))" 2>/dev/null || echo 7)
fi
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# seconds kept for steps 3 to 6 after the notebooks (199 on an H200, 2026-11-28, before the
# training check was added)
reserve=${RESERVE:-200}
run environment "$py" -c "import torch, transformers, trl; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__, 'trl', trl.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
if [ "$device" = cuda ]; then
  run warm-start "$py" -c "import time; t = time.time(); from grpo_lab.policy import gpu_policy; from grpo_lab.models import count_parameters; m, _ = gpu_policy(); print(f'GPT-2 124M ready: {count_parameters(m)} parameters, {time.time() - t:.1f} s')"
fi
# the notebooks get what is left before the reserve, then SIGINT, so pytest still writes its
# report and durations
limit=()
if [ "$deadline" -gt 0 ]; then
  left=$((deadline - reserve - SECONDS))
  limit=(timeout -s INT -k 30 $((left > 30 ? left : 30)))
fi
if [ "${ONLY:-}" = executed ]; then  # every cell run, errors kept, outputs saved: numbers
  # shellcheck disable=SC2086
  run executed ${limit[@]+"${limit[@]}"} env GRPO_LAB_PROFILE="$profile" "$py" \
    benchmarks/execute_keep_outputs.py $notebooks --out "$out/executed" \
    --workers "${NOTEBOOK_WORKERS:-2}"
  exit $((failed > 0))
fi
notebooks_start=$SECONDS
# the notebooks with the CUDA graphs on (NOTEBOOK_GRAPHS=0: off): 28 of 28 passed without them
# on an H200 at 8904bf6; the switch's default turns on once they pass with them too
notebook_graphs=${NOTEBOOK_GRAPHS:-1}
# shellcheck disable=SC2086  # NOTEBOOKS is a list of paths (globs allowed)
run notebooks ${limit[@]+"${limit[@]}"} env GRPO_LAB_PROFILE="$profile" \
  GRPO_LAB_CUDA_GRAPHS="$notebook_graphs" "$py" -m pytest -q -p no:cacheprovider --durations=0 \
  -n "${NOTEBOOK_WORKERS:-2}" --junitxml="$out/notebooks.xml" $notebooks
notebook_seconds=$((SECONDS - notebooks_start))
if [ "${ONLY:-}" = notebooks ]; then  # a rerun of the notebooks alone (the rest ran already)
  summarize
  exit $((failed > 0))
fi
# the four scenario processes at once (each is mostly its own start-up: about 30 s apart,
# 116 s one after the other on an H100); their outputs go to their files, shown after
for side in "" --fixed; do
  run "scenario-000$side" "$py" -m grpo_lab scenario nan-params-sampling-crash --device "$device" $side >/dev/null &
  run "scenario-002$side" "$py" -m grpo_lab scenario pad-token-vocab-mismatch --device "$device" $side >/dev/null &
done
wait
for name in scenario-000 scenario-002 scenario-000--fixed scenario-002--fixed; do
  cat "$out/$name.txt"  # run's failure count was kept in the background shells: count here
  grep -q '^(exit 0, ' "$out/$name.txt" || failed=$((failed + 1))
done
run memory "$py" -m grpo_lab memory --device "$device" --profile "$profile" ${memory[@]+"${memory[@]}"}
run decode-graphs "$py" benchmarks/decode_graphs.py --device "$device" --profile "$profile" \
  "${decode_graphs[@]}" --json "$out/decode_graphs.json"
if [ "$device" = cuda ]; then  # float32 too: another attention kernel than bf16's
  run decode-graphs-fp32 "$py" benchmarks/decode_graphs.py --device cuda --profile "$profile" \
    --batches 10 --amp none --json "$out/decode_graphs_fp32.json"
fi
# the bench with the sampler's forwards, the reference's forward and the training pass as
# CUDA graphs (grpo_lab/graphs.py; checked by decode-graphs above); the step profile below
# runs without them
run bench env GRPO_LAB_CUDA_GRAPHS="${BENCH_GRAPHS:-1}" "$py" -m grpo_lab bench --device "$device" \
  --profile "$profile" "${bench[@]}" --json "$out/bench.json"
# where grpo_lab's step goes on this device: host and device time, kernel launches and
# synchronisations per phase (about 30 s on a GPU)
run step-profile env GRPO_LAB_CUDA_GRAPHS=0 "$py" benchmarks/step_profile.py --device "$device" \
  --profile "$profile" "${step_profile[@]}" --json "$out/step_profile.json"
summarize
echo "outputs in $out; $failed command(s) failed"
exit $((failed > 0))
