"""Loss parity with TRL 1.16.0: the same batch through grpo_lab's `Trainer.backward` and
through a real `trl.GRPOTrainer.compute_loss` gives the same loss and the same gradient on
every parameter, for every loss type, with and without the KL term, off-policy (old
log-probs != current ones, so the clipping acts for both advantage signs).

TRL defaults that change the loss are set to the plain GRPO objective the course teaches
(each is named where the TRL config is built: the KL's importance-ratio factor, bf16).
Two conventions differ by design, and each has a test that pins it:
- positions: TRL's training forward passes no position ids, so GPT-2 (absolute positions)
  scores a left-padded row at positions shifted by its pad count, while generate() and
  grpo_lab number positions from the first real token. The parity tests on left-padded
  batches hand TRL's model the mask's position ids.
- bnpo under gradient accumulation: TRL divides by each micro-batch's token count,
  grpo_lab by the whole batch's (so accumulation never changes its gradient).
"""

import copy

import pytest
import torch
from datasets import Dataset  # trl's dependency
from trl import GRPOConfig as TRLConfig  # the test extra pins trl==1.16.0 (pyproject.toml)
from trl import GRPOTrainer

from grpo_lab.config import LOSS_TYPES, GRPOConfig
from grpo_lab.numerics import as_accurate_bound, float64_logprobs, logprob_allowance
from grpo_lab.objective import completion_logprobs, position_ids_from_mask, token_weights
from grpo_lab.policy import load_policy
from grpo_lab.sampling import Rollout
from grpo_lab.trainer import StepBatch, Trainer

pytestmark = pytest.mark.numerics  # .ci/kernels runs this file under other CPU kernels

TEMPERATURE = 0.7  # != 1 so both sides must scale the logits the same way
EPS_LOW, EPS_HIGH = 0.2, 0.28  # asymmetric (DAPO's clip-higher): each bound is checked
MAX_NEW_TOKENS = 5  # C; also dr_grpo's constant (TRL: max_completion_length)
BETAS = (0.0, 0.04)


def _trl_args(out_dir, loss_type: str, beta: float, grad_accum: int) -> TRLConfig:
    return TRLConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=8 // grad_accum,
        # steps_per_generation defaults to this: one generation batch of 8 rows per update
        gradient_accumulation_steps=grad_accum,
        num_generations=2,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        loss_type=loss_type,
        beta=beta,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        importance_sampling_level="token",  # one ratio per token, as GRPO
        mask_truncated_completions=False,  # truncated completions stay in the loss
        # TRL 1.16 multiplies the k3 term by the ratio by default (DeepSeek-V3.2's unbiased
        # KL gradient); the GRPO objective (DeepSeekMath, grpo_lab) adds beta * k3 as is
        use_bias_correction_kl=False,
        # the remaining loss-changing knobs, at their plain-GRPO values (TRL's defaults today)
        top_entropy_quantile=1.0,  # no high-entropy token mask
        entropy_coef=0.0,  # no entropy bonus
        delta=None,  # no two-sided (INTELLECT-2) upper clip of the unclipped ratio
        off_policy_mask_threshold=None,  # no DeepSeek-V3.2 off-policy sequence mask
        use_vllm=False,  # so vllm_importance_sampling_correction never applies
        bf16=False,  # TRL defaults to bf16 autocast; grpo_lab's amp="none" is float32
        activation_checkpointing=False,  # TRL defaults to checkpointing; same grads, slower
        disable_dropout=True,
    )


def _reward(completions, **_):
    return [0.0] * len(completions)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: on a shared 2-core machine, two spinning OpenMP threads make
    these tiny forwards ~100x slower. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def weights():
    """The shipped tiny GPT-2; each side gets its own copy of these weights."""
    model, tokenizer = load_policy("cpu")
    return model, tokenizer


@pytest.fixture(scope="module")
def trl_trainers(weights, tmp_path_factory):
    """One real GRPOTrainer per (loss_type, beta, gradient accumulation steps), built on
    first use and kept for the module. Each test restores the initial weights into it."""
    model, tokenizer = weights
    dataset = Dataset.from_dict({"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]})
    out = tmp_path_factory.mktemp("trl")
    cache: dict = {}

    def get(loss_type: str, beta: float, grad_accum: int = 1) -> GRPOTrainer:
        key = (loss_type, beta, grad_accum)
        if key not in cache:
            trainer = GRPOTrainer(
                model=copy.deepcopy(model), reward_funcs=_reward,
                args=_trl_args(out / f"{loss_type}-{beta}-{grad_accum}", loss_type, beta,
                               grad_accum),
                train_dataset=dataset, processing_class=tokenizer,
            )
            # what Trainer's training loop sets before each accumulation window
            trainer.current_gradient_accumulation_steps = grad_accum
            trainer.model.train()  # compute_loss reads the mode (train: accumulation scaling)
            cache[key] = trainer
        trainer = cache[key]
        trainer.model.load_state_dict(model.state_dict())
        trainer.model.zero_grad(set_to_none=True)
        return trainer

    return get


def _with_mask_positions(model):
    """Wrap TRL's (fused-head) forward so the backbone gets position ids counted from each
    row's first real token, as generate() and grpo_lab use. Returns the undo function."""
    fused = model.forward

    def forward(*args, attention_mask=None, **kwargs):
        kwargs.setdefault("position_ids", position_ids_from_mask(attention_mask))
        return fused(*args, attention_mask=attention_mask, **kwargs)

    model.forward = forward
    return lambda: setattr(model, "forward", fused)


def _batch(model, tokenizer, left_padded: bool, seed: int = 0) -> dict:
    """Prompt and completion ids, masks, current/old/reference log-probs and advantages for
    8 rows (2 prompts x G=4). Completions stop at varied places (EOS at different columns,
    one runs to the cap), so the masks differ per row."""
    g = torch.Generator().manual_seed(seed)
    prompts = ["7+8=", "12+34="] if left_padded else ["12+34=", "56+78="]
    enc = tokenizer([p for p in prompts for _ in range(4)], return_tensors="pt", padding=True,
                    add_special_tokens=False)
    prompt_ids, prompt_mask = enc.input_ids, enc.attention_mask  # (B, P), left-padded
    B, C, eos, pad = prompt_ids.shape[0], MAX_NEW_TOKENS, tokenizer.eos_token_id, tokenizer.pad_token_id
    digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    completion_ids = digits[torch.randint(0, 10, (B, C), generator=g)]
    ends = [1, 2, 3, 5, 4, 2, 5, 3]  # completion length incl. EOS; 5 = truncated, no EOS
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    for i, n in enumerate(ends):
        completion_mask[i, :n] = 1
        if n < C:
            completion_ids[i, n - 1] = eos
            completion_ids[i, n:] = pad  # what TRL pads with; grpo_lab masks whatever is there
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    m = completion_mask.bool()
    with torch.no_grad():
        logp = completion_logprobs(model, input_ids, attention_mask, C, TEMPERATURE)  # (B, C)
    # old log-probs: most tokens near pi_theta, a third pushed far enough that the ratio
    # leaves [1 - eps_low, 1 + eps_high] in both directions
    shift = 0.05 * torch.randn(B, C, generator=g)
    far = torch.rand(B, C, generator=g) < 0.35
    shift = torch.where(far, torch.where(torch.rand(B, C, generator=g) < 0.5, 0.6, -0.6), shift)
    old_logp = torch.where(m, logp - shift, 0.0)  # ratio = exp(shift)
    ref_logp = torch.where(m, logp + 0.3 * torch.randn(B, C, generator=g), 0.0)
    advantages = torch.tensor([1.2, -0.4, 0.7, -1.5, -0.9, 1.1, 0.3, -0.6])
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, input_ids=input_ids,
                attention_mask=attention_mask, logp=logp, old_logp=old_logp, ref_logp=ref_logp,
                advantages=advantages)


def _grpo_lab_side(weights, b: dict, loss_type: str, beta: float, grad_accum: int = 1):
    model, tokenizer = weights
    cfg = GRPOConfig(loss_type=loss_type, beta=beta, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                     temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS, prompts_per_step=2,
                     group_size=4, device="cpu")
    trainer = Trainer(cfg, copy.deepcopy(model), tokenizer)
    rollout = Rollout(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"],
        completion_mask=b["completion_mask"], sampling_logprobs=b["old_logp"],
        completions=[""] * len(b["advantages"]),
        prompt_index=torch.arange(2).repeat_interleave(4),
    )
    batch = StepBatch(
        rollout=rollout, rewards=torch.zeros(len(b["advantages"])), advantages=b["advantages"],
        ref_logp=b["ref_logp"] if beta > 0 else None, old_logp=b["old_logp"],
        # as Trainer.make_batch computes them: on the whole step batch
        weights=token_weights(b["completion_mask"], loss_type, MAX_NEW_TOKENS),
    )
    trainer.optimizer.zero_grad(set_to_none=True)
    stats = trainer.backward(batch, grad_accum_steps=grad_accum)
    return stats, dict(trainer.policy.named_parameters())


def _trl_side(trainer: GRPOTrainer, b: dict, beta: float, grad_accum: int = 1):
    """TRL's loss and backward on the batch, split into `grad_accum` micro-batches of
    consecutive rows (as its _prepare_inputs slices the generation batch, minus the
    shuffle). Returns the summed loss, as TRL's loop accumulates it."""
    keys = ["prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"]
    rows = len(b["advantages"]) // grad_accum
    total = torch.zeros(())
    for k in range(grad_accum):
        sl = slice(k * rows, (k + 1) * rows)
        inputs = {key: b[key][sl] for key in keys}
        inputs["old_per_token_logps"] = b["old_logp"][sl]
        if beta > 0:
            inputs["ref_per_token_logps"] = b["ref_logp"][sl]
        # dapo's normaliser: active tokens in the whole generation batch
        inputs["num_items_in_batch"] = b["completion_mask"].sum()
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        total = total + loss.detach()
    return total, dict(trainer.model.named_parameters())


def _float64_side(weights, b: dict, loss_type: str, beta: float):
    """grpo_lab's loss and gradients on the batch with the model in float64: the truth both
    float32 implementations are held to (the batch's old and reference log-probs, advantages
    and weights are inputs, the same for all three)."""
    model, tokenizer = weights
    return _grpo_lab_side((copy.deepcopy(model).double(), tokenizer), b, loss_type, beta)


def _assert_as_accurate(ours: tuple, theirs: tuple, truth: tuple, b: dict) -> None:
    """TRL's float32 loss and gradients are as accurate as grpo_lab's, against the float64
    truth (numerics.as_accurate_bound): the two compute one formula in another order. Loss
    scale: its per-token terms, |A| r plus beta k3, under 2 max|A| here."""
    (stats, ours), (trl_loss, theirs), (true_stats, truth) = ours, theirs, truth
    true_loss = true_stats["loss"].double()
    allowed = as_accurate_bound(abs(stats["loss"].double() - true_loss).item(),
                                2 * b["advantages"].abs().max().item())
    assert abs(trl_loss.double() - true_loss).item() <= allowed, (trl_loss, true_loss, allowed)
    assert ours.keys() == theirs.keys() == truth.keys()
    off = {name: (p.grad.double() - truth[name].grad).abs().max().item()
           for name, p in ours.items()}
    allowed = as_accurate_bound(max(off.values()),
                                max(p.grad.abs().max().item() for p in truth.values()))
    n_nonzero = 0
    for name, p in theirs.items():
        assert p.grad is not None, name
        trl_off = (p.grad.double() - truth[name].grad).abs().max().item()
        assert trl_off <= allowed, (name, trl_off, allowed)
        n_nonzero += int(p.grad.abs().max() > 0)
    assert n_nonzero > 0.9 * len(ours), "the gradient should reach (almost) every parameter"


@pytest.mark.parametrize("left_padded", [False, True], ids=["same-length", "left-padded"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradients_match_trl(weights, trl_trainers, loss_type, beta, left_padded):
    model, tokenizer = weights
    b = _batch(model, tokenizer, left_padded)
    mask = b["completion_mask"].bool()
    ratio, adv = (b["logp"] - b["old_logp"]).exp(), b["advantages"].unsqueeze(1).expand_as(mask)
    low = mask & (ratio < 1 - EPS_LOW) & (adv < 0)
    high = mask & (ratio > 1 + EPS_HIGH) & (adv > 0)
    assert low.any() and high.any(), "the batch must clip on both sides"
    assert (mask.sum(1).unique().numel() > 2) and (b["prompt_mask"] == 0).any() == left_padded

    stats, ours = _grpo_lab_side(weights, b, loss_type, beta)

    trainer = trl_trainers(loss_type, beta)
    undo = _with_mask_positions(trainer.model) if left_padded else (lambda: None)
    try:
        trl_loss, theirs = _trl_side(trainer, b, beta)
    finally:
        undo()

    # both sides saw the clipping, and (beta > 0) a non-zero KL
    # the clip stat comes back as its token mean times the tokens: the count, to rounding
    assert round(stats["clip_ratio/region_mean"].item()) == (low | high).sum().item()
    metrics = trainer._metrics["train"]
    assert metrics["clip_ratio/low_mean"][-1] > 0 and metrics["clip_ratio/high_mean"][-1] > 0
    if beta > 0:
        assert stats["kl"].item() > 1e-3

    _assert_as_accurate((stats, ours), (trl_loss, theirs),
                        _float64_side(weights, b, loss_type, beta), b)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_accumulated_loss_and_gradients(weights, trl_trainers, loss_type):
    """Two micro-batches of 4 rows with unequal token counts (11 and 14). grpo_lab's
    weights come from the whole batch, so its accumulated gradient is the full-batch one for
    every loss type. TRL's grpo and dr_grpo average equal-size micro-batches and dapo
    divides by the generation batch's token count: the same. TRL's bnpo divides by each
    micro-batch's own token count (its documented 'local batch' normalisation), so its loss
    depends on the split and only equals grpo_lab's without accumulation."""
    model, tokenizer = weights
    b = _batch(model, tokenizer, left_padded=False)
    counts = b["completion_mask"].view(2, 4, -1).sum((1, 2))
    assert counts[0] != counts[1]
    stats, ours = _grpo_lab_side(weights, b, loss_type, 0.04, grad_accum=2)
    trl_loss, theirs = _trl_side(trl_trainers(loss_type, 0.04, grad_accum=2), b, 0.04, 2)
    truth = _float64_side(weights, b, loss_type, 0.04)  # the full batch, in float64
    if loss_type != "bnpo":
        _assert_as_accurate((stats, ours), (trl_loss, theirs), truth, b)
    else:
        whole, _ = _trl_side(trl_trainers(loss_type, 0.04), b, 0.04)  # no accumulation
        allowed = as_accurate_bound(abs(stats["loss"].double() - truth[0]["loss"]).item(),
                                    2 * b["advantages"].abs().max().item())
        assert abs(whole.double() - truth[0]["loss"]).item() <= allowed
        assert (trl_loss - whole).abs() > 1000 * allowed, "TRL's bnpo should depend on the split"


def test_trl_scores_left_padded_rows_at_shifted_positions(weights, trl_trainers):
    """The one convention where TRL 1.16 and grpo_lab differ by design: TRL's
    `_get_per_token_logps_and_entropies` forwards input_ids and attention_mask only, so
    GPT-2 numbers positions from column 0, pads included. generate() and grpo_lab start at
    each row's first real token, so grpo_lab's training log-probs equal the sampling ones;
    TRL's agree on unpadded rows and not on left-padded ones (absolute position embeddings)."""
    model, tokenizer = weights
    b = _batch(model, tokenizer, left_padded=True)
    trainer = trl_trainers("grpo", 0.0)
    with torch.no_grad():
        trl_logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, b["input_ids"], b["attention_mask"], MAX_NEW_TOKENS
        )
    mask = b["completion_mask"].bool()
    diff = ((trl_logp - b["logp"]).abs() * mask).amax(1)  # (B,)
    padded = b["prompt_mask"][:, 0] == 0
    assert padded.any() and (~padded).any()
    # same positions: the same log-probs, to float32 rounding (as close to the float64 ones
    # as grpo_lab's); shifted positions: a different distribution, far beyond that
    truth = float64_logprobs(model, b["input_ids"], b["attention_mask"], MAX_NEW_TOKENS,
                             TEMPERATURE)
    rows = mask & ~padded[:, None]
    allowed = logprob_allowance(b["logp"], truth, rows)
    assert (trl_logp.double() - truth)[rows].abs().max() <= allowed
    assert diff[padded].min() > 1000 * allowed
