"""The task, reward checking, and sampling edge cases."""

import math

import pytest
import torch

from grpo_lab.numerics import float64_logprobs, logprob_allowance
from grpo_lab.sampling import (
    MULTINOMIAL_ERROR,
    SamplingError,
    completion_mask_from_ids,
    decode_loop,
    encode_prompts,
    greedy_completions,
    sample_group,
    sampleable_rows,
    transformers_messages,
)
from grpo_lab.tasks import (
    ProblemStream,
    RewardError,
    addition_reward,
    checked_rewards,
    eval_problems,
)

pytestmark = pytest.mark.numerics  # .ci/kernels runs this file under other CPU kernels


def test_eval_set_is_fixed_and_held_out():
    a, b = eval_problems(256), eval_problems(256)
    assert a == b and len({p.prompt for p in a}) == 256
    held_out = {p.prompt for p in a}
    train = ProblemStream(seed=0).sample(5000)
    assert not held_out & {p.prompt for p in train}
    assert {len(p.prompt) for p in a} == {4, 5, 6}  # prompts of different token lengths


def test_stream_is_seeded_and_resumable():
    s = ProblemStream(seed=3)
    s.sample(10)
    state = s.state()
    nxt = s.sample(5)
    s2 = ProblemStream(seed=3)
    s2.set_state(state)
    assert s2.sample(5) == nxt


def test_addition_reward_takes_trl_signature():
    assert addition_reward(["46", " 7", "45", ""], answer=["46", "7", "46", "0"]) == [
        1.0, 1.0, 0.0, 0.0
    ]


@pytest.mark.parametrize("fn,needle", [
    (lambda completions, **kw: [1.0], "returned 1 rewards for 2 completions"),
    (lambda completions, **kw: [1.0, math.nan], "must be finite numbers"),
    (lambda completions, **kw: [1.0, "high"], "must be finite numbers"),
    (lambda completions, **kw: 1 / 0, "raised ZeroDivisionError"),
])
def test_reward_contract_violations_are_named(fn, needle):
    with pytest.raises(RewardError, match=needle):
        checked_rewards(fn, ["1", "2"], answer=["1", "2"])


def test_completion_mask_keeps_the_first_eos_only():
    ids = torch.tensor([[5, 6, 0, 1, 1], [0, 1, 1, 1, 1], [5, 6, 7, 8, 9]])
    assert completion_mask_from_ids(ids, 0).tolist() == [
        [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]
    ]


def _poison(model):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))


def test_nan_policy_crashes_plain_sampling_like_report_000(tiny):
    model, tok = tiny
    _poison(model)
    with pytest.raises(RuntimeError, match=r"probability tensor contains either `inf`, `nan`"):
        sample_group(model, tok, ["1+2="], 2, 5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_unsampleable_rows_are_what_cpu_multinomial_refuses(bad):
    # on CUDA decode_loop finds these rows itself: multinomial there is a device-side assert
    # that ends the process; the rows it flags must be those the CPU's multinomial refuses
    probs = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    assert sampleable_rows(probs).tolist() == [True, True]
    probs[1, 0] = bad
    assert sampleable_rows(probs).tolist() == [True, False]
    with pytest.raises(RuntimeError) as cpu:
        torch.multinomial(probs, 1)
    assert MULTINOMIAL_ERROR in str(cpu.value)


def test_checked_on_the_device_a_nan_policy_raises_without_reaching_multinomial(tiny, monkeypatch):
    """decode_loop's CUDA path, run on the CPU: the NaN rows never reach torch.multinomial
    (on CUDA a device-side assert), the loop raises the CPU's error at its one host sync per
    token, and a healthy model draws exactly what the plain path draws."""
    model, tok = tiny
    drawn_from = []
    multinomial = torch.multinomial

    def recording(probs, n):
        drawn_from.append(bool(sampleable_rows(probs).all()))
        return multinomial(probs, n)

    monkeypatch.setattr(torch, "multinomial", recording)
    ids, mask = (t.repeat_interleave(4, 0) for t in encode_prompts(tok, ["1+2=", "12+34="],
                                                                   torch.device("cpu")))
    runs = []
    for on_device in (False, True):
        torch.manual_seed(0)
        runs.append(decode_loop(model, tok, ids, mask, 4, 5, 1.0, 0, 1.0, False,
                                check_on_device=on_device)[0])
    assert torch.equal(*runs) and all(drawn_from)
    _poison(model)
    drawn_from.clear()
    with pytest.raises(RuntimeError, match="found before torch.multinomial") as checked:
        decode_loop(model, tok, ids, mask, 4, 5, 1.0, 0, 1.0, False, check_on_device=True)
    assert MULTINOMIAL_ERROR in str(checked.value)
    assert drawn_from and all(drawn_from)  # only stand-in rows were drawn from


def test_safe_sampling_names_the_cause_instead(tiny):
    model, tok = tiny
    _poison(model)
    with pytest.raises(SamplingError, match="no finite logit.*nonfinite_params"):
        sample_group(model, tok, ["1+2="], 2, 5, safe=True)


def test_safe_sampling_is_a_no_op_on_healthy_logits(tiny):
    model, tok = tiny
    torch.manual_seed(1)
    plain = sample_group(model, tok, ["1+2=", "33+44="], 4, 5)
    torch.manual_seed(1)
    safe = sample_group(model, tok, ["1+2=", "33+44="], 4, 5, safe=True)
    assert torch.equal(plain.input_ids, safe.input_ids)


def _transformers_messages(fn):
    return " ".join(transformers_messages(fn))


def test_generation_flags_go_to_generate_not_around_it(tiny):
    """Report 003: sampling flags passed where generate() ignores them draw
    'The following generation flags are not valid and may be ignored'."""
    model, tok = tiny
    ids, mask = encode_prompts(tok, ["1+2="], "cpu")
    wrong = _transformers_messages(lambda: model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, temperature=0.7,
        max_new_tokens=3, pad_token_id=tok.pad_token_id,
    ))
    assert "generation flags are not valid" in wrong  # the capture sees the warning
    ours = _transformers_messages(lambda: (
        greedy_completions(model, tok, ["1+2="], 5),
        sample_group(model, tok, ["1+2="], 2, 5, temperature=0.7, top_k=5, top_p=0.9),
    ))
    assert "generation flags" not in ours


@pytest.mark.parametrize("flags", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["plain", "temperature-topk-topp"])
@pytest.mark.parametrize("safe", [False, True], ids=["unsafe", "safe"])
def test_sampling_loop_draws_what_generate_draws(tiny, flags, safe):
    """sample_group's loop (each prompt run once per group, a row out of the forward once
    it has drawn EOS) and model.generate (every row to the end) with the same flags and
    seed give the same completions and the same sampling log-probs."""
    from transformers import LogitsProcessorList

    from grpo_lab.objective import token_logprobs
    from grpo_lab.sampling import SanitizeLogits, generation_config

    model, tok = tiny
    prompts, G, n_new = ["1+2=", "12+34=", "5+67="], 4, 6  # left-padded prompts
    rows = []  # rows of each forward (every forward embeds its ids first)
    hook = model.transformer.wte.register_forward_pre_hook(
        lambda module, args: rows.append(len(args[0])))
    torch.manual_seed(3)
    ours = sample_group(model, tok, prompts, G, n_new, safe=safe, **flags)
    hook.remove()
    # the prompts once, then after each token but the last the rows that have not drawn EOS
    drew_eos = (ours.completion_ids == tok.eos_token_id).cummax(1).values  # (B, C)
    assert rows == [len(prompts)] + (~drew_eos[:, :-1]).sum(0).tolist()
    assert len(prompts) * G > min(rows[1:]) > 0  # this draw has rows finishing early
    ids, mask = encode_prompts(tok, [p for p in prompts for _ in range(G)], "cpu")
    torch.manual_seed(3)
    out = model.eval().generate(
        input_ids=ids, attention_mask=mask,
        generation_config=generation_config(tok, n_new, True, **flags, output_logits=True,
                                            return_dict_in_generate=True),
        logits_processor=LogitsProcessorList([SanitizeLogits()]) if safe else None,
    )
    assert torch.equal(ours.input_ids, out.sequences)
    theirs = token_logprobs(torch.stack(out.logits, 1) / flags["temperature"],
                            out.sequences[:, ids.shape[1]:])
    # both float32, each as close to the float64 log-probs as the other allows
    truth = float64_logprobs(model, ours.input_ids, ours.attention_mask, ours.completion_length,
                             flags["temperature"])
    allowed = logprob_allowance(theirs, truth, ours.completion_mask)
    m = ours.completion_mask.bool()
    assert (ours.sampling_logprobs.double() - truth)[m].abs().max() <= allowed


def test_a_sanitiser_may_write_in_place(tiny):
    """The model's forwards run in inference mode (tensors autograd may not touch); what a
    learner's sanitiser gets is an ordinary tensor, which it may change in place."""
    model, tok = tiny

    def in_place(scores):
        scores[torch.isnan(scores)] = -math.inf
        return scores.clamp_(max=torch.finfo(scores.dtype).max)

    runs = []
    for sanitize in (in_place, None):
        torch.manual_seed(0)
        runs.append(sample_group(model, tok, ["1+2=", "12+34="], 4, 5, sanitize=sanitize))
    assert torch.equal(runs[0].input_ids, runs[1].input_ids)
    assert not any(t.is_inference() for t in (runs[0].input_ids, runs[0].sampling_logprobs,
                                              runs[0].completion_mask))


def test_sampling_nothing_is_refused(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        sample_group(model, tok, ["1+2="], 2, 0)


def test_a_truncated_completion_scores_zero():
    """The task's contract: the sum followed by end-of-text. "12   " cut off at the
    length cap has not answered; the same text that ended scores 1."""
    assert addition_reward(["12   ", "12", " 7"], ["12", "12", "7"],
                           truncated=[True, False, False]) == [0.0, 1.0, 1.0]
    assert addition_reward(["12"], ["12"]) == [1.0]  # no truncation column: none was cut


def test_rollout_marks_rows_without_eos_as_truncated(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    r = sample_group(model, tok, ["1+2=", "12+34="], 4, 2)  # 2 tokens: many rows cut off
    has_eos = (r.completion_ids == tok.eos_token_id).any(-1)
    assert torch.equal(r.truncated, ~has_eos)
    assert r.truncated.any() and (~r.truncated).any(), r.truncated


def test_sanitising_comes_after_the_temperature(tiny):
    """A +inf logit made finite (the largest float) before a temperature below 1 divides it
    overflows again to inf and the draw fails; sanitised after the temperature it is
    simply the certain token."""
    model, tok = tiny

    class InfLogit(torch.nn.Module):  # the tiny model with token 5's logit set to +inf
        def __init__(self):
            super().__init__()
            self.inner = model

        def get_input_embeddings(self):
            return model.get_input_embeddings()

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            out.logits[..., 5] = float("inf")
            return out

    r = sample_group(InfLogit(), tok, ["1+2="], 2, 3, temperature=0.5, safe=True)
    assert (r.completion_ids == 5).all()
