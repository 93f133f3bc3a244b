#!/usr/bin/env bash
# Download the wheels benchmarks/gpu_checks.sh installs on a GPU machine with no network
# (benchmarks/gpu_wheels.txt: Python 3.12, x86-64 Linux) into .whl/ (git-ignored; about 36 MiB),
# then hand .whl to the machine beside the repository.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -x .venv/bin/python ]; then py=${PYTHON:-.venv/bin/python}; else py=${PYTHON:-python3}; fi
mkdir -p .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl -r benchmarks/gpu_wheels.txt
du -sh .whl
