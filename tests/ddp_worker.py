"""Run by tests/test_distributed.py under torchrun (2 processes): apply one update to this
rank's share of a saved global batch, through the trainer's DDP path, and save the result.

    torchrun --standalone --nproc_per_node 2 tests/ddp_worker.py CASES.pt OUT_DIR
"""

import sys

import torch

from grpo_lab import distributed
from grpo_lab.step import batch_weights
from grpo_lab.trainer import Trainer

torch.set_num_threads(1)
cases = torch.load(sys.argv[1], weights_only=False)
out_dir = sys.argv[2]
trainer = None
for i, case in enumerate(cases):
    if trainer is not None:
        trainer.run.forward = trainer.run.forward.module  # drop the last case's DDP wrapper first
    trainer = Trainer(case["config"])
    trainer.policy.load_state_dict(case["initial_policy"])
    batch = case["batch"]
    rows = distributed.shard(len(batch.rewards), trainer.world)
    share = batch.rows(rows)  # keeps the global batch's token weights
    # the trainer's own normaliser, run on this rank's mask alone, must give the same weights
    weights = batch_weights(trainer.run, share.rollout.completion_mask)
    stats, _ = trainer.update(share)
    loss = distributed.all_reduce(stats["loss"].detach().clone(), trainer.world)
    if trainer.world.is_main:
        torch.save({
            # the same divisions of the same integer counts (all-reduced exactly): bit for bit
            "weights_match": torch.equal(weights, share.weights),
            "loss": loss.item(),
            "grad_norm": trainer.last_grad_norm,  # before clipping: the global batch's norm
            "grads": {n: p.grad.clone() for n, p in trainer.policy.named_parameters()},
            "params": {n: p.detach().clone() for n, p in trainer.policy.named_parameters()},
        }, f"{out_dir}/case{i}.pt")
trainer.close()
