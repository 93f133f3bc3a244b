#!/usr/bin/env bash
# Every notebook under nbval on the CPU with grpo_lab/graphs.py's static paths on, as they run
# as CUDA graphs on a GPU with GRPO_LAB_CUDA_GRAPHS=1: the prompts' forward, the decode step,
# the reference's forward and the training pass, over the same static buffers without a graph
# (benchmarks/static_paths/sitecustomize.py). What it finds before a GPU run: a claim or a
# code path that the graphs' buffers break (not the capture itself, nor a GPU's rounding).
#
#   bash benchmarks/static_notebooks.sh                      # all 28, about 4.5 min on 2 cores
#   bash benchmarks/static_notebooks.sh solutions/11_capstone.ipynb
#   bash benchmarks/static_notebooks.sh tests                # the unit tests, about 4 min
#
# Over tests/, test_graphs.py::test_which_decoder_the_environment_gets fails by design: it
# checks that on the CPU GRPO_LAB_CUDA_GRAPHS=1 gives no static decoder, which this undoes.
#
# Notebook kernels start plainly here (WARM_KERNELS=0, WARM_CLI=0): the suite's warm servers
# import grpo_lab before this folder's hook could patch it. Prints the static calls made.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py=${PYTHON:-.venv/bin/python}
[ $# -gt 0 ] || set -- solutions labs
counts=$(mktemp -d)
GRPO_LAB_CUDA_GRAPHS=1 WARM_KERNELS=0 WARM_CLI=0 STATIC_COUNTS=$counts \
  PYTHONPATH="$PWD/benchmarks/static_paths${PYTHONPATH:+:$PYTHONPATH}" \
  "$py" -m pytest -q -n "${WORKERS:-2}" -p no:cacheprovider -rf "$@"
rc=$?
"$py" - "$counts" <<'PY'
import collections, json, pathlib, sys
total, files = collections.Counter(), list(pathlib.Path(sys.argv[1]).glob("*.json"))
for f in files:
    total.update(json.loads(f.read_text()))
print(f"static calls, {len(files)} processes: "
      + (", ".join(f"{n:,} {k}" for k, n in sorted(total.items())) or "none (not patched?)"))
PY
rm -rf "$counts"
exit $rc
