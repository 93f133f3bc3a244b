"""Each deterministic computation once per test session, in whichever process asks first.

The test suite asks for some computations several times: a lab and its solution run the
same cells on the same seeds wherever the learner's code is not involved (the field
scenarios, the fault runs, the variant runs of notebook 06, the memory table), and the tests
of those functions run them again. `./course test` (the root conftest.py) sets SESSION_CACHE
to a fresh private folder for the run. A function decorated with `@once_per_session` then
computes its result the first time it is called with given arguments, in any process of the
run (a test worker, a notebook kernel), and every later call with the same arguments reads
that result. A caller arriving while another computes the same key waits for it (one lock
file per key), so the work is not done twice at the same time either.

Unset (a learner's notebook, the CLI, the grader's sandbox, whose environment is cleared),
the decorator does nothing: the function runs.

The key: the function's module and name, its arguments, a digest of every file of the
package, the Python, torch and transformers versions, and the package's switches in the
environment (every GRPO_LAB_* variable: threads, profile, a scenario's device; a launcher's
WORLD_SIZE, RANK, ...). An argument that is not plain data (numbers, strings, lists,
dicts, dataclasses such as GRPOConfig, argparse namespaces, paths) makes the call run
uncached. A call that raises stores nothing. A call made while computing another key runs
uncached (no lock held while waiting on another, so no deadlock).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path, PurePath

try:
    import fcntl
except ImportError:  # Windows: no flock, so no cache; every call runs
    fcntl = None

SESSION_CACHE = "GRPO_LAB_SESSION_CACHE"
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")
PACKAGE = Path(__file__).resolve().parent

_computing = False  # this process is inside a cached computation


class _NotPlain(TypeError):
    pass


def plain(value):
    """A JSON-able form of `value` that tells apart what compares unequal; _NotPlain for
    anything else (an object whose state a key cannot see)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return ["float", repr(value)]  # nan and inf as text; 1 and 1.0 apart
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [plain(v) for v in value]]
    if isinstance(value, dict):
        items = [[plain(k), plain(v)] for k, v in value.items()]
        return ["dict", sorted(items, key=json.dumps)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return [type(value).__module__ + "." + type(value).__qualname__, plain(fields)]
    if isinstance(value, argparse.Namespace):
        return ["Namespace", plain(vars(value))]
    if isinstance(value, PurePath):
        return ["path", str(value)]
    raise _NotPlain(type(value).__name__)


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """sha256 of every file of the package (code, model, tokenizer, exercise manifest)."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(PACKAGE)).encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()


def key_of(fn, args: tuple, kwargs: dict) -> str:
    import torch  # loaded already by any caller: imported here to keep conftest.py light
    import transformers

    # the package reads its switches from GRPO_LAB_* variables (the thread count, the profile,
    # a scenario's device) and a launcher's from these; not the caller's current thread count,
    # which the package's policy sets itself (models.apply_thread_policy)
    switches = sorted((k, v) for k, v in os.environ.items()
                      if (k.startswith("GRPO_LAB_") and k != SESSION_CACHE) or k in LAUNCHER_VARS)
    what = [fn.__module__, fn.__qualname__, plain(list(args)), plain(kwargs), package_digest(),
            sys.version, torch.__version__, transformers.__version__, switches]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]


def cache_folder() -> Path | None:
    folder = os.environ.get(SESSION_CACHE)
    if not folder or fcntl is None or not Path(folder).is_dir():
        return None
    return Path(folder)


def once_per_session(fn):
    """Decorate a deterministic function of its arguments and the package (see the module
    docstring); the result must pickle."""

    @functools.wraps(fn)
    def cached(*args, **kwargs):
        global _computing
        folder = cache_folder()
        if folder is None or _computing:
            return fn(*args, **kwargs)
        try:
            key = key_of(fn, args, kwargs)
        except _NotPlain:
            return fn(*args, **kwargs)
        result_path = folder / f"{key}.pkl"
        with open(folder / f"{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            if result_path.exists():
                return pickle.loads(result_path.read_bytes())
            _computing = True
            try:
                result = fn(*args, **kwargs)
            finally:
                _computing = False
            partial = folder / f"{key}.{os.getpid()}.tmp"
            partial.write_bytes(pickle.dumps(result))
            os.replace(partial, result_path)
            return result

    cached.uncached = fn
    return cached
