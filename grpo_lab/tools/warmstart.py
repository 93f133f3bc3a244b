"""`python -m grpo_lab build-model`: regenerate the shipped tiny GPT-2 with one CPU thread,
fixed seeds, a fixed data order and the warm start of `grpo_lab.policy`, and write
`build.json` beside it: the build's summary and the platform it ran on.

Deterministic on one platform: the same torch on the same CPU kernels gives the same weights,
bit for bit. Across platforms it is not. torch picks its CPU kernels by instruction set
(ATen's AVX2/AVX-512 paths, MKL's and oneDNN's dispatch), they round differently, and the
warm start's hundreds of AdamW steps amplify that: on one AVX-512 machine, four kernel
settings stopped after 550, 625, 700 and 750 steps, every tensor different (max |diff| about
0.2, the weights' own scale), all at dev accuracy 0.43 to 0.46 (benchmarks/RESULTS.md,
"Kernels"). So a rebuild is compared bit for bit only where `platform_record()` equals the
one in build.json, and by behaviour elsewhere (tests/test_warmstart.py).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from ..models import (
    TINY_MODEL_DIR,
    GPT2LMHeadModel,
    build_char_tokenizer,
    count_parameters,
    tiny_gpt2_config,
)
from ..policy import warm_start

BUILD_RECORD = "build.json"
# the variables that change which CPU kernels torch runs (ATen, oneDNN, MKL)
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def _cpuinfo() -> tuple[str | None, list[str] | None]:
    """(vendor, the instruction-set flags kernels dispatch on) from Linux's /proc/cpuinfo;
    elsewhere (vendor from `platform`, None)."""
    vendor, flags = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "CPU implementer") and vendor is None:
                    vendor = value.strip()
                elif key in ("flags", "Features") and flags is None:
                    flags = sorted(f for f in value.split() if f.startswith(
                        ("avx", "amx", "fma", "f16c", "sse", "asimd", "sve", "fp", "bf16")))
    except OSError:
        return platform.processor() or None, None
    return vendor, flags


def platform_record() -> dict:
    """What decides the kernels a build runs: two builds with equal records run the same
    code (torch, transformers' GPT-2) on the same CPU kernels in the same order (one
    thread), so their weights are equal bit for bit. Where the CPU flags cannot be read
    (None), equal records are a weaker promise."""
    import transformers

    vendor, flags = _cpuinfo()
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "system": platform.system(),
        "processor_vendor": vendor,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": torch.backends.mkl.is_available(),
        "cpu_flags": flags,
        "kernel_env": {name: os.environ[name] for name in KERNEL_ENV if name in os.environ},
    }


def read_build_record(model_dir: Path = TINY_MODEL_DIR) -> dict:
    """build.json of a built model: {"platform": record or None, "summary": {...}}."""
    return json.loads((Path(model_dir) / BUILD_RECORD).read_text())


def build_tiny_model(out_dir: Path = TINY_MODEL_DIR, log=print, **warm_start_args) -> dict:
    """Regenerate the shipped tiny GPT-2 (deterministic on one platform, one CPU thread)
    and write its build record. `warm_start_args` go to `policy.warm_start` (tests build
    short)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = build_char_tokenizer()
        torch.manual_seed(0)
        model = GPT2LMHeadModel(tiny_gpt2_config(len(tokenizer)))
        summary = warm_start(model, tokenizer, log=log, **warm_start_args)
    finally:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    summary["parameters"] = count_parameters(model)
    record = {"platform": platform_record(),
              "summary": {k: v for k, v in summary.items() if k != "seconds"}}
    (out_dir / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    log(f"[warm start] saved {summary['parameters']:,} parameters to {out_dir}: {summary}")
    return summary
