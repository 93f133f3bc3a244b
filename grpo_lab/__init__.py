"""GRPO Lab: a small, readable GRPO trainer for GPT-2, built to be broken and fixed.

One file per concern: config (GRPOConfig, presets), models (policy, tokenizer, profiles),
tasks (addition and its reward), sampling (a group per prompt, log-probs), objective (advantages,
KL estimators, clipped surrogate, aggregation), trainer (the loop, accumulation, AMP,
clipping, checkpoints), health (checks, snapshots, rollback), bugs (the field reports'
broken variants), plots, cli.
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
