"""GRPO Lab: a small, readable GRPO trainer for GPT-2, built to be broken and fixed.

Layers, each importing only from the ones below it (tests/test_layers.py):

- the engine, here, one file per concern: config (GRPOConfig, presets), tasks (addition
  and its reward), models (architecture, tokenizer, profiles), objective (log-probs,
  advantages, KL estimators, clipped surrogate, aggregation), fast (speed-ups beside the
  plain path, tested equal to it), naive (the field reports' variants the naive preset
  switches on), sampling (a group per prompt, log-probs), policy (what a profile trains,
  warm start), health (checks, snapshots, rollback), distributed (DDP), trainer (the loop),
  memo (a test run computes each deterministic result once);
- tools/: bench (and turns, its timing of sides that take turns), memory, warmstart
  (build-model), parser (the CLI's one-line errors);
- field/: the field failures: bugs (broken code beside the right one), catalog (the
  scenarios' texts, without torch), scenarios, faults, reliability, variants (runs of one
  config, to compare fixes);
- course/: checks (exercise checkers), grade, labs, notebooks, plots;
- cli on top.
"""

import logging as _logging

from .config import ConfigError, GRPOConfig, preset


class _DropDecodePadWarning(_logging.Filter):
    # generate() feeds the pad token after a finished row without a 2-D mask; the
    # attention is right (tests check the log-probs), the warning is noise
    def filter(self, record: _logging.LogRecord) -> bool:
        return "strongly recommend passing in an `attention_mask`" not in record.getMessage()


_logging.getLogger("transformers.modeling_utils").addFilter(_DropDecodePadWarning())

__all__ = ["ConfigError", "GRPOConfig", "preset"]
