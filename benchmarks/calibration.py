"""A fixed single-thread job, to tell the machine's drift from a change's effect: run it just
before a suite run and compare like with like.

    python benchmarks/calibration.py    # prints the CPU seconds of 150 warm-start steps
"""

import time

import torch

from grpo_lab.models import GPT2LMHeadModel, build_char_tokenizer, tiny_gpt2_config
from grpo_lab.policy import warm_start

if __name__ == "__main__":
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(len(tokenizer)))
    t0 = time.process_time()
    warm_start(model, tokenizer, max_steps=150, check_every=1000, log=lambda *_: None)
    print(f"calibration: 150 warm-start steps {time.process_time() - t0:.2f} s CPU")
