"""Rebuild the shipped tiny GPT-2 here and say how it compares with the shipped file: run it
under other CPU kernel choices to see the rebuild move (benchmarks/RESULTS.md, "Kernels").

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/rebuild.py
"""

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from grpo_lab.models import TINY_MODEL_DIR
from grpo_lab.tools.warmstart import build_tiny_model

if __name__ == "__main__":
    out = Path(tempfile.mkdtemp())
    summary = build_tiny_model(out, log=lambda *_: None)
    shipped = load_file(TINY_MODEL_DIR / "model.safetensors")
    rebuilt = load_file(out / "model.safetensors")
    unequal = [k for k in shipped if not torch.equal(shipped[k], rebuilt[k])]
    worst = max((shipped[k] - rebuilt[k]).abs().max().item() for k in shipped)
    print(f"ATen {torch.backends.cpu.get_cpu_capability()}: {summary['steps']} warm-start steps, "
          f"dev accuracy {summary['dev_accuracy']:.3f}; {len(unequal)} of {len(shipped)} tensors "
          f"differ from the shipped ones (max |diff| {worst:.3g})")
