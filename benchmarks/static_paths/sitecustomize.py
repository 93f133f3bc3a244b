"""Loaded by every Python process that has this folder on PYTHONPATH (benchmarks/
static_notebooks.sh): grpo_lab/graphs.py's static paths run on the CPU wherever
GRPO_LAB_CUDA_GRAPHS=1 would run them as CUDA graphs on a GPU (a hook on the model still
turns them off, as there), and each process writes how many static calls of each kind it
made to $STATIC_COUNTS/<pid>.json, after every call (a notebook's kernel is killed, not
exited, so nothing would run at its exit)."""

import builtins
import collections
import json
import os
import sys

_import = builtins.__import__
_GPU = type("Device", (), {"type": "cuda"})()  # all graphs._applies reads of a device
_counts: collections.Counter = collections.Counter()


def _counted(cls, name: str, kind):
    real = getattr(cls, name)

    def call(self, *args, **kwargs):
        _counts[kind(self)] += 1
        folder = os.environ.get("STATIC_COUNTS")
        if folder:
            with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
                json.dump(_counts, f)
        return real(self, *args, **kwargs)
    setattr(cls, name, call)


def _patch() -> None:
    graphs = sys.modules.get("grpo_lab.graphs")
    # patched once, after the module's body has run (it defines _Replayed last)
    if graphs is None or not hasattr(graphs, "_Replayed") or hasattr(graphs, "_static_on_cpu"):
        return
    graphs._static_on_cpu = True
    applies = graphs._applies  # graphs.py's own rule, told that the device is a GPU
    graphs._applies = lambda model, device, static: applies(model, _GPU, static)
    _counted(graphs.StaticDecoder, "step", lambda self: "decode steps")
    _counted(graphs.GraphedCall, "__call__", lambda self: (
        "prompt forwards" if self.fn is graphs._prompt_pass else "reference forwards"))
    _counted(graphs.TrainingCall, "__call__", lambda self: "training passes")


def _patching_import(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    if "grpo_lab.graphs" in sys.modules:
        _patch()
    return module


builtins.__import__ = _patching_import
