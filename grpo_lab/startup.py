"""Importing the heavy libraries (transformers, TRL) with Python's cyclic garbage collector
paused, then frozen out of its sight.

Their imports allocate a few million objects that live as long as the process. CPython runs
a collection every few hundred allocations, and the full ones scan everything allocated so
far: during the import, and again during the run, none of them finding anything to free.
Paused, and the imported objects moved to the permanent generation (`gc.freeze`), later
collections only look at what the run itself allocates. Every process that trains pays
this once: a CLI run, each torchrun worker, a notebook kernel, a grader's sandbox worker.
Figures: `python benchmarks/startup.py`.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    """The cyclic collector off for the block (reference counting still frees), then every
    object alive frozen (`gc.freeze`: a cycle among them is never collected, which for a
    module's objects costs nothing) and the collector restored, also when the block
    raises. Already disabled: left disabled."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
