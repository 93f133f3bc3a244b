"""graphs.py's static decoder against the eager decode loop. On the CPU it runs its step
without a CUDA graph over the same static buffers a graph would replay; the graph itself is
checked on a GPU by benchmarks/decode_graphs.py (benchmarks/gpu_checks.sh)."""

import copy
import gc
import importlib.util
import json
import weakref
from functools import partial
from pathlib import Path

import pytest
import torch

from grpo_lab import fast, graphs
from grpo_lab.config import ConfigError
from grpo_lab.fast import cached_forward
from grpo_lab.numerics import as_accurate_bound
from grpo_lab.objective import completion_logits, position_ids_from_mask
from grpo_lab.policy import load_policy
from grpo_lab.sampling import decode_loop, encode_prompts

pytestmark = pytest.mark.numerics  # .ci/kernels runs this file under other CPU kernels

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_graphs.py"
PROMPTS = ["1+2=", "12+34=", "5+67=", "40+4="]  # left-padded to different lengths


def decode(model, tok, static: bool, seed: int, max_new_tokens: int = 5, group: int = 4):
    ids, mask = encode_prompts(tok, PROMPTS, torch.device("cpu"))
    ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        completions, raw = decode_loop(model, tok, ids, mask, group, max_new_tokens, 1.0, 0,
                                       1.0, True, static=static)
    return ids, mask, completions, raw


def only_decoder(model) -> graphs.StaticDecoder:
    """The one static decoder kept for the model (beside its prompt forwards)."""
    decoder, = (g for g in graphs._KEPT[model].values() if isinstance(g, graphs.StaticDecoder))
    return decoder


def test_the_static_decoder_draws_what_the_eager_loop_draws(tiny):
    """Over rollouts whose rows finish at different steps: the same tokens, and at every
    drawn position raw logits as accurate against the float64 forward as the eager loop's
    (the static step runs finished rows too and attends over masked columns, so it rounds
    in another order; a wrong column, position or mask is off by the logits' own size)."""
    model, tok = tiny
    model64 = copy.deepcopy(model).double()
    finished_early = 0
    for seed in range(6):
        ids, mask, eager, raw_eager = decode(model, tok, static=False, seed=seed)
        _, _, static, raw_static = decode(model, tok, static=True, seed=seed)
        assert torch.equal(static, eager), seed
        drawn = (eager != tok.pad_token_id)
        finished_early += int((~drawn).any(1).sum())
        # the truth: each drawn token's logits, teacher-forced through the float64 model
        C = eager.shape[1]
        full_mask = torch.cat([mask, drawn.long()], 1)
        with torch.no_grad():
            truth = completion_logits(model64, torch.cat([ids, eager], 1), full_mask, C)
        real = drawn[..., None]
        err_eager = ((raw_eager.double() - truth).abs() * real).max().item()
        err_static = ((raw_static.double() - truth).abs() * real).max().item()
        assert err_static <= as_accurate_bound(err_eager, truth.abs().max().item()), (
            seed, err_static, err_eager)
        assert torch.equal(raw_static[~drawn], torch.zeros_like(raw_static[~drawn]))
    assert finished_early > 0, "no row finished early: the test would not cover padding rows"


def test_a_reused_decoder_keeps_nothing_of_the_last_rollout(tiny):
    """The next rollout of the same shape reuses the buffers: what the last one left there,
    even NaN, must not reach it (a masked key's weight is 0, and 0 x NaN is NaN)."""
    model, tok = tiny
    _, _, first, raw_first = decode(model, tok, static=True, seed=0)
    decoder = only_decoder(model)
    with torch.inference_mode():  # the buffers are inference tensors
        for t in decoder.keys + decoder.values:
            t.fill_(float("nan"))
    _, _, again, raw_again = decode(model, tok, static=True, seed=0)
    assert only_decoder(model) is decoder  # reused, not rebuilt
    prompts, = (g for g in graphs._KEPT[model].values() if isinstance(g, graphs.GraphedCall))
    assert prompts.fn is graphs._prompt_pass and prompts.calls == 2  # the prompts' forward too
    assert torch.equal(again, first) and torch.equal(raw_again, raw_first)


def test_one_new_token_and_every_row_done_at_once(tiny):
    """max_new_tokens=1 makes no decode step; a rollout whose rows all stop before the
    last step ends the loop as the eager one does."""
    model, tok = tiny
    for n in (1, 2):
        _, _, eager, raw_eager = decode(model, tok, static=False, seed=3, max_new_tokens=n)
        _, _, static, raw_static = decode(model, tok, static=True, seed=3, max_new_tokens=n)
        assert torch.equal(eager, static) and raw_eager.shape == raw_static.shape


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_the_prompts_forward_over_static_inputs(tiny, amp):
    """The sampler's forward over the prompts through graphed() (static_prompt_forward): at
    a prompt shape's first call the forward itself, from its second over static copies of
    the inputs (a graph on a GPU); either way the eager forward's last-column logits and
    every layer's keys and values bit for bit and in its dtypes (bf16 under autocast), each
    result a copy that the next call leaves alone; None where the static decoder would not
    run."""
    model, tok = tiny
    batches = [PROMPTS, ["3+4=", "98+76=", "1+1=", "22+2="], PROMPTS[::-1]]  # one shape
    with torch.inference_mode(), torch.autocast("cpu", dtype=amp or torch.float32,
                                                enabled=amp is not None):
        expected, got = [], []
        for prompts in batches:
            ids, mask = encode_prompts(tok, prompts, torch.device("cpu"))
            positions = position_ids_from_mask(mask)
            logits, cache = cached_forward(model)(ids, mask, positions)
            expected.append((logits[:, -1:], cache))
            got.append(graphs.static_prompt_forward(model, ids, mask, positions, static=True))
        assert graphs.static_prompt_forward(model, ids, mask, positions, static=False) is None
    call, = (g for g in graphs._KEPT[model].values() if isinstance(g, graphs.GraphedCall))
    assert call.fn is graphs._prompt_pass and call.calls == 3 and call.run.output is not None
    for (logits, cache), (e_logits, e_cache) in zip(got, expected, strict=True):
        assert logits.dtype == e_logits.dtype == (amp or torch.float32)
        assert torch.equal(logits, e_logits)
        assert len(cache) == len(e_cache) == model.config.n_layer
        for (k, v), (e_k, e_v) in zip(cache, e_cache, strict=True):
            assert k.dtype == e_k.dtype and torch.equal(k, e_k) and torch.equal(v, e_v)
    assert graphs.static_prompt_forward(model, ids[:0], mask[:0], positions[:0],
                                        static=True) is None  # no rows: nothing to replay

    class Float32Head(torch.nn.Linear):  # float32 logits under autocast, keys in bf16
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return super().forward(x.float())
    head = model.lm_head
    model.lm_head = Float32Head(head.in_features, head.out_features, bias=False)
    assert graphs.static_prompt_forward(model, ids, mask, positions, static=True) is None
    model.lm_head = head
    model.config.reorder_and_upcast_attn = True  # an option gpt2_forward leaves out
    assert graphs.static_prompt_forward(model, ids, mask, positions, static=True) is None


def prompt_cache(model, tok, group=2):
    ids, mask = encode_prompts(tok, PROMPTS[:2], torch.device("cpu"))
    with torch.no_grad():
        _, cache = cached_forward(model)(ids, mask, position_ids_from_mask(mask))
    return [(k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)) for k, v in cache]


def test_which_decoder_the_environment_gets(tiny, monkeypatch):
    """GRPO_LAB_CUDA_GRAPHS: 1 asks for graphs (only where there is a GPU: on the CPU the
    eager loop runs), anything but 0 or 1 is refused naming the variable, as soon as a
    policy loads; static=True or False decides for one call; transformers' cache object
    never gets one."""
    model, tok = tiny
    cache = prompt_cache(model, tok)
    monkeypatch.setenv(graphs.GRAPHS_ENV, "yes")
    with pytest.raises(ConfigError, match="GRPO_LAB_CUDA_GRAPHS must be 0 or 1"):
        graphs.static_decoder(model, cache, 10)
    with pytest.raises(ConfigError, match="GRPO_LAB_CUDA_GRAPHS must be 0 or 1"):
        load_policy("cpu")  # before a run starts, not at its first sample
    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
    assert graphs.static_decoder(model, cache, 10) is None  # no CUDA here
    assert graphs.static_decoder(model, cache, 10, static=False) is None
    assert graphs.static_decoder(model, object(), 10, static=True) is None
    decoder = graphs.static_decoder(model, cache, 10, static=True)
    assert not decoder.run.use_graph and decoder.keys[0].shape[2] == 16  # 10 rounded up to 16
    assert graphs.static_decoder(model, cache, 13, static=True) is decoder  # also 16


def test_decoders_follow_the_parameters_and_stay_few(tiny):
    """A decoder is kept per batch shape, per set of parameter tensors (a graph reads the
    parameters where they were at capture: new tensors need a new one) and per set of
    modules (a graph replays the modules it recorded), at most KEPT_PER_MODEL per model."""
    model, tok = tiny
    cache = prompt_cache(model, tok)
    first = graphs.static_decoder(model, cache, 8, static=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0)  # in place: the same tensors
    assert graphs.static_decoder(model, cache, 8, static=True) is first
    mlp = model.transformer.h[0].mlp
    act = mlp.act
    mlp.act = copy.deepcopy(act)  # a module swapped in, no parameter moved (fuse_gelu's kind)
    swapped = graphs.static_decoder(model, cache, 8, static=True)
    assert swapped is not first
    mlp.act = act
    assert graphs.static_decoder(model, cache, 8, static=True) is first
    for name, p in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(p.detach().clone()))
    assert graphs.static_decoder(model, cache, 8, static=True) is not first
    for i in range(graphs.KEPT_PER_MODEL + 1):
        graphs.static_decoder(model, cache, 16 + 8 * i, static=True)
    assert len(graphs._KEPT[model]) == graphs.KEPT_PER_MODEL


def test_a_hook_on_any_module_keeps_graphs_off(tiny):
    """A replay skips Python: a hook would run once, at capture, then never again."""
    model, _ = tiny
    assert not graphs._hooked(model)
    handle = model.transformer.h[1].mlp.register_forward_hook(lambda *a: None)
    assert graphs._hooked(model)
    handle.remove()
    assert not graphs._hooked(model)


def test_under_bf16_autocast_the_cache_is_bf16_and_as_accurate(tiny):
    """Sampling under autocast (amp='bf16'): the static cache takes the keys' bfloat16, and
    each path's raw logits for the tokens it drew are as accurate against the float64
    forward as the eager loop's (bf16 rounding can turn a draw, so each is measured on its
    own tokens)."""
    model, tok = tiny
    model64 = copy.deepcopy(model).double()
    errors, scale = {}, 0.0
    for static in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ids, mask, drawn_ids, raw = decode(model, tok, static=static, seed=1)
        drawn = drawn_ids != tok.pad_token_id
        with torch.no_grad():
            truth = completion_logits(model64, torch.cat([ids, drawn_ids], 1),
                                      torch.cat([mask, drawn.long()], 1), drawn_ids.shape[1])
        errors[static] = ((raw.double() - truth).abs() * drawn[..., None]).max().item()
        scale = max(scale, truth.abs().max().item())
    decoder = only_decoder(model)
    assert decoder.keys[0].dtype == torch.bfloat16 and decoder.amp == (True, torch.bfloat16)
    assert errors[True] <= as_accurate_bound(errors[False], scale), errors


def load_script():
    spec = importlib.util.spec_from_file_location("decode_graphs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_runs_check_passes_the_graphs_and_fails_wrong_ones(tmp_path, monkeypatch,
                                                                   capsys):
    """benchmarks/decode_graphs.py (the GPU run's check, here without graphs): exit 0 and its
    figures for the sampler, the reference's forward and the training pass as they are; exit
    1, naming the part, for one whose logits or gradients are off by a rounding error's size
    many times over."""
    script = load_script()
    out = tmp_path / "graphs.json"
    assert script.main(["--batches", "2", "--warmup", "1", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["identical_completions"] == 2
    for part in ("sampler", "reference", "training"):
        assert figures[part]["kept"] >= 1 and figures[part]["graphs"] == 0, figures[part]
        assert 0 < figures[part]["worst_error_over_bound"] <= 1, figures[part]
    def off(values):
        return ([None if v is None else v * (1 + 1e-4) for v in values]
                if isinstance(values, list) else values * (1 + 1e-4))

    wrong = {"sampler": (graphs.StaticDecoder, "step"),
             "reference": (graphs.GraphedCall, "__call__"),
             "training": (graphs.TrainingCall, "backward_pass")}
    for part, (cls, name) in wrong.items():
        right = getattr(cls, name)
        with monkeypatch.context() as m:
            m.setattr(cls, name, lambda self, *a, right=right: off(right(self, *a)))
            assert script.main(["--batches", "2", "--warmup", "1"]) == 1
        assert f"FAILED: the {part}'s static path is less accurate" in capsys.readouterr().out


def test_finished_rows_never_look_up_the_pad_id(tiny):
    """The eager loop drops a finished row; the static step keeps it and feeds it id 0, not
    the pad id, which may lie outside the embedding (report 002): sampling then runs on as
    the eager loop does, and its later failure is met where it would be without graphs."""
    model, tok = tiny

    class PadOutside:  # the tokenizer of report 002: pad id = the vocabulary's size
        pad_token_id = model.get_input_embeddings().num_embeddings
        eos_token_id = tok.eos_token_id

    ids, mask = encode_prompts(tok, ["1+2=", "3+4="], torch.device("cpu"))  # no padding
    ids, mask = ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)
    out = {}
    for static in (False, True):
        torch.manual_seed(0)
        with torch.no_grad():
            out[static] = decode_loop(model, PadOutside, ids, mask, 8, 8, 3.0, 0, 1.0, False,
                                      static=static)
    assert (out[True][0] == PadOutside.pad_token_id).any(), "no row finished early"
    assert torch.equal(out[True][0], out[False][0])


def test_graphs_go_with_their_model():
    """A decoder and a graphed forward hold their model weakly: a model no longer used is
    freed with them (on a GPU, their buffers and graphs' memory)."""
    gc.collect()  # the models of earlier tests, dead already, out of the count
    model, tok = load_policy("cpu")  # a model of this test's own: nothing else holds it
    graphs.static_decoder(model, prompt_cache(model, tok), 8, static=True)
    with torch.inference_mode():
        reference_logits(model, *rollout(model, tok))
    assert {type(g) for g in graphs._KEPT[model].values()} == {graphs.StaticDecoder,
                                                             graphs.GraphedCall}
    held = len(graphs._KEPT)
    assert model in graphs._KEPT
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None and len(graphs._KEPT) == held - 1


def rollout(model, tok, group=4, seed=0):
    """A sampled rollout's (ids, mask, completion width), as the reference's forward gets it."""
    ids, mask, completions, _ = decode(model, tok, static=False, seed=seed, group=group)
    drawn = (completions != tok.pad_token_id).long()
    return torch.cat([ids, completions], 1), torch.cat([mask, drawn], 1), completions.shape[1]


def reference_logits(model, ids, mask, C, graphed: bool = True):
    """The reference's forward as the step runs it (fast.shared_prompt_logits), through
    graphs.graphed forced on (the static path, on the CPU without a graph) or eagerly."""
    run_forward = partial(graphs.graphed, static=True) if graphed else None
    return fast.shared_prompt_logits(model, ids, mask, C, run_forward=run_forward)


def test_the_reference_forward_over_static_inputs(tiny):
    """graphed(): a set of input shapes runs the forward itself at its first call and over
    static copies of the inputs (a graph on a GPU) from its second; either way the forward's
    logits bit for bit (the same shapes, the same kernels), each result a copy that later
    calls leave alone, one per set of input shapes; outside inference mode ordinary tensors
    (under no_grad the forward itself; with autograd a TrainingCall, tested below)."""
    model, tok = tiny
    ids, mask, C = rollout(model, tok, seed=0)
    other = ids.clone()
    other[:, -C:] = other[:, -C:].flip(0)  # other completions, the same shapes
    calls = [(ids, mask, C), (other, mask, C), (ids, mask, C), rollout(model, tok, group=2)]
    with torch.inference_mode():
        expected = [reference_logits(model, *a, graphed=False) for a in calls]
        got = [reference_logits(model, *calls[0])]
        call = next(reversed(graphs._KEPT[model].values()))
        assert isinstance(call, graphs.GraphedCall) and call.run.output is None  # no capture
        got += [reference_logits(model, *a) for a in calls[1:3]]
        assert call.run.output is not None  # the static path ran from the second call
        kept = len(graphs._KEPT[model])
        got.append(reference_logits(model, *calls[3]))  # fewer rows
    assert len(graphs._KEPT[model]) == kept + 1  # one per set of input shapes
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)  # checked after every call: none overwrote an earlier one
    for mode in (torch.enable_grad, torch.no_grad):
        with mode():
            plain = reference_logits(model, ids, mask, C)
        assert not plain.is_inference() and plain.requires_grad == (mode is torch.enable_grad)
    assert len(graphs._KEPT[model]) == kept + 1


def _scaled(model, x):  # a module-level function of its tensor, as graphed() asks for
    return x * model.transformer.ln_f.weight[0]


def test_graphed_returns_copies_whatever_the_caller_does(tiny):
    """graphed()'s results are copies: the static path's output buffer, overwritten by the
    next call, never reaches the caller (the step's caller copies again in scale_logits;
    graphed() does not count on it)."""
    model, _ = tiny
    xs = [torch.full((3,), float(i)) for i in range(4)]
    with torch.inference_mode():
        got = [graphs.graphed(_scaled, model, x, static=True) for x in xs]
        expected = [_scaled(model, x) for x in xs]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_a_first_replay_is_checked_against_the_warm_up():
    """graphs._same_output: a replay that ran nothing (the NaN it was filled with) or read
    other inputs fails; another GEMM algorithm's rounding passes; an overflow to inf passes
    where the warm-up overflowed too."""
    expected = torch.tensor([[1.0, -2.0, 4.0], [0.5, float("inf"), -3.0]])
    same = graphs._same_output
    assert same(expected.clone(), expected)
    assert same(expected * torch.tensor([1.01, 0.99, 1.0]), expected)  # rounding-sized
    assert not same(torch.full_like(expected, float("nan")), expected)  # ran nothing
    assert not same(expected.flip(0), expected)  # other inputs
    assert not same(expected + torch.tensor([0.0, 0.0, 0.5]), expected)  # 12% of 4
    assert not same(expected.nan_to_num(posinf=7.0), expected)  # inf in one only
    bf16 = expected.bfloat16()
    assert same(bf16.clone(), bf16)


def test_the_reference_forward_takes_the_graph_where_it_applies(tiny, monkeypatch):
    """The step's reference forward runs through graphed() (a CUDA graph on a GPU with
    GRPO_LAB_CUDA_GRAPHS=1: here made to apply on the CPU) and gives the same logits."""
    from grpo_lab.config import preset
    from grpo_lab.step import make_batch
    from grpo_lab.trainer import Trainer

    batches = []
    for applies in (False, True):
        run = Trainer(preset("stable", steps=1, eval_every=0, eval_size=16)).run
        problems = run.stream.sample(run.cfg.prompts_per_step)
        monkeypatch.setattr(graphs, "_applies", lambda m, d, static, a=applies: a)
        torch.manual_seed(0)
        batches.append(make_batch(run, problems))
        kept = graphs._KEPT.get(run.reference, {}).values()
        assert any(isinstance(g, graphs.GraphedCall) for g in kept) == applies
    assert torch.equal(batches[0].rollout.input_ids, batches[1].rollout.input_ids)
    assert torch.equal(batches[0].ref_logp, batches[1].ref_logp)


def test_without_a_graph_the_output_is_still_one_buffer():
    """Recorded without a graph (the CPU, a failed capture) keeps a replay's semantics: one
    output buffer that the next call overwrites, so the CPU tests see what a GPU would; a
    new one when the output's shape or dtype changes."""
    outs = iter([torch.ones(2), torch.full((2,), 2.0), torch.ones(2, dtype=torch.float64)])
    run = graphs.Recorded(lambda: next(outs), torch.device("cpu"), (False, torch.bfloat16),
                          graph=False)
    a = run()
    b = run()
    assert a is b and torch.equal(a, torch.full((2,), 2.0))  # overwritten, as a replay's
    c = run()
    assert c.dtype == torch.float64 and torch.equal(c, torch.ones(2, dtype=torch.float64))


def _trainer_parameters(monkeypatch, graphed: bool, accum: int, steps: int = 3):
    from grpo_lab.config import preset
    from grpo_lab.trainer import Trainer

    monkeypatch.setattr(graphs, "_applies", lambda m, d, static: graphed)
    trainer = Trainer(preset("stable", seed=0, steps=steps, eval_every=0, checkpoint_every=0,
                             grad_accum_steps=accum))
    for _ in range(steps):
        trainer.step()
    calls = [c.calls for c in graphs.training_calls(trainer.policy)]
    return torch.cat([p.detach().flatten() for p in trainer.policy.parameters()]), calls


@pytest.mark.parametrize("accum", [1, 2, 3])
def test_the_training_pass_over_static_inputs_trains_as_the_eager_one(monkeypatch, accum):
    """The trainer's training forward and backward through graphed() (CUDA graphs on a GPU
    with GRPO_LAB_CUDA_GRAPHS=1; here the same calls over static inputs without a graph):
    after three steps the parameters bit for bit those of the eager pass, in one batch,
    accumulated over two micro-batches of one shape (the second reuses the first one's
    buffers), and over three of unequal sizes (22, 21 and 21 rows, each its own shapes); the
    same kernels in the same order, with GPT-2's tied embedding and LM head (float32, where
    autocast's weight cache, which a graph must do without, plays no part)."""
    eager, no_calls = _trainer_parameters(monkeypatch, graphed=False, accum=accum)
    static, calls = _trainer_parameters(monkeypatch, graphed=True, accum=accum)
    assert no_calls == [] and max(calls) >= 2  # the static path ran, from a shape's 2nd call
    assert torch.equal(static, eager)


def _lm_head_only(model, hidden):  # a forward that leaves every parameter but wte unused
    return model.lm_head(hidden)


def _gradients(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_two_forwards_before_one_backward_and_unused_parameters(tiny):
    """The static path holds one forward's activations per shape: a backward of an earlier
    forward of the same shape runs that forward again first, so each output's gradient is
    its own. A parameter the forward does not use gets no gradient, as eagerly; gradients
    from two backwards add up in .grad."""
    model, _ = tiny
    model = copy.deepcopy(model).train()
    xs = [torch.randn(2, 3, model.config.n_embd, generator=torch.Generator().manual_seed(i))
          for i in range(3)]
    expected = []  # eagerly: the first one's gradient, then both added up
    for pair in ((xs[1],), (xs[1], xs[2])):
        model.zero_grad(set_to_none=True)
        for x in pair:
            (_lm_head_only(model, x) ** 2).sum().backward()
        expected.append(_gradients(model))
    model.zero_grad(set_to_none=True)
    graphs.graphed(_lm_head_only, model, xs[0], static=True)  # a shape's first call: eager
    call = graphs.training_calls(model)[-1]
    first = graphs.graphed(_lm_head_only, model, xs[1], static=True)
    second = graphs.graphed(_lm_head_only, model, xs[2], static=True)
    assert call.calls == 3 and call.forwards == 2
    assert torch.equal(first, _lm_head_only(model, xs[1]).detach())
    for output, want in ((first, expected[0]), (second, expected[1])):
        (output ** 2).sum().backward()  # the first forward's, after the second's ran
        got = _gradients(model)
        assert [n for n, g in got.items() if g is not None] == ["transformer.wte.weight"]
        assert all(want[n] is None for n, g in got.items() if g is None)
        assert torch.equal(got["transformer.wte.weight"], want["transformer.wte.weight"])


def test_no_training_graph_under_a_process_group(tiny, tmp_path):
    """With a process group up (DDP), the training forward stays eager: DDP's gradient
    bookkeeping follows the eager forward (the trainer relies on this check alone)."""
    import torch.distributed as dist

    model, _ = tiny
    model = copy.deepcopy(model).train()
    x = torch.randn(2, 3, model.config.n_embd)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        for _ in range(3):
            graphs.graphed(_lm_head_only, model, x, static=True)
        assert graphs.training_calls(model) == []
    finally:
        dist.destroy_process_group()
    for _ in range(2):
        graphs.graphed(_lm_head_only, model, x, static=True)
    assert len(graphs.training_calls(model)) == 1


def test_training_passes_stay_few_in_all_and_let_their_model_go(tiny):
    """Each kept training pass holds a model's gradients and activations: at most
    KEPT_TRAINING are kept in the process, over every model (a notebook keeps dozens of
    trainers), the least recently used dropped first; none keeps its model alive."""
    model, _ = tiny
    x = torch.randn(2, 3, model.config.n_embd)
    models = [copy.deepcopy(model).train() for _ in range(graphs.KEPT_TRAINING + 1)]
    for m in models:
        for _ in range(2):
            graphs.graphed(_lm_head_only, m, x, static=True)
    assert len(graphs._KEPT_TRAINING) == graphs.KEPT_TRAINING
    assert graphs.training_calls(models[0]) == []  # the oldest went
    assert all(len(graphs.training_calls(m)) == 1 for m in models[1:])
    alive = weakref.ref(models[-1])
    del models, m
    gc.collect()
    assert alive() is None


def test_a_second_backward_and_an_input_that_wants_a_gradient(tiny):
    """A backward with retain_graph, then another of the same output: the activations the
    first one used are gone (on a GPU its temporaries took their memory), so the second
    runs the forward again and gets the same gradient, as eagerly (.grad twice it). An
    input that requires a gradient: no TrainingCall (it differentiates parameters only),
    the forward itself."""
    model, _ = tiny
    model = copy.deepcopy(model).train()
    x = torch.randn(2, 3, model.config.n_embd, generator=torch.Generator().manual_seed(0))
    (_lm_head_only(model, x) ** 2).sum().backward(retain_graph=True)
    once = model.transformer.wte.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    for _ in range(2):
        out = graphs.graphed(_lm_head_only, model, x, static=True)
    loss = (out ** 2).sum()
    loss.backward(retain_graph=True)
    assert torch.equal(model.transformer.wte.weight.grad, once)
    loss.backward()
    assert torch.equal(model.transformer.wte.weight.grad, once + once)
    calls = len(graphs.training_calls(model))
    wanting = x.clone().requires_grad_()
    for _ in range(2):
        (graphs.graphed(_lm_head_only, model, wanting, static=True) ** 2).sum().backward()
    assert len(graphs.training_calls(model)) == calls and wanting.grad is not None


def _leaves(output):
    """The tensors whose gradient accumulators output's autograd graph reaches."""
    seen, todo, found = set(), [output.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.append(node.variable)
        todo.extend(n for n, _ in node.next_functions)
    return found


def test_the_training_forward_differentiates_aliases_of_the_parameters(tiny):
    """The static forward runs on aliases of the parameters (the same storage), never on
    the parameters themselves: their gradient accumulators are autograd's for the replayed
    call, made on the caller's stream, and none enters a capture (on a GPU, one a live
    graph holds would make the capture wait on the default stream). After the backward,
    the call keeps no tensor on the parameters' storage; a backward after the model has
    gone still runs, as eagerly."""
    model, _ = tiny
    model = copy.deepcopy(model).train()
    x = torch.randn(2, 3, model.config.n_embd)
    params = list(model.parameters())
    for _ in range(2):
        out = graphs.graphed(_lm_head_only, model, x, static=True)
    call = graphs.training_calls(model)[-1]
    leaves = _leaves(call.output)
    assert len(leaves) == 1 and leaves[0] is not model.transformer.wte.weight
    assert leaves[0].data_ptr() == model.transformer.wte.weight.data_ptr()
    # the caller's output: the replayed call, a Function of the parameters themselves
    assert {id(v) for v in _leaves(out)} == {id(p) for p in params}
    (out ** 2).sum().backward()
    assert call.output is None and call.aliases is None
    held = [t for t in (call.static_output, *call.inputs, *call.grads)]
    storage = {p.untyped_storage().data_ptr() for p in params}
    assert not any(t.untyped_storage().data_ptr() in storage for t in held)
    out = graphs.graphed(_lm_head_only, model, x, static=True)
    wte = model.transformer.wte.weight
    del model, params, leaves
    gc.collect()
    (out ** 2).sum().backward()  # the model has gone; its parameter is the caller's
    assert wte.grad is not None and wte.grad.shape == wte.shape


def test_under_bf16_a_shapes_first_call_trains_as_its_later_ones(tiny):
    """A training pass's first call of a shape runs fn itself, and later ones the graph
    (here its static path). Under bf16 autocast both run without autocast's weight cache, so
    the gradients are bit for bit the same whichever call it is: a run resumed from a
    checkpoint, whose first call of a shape was a later one in the run it resumes, trains
    as that run did (reliability.check_resumes with the graphs on)."""
    model, tok = tiny
    model = copy.deepcopy(model).train()
    ids, mask, C = rollout(model, tok, seed=2)
    grads = []
    for _ in range(3):  # the first call: fn itself; the second and third: the static path
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = reference_logits(model, ids, mask, C)
        (logits.float().logsumexp(-1) * mask[:, -C:]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    call, = graphs.training_calls(model)
    assert call.calls == 3 and call.grads is not None  # the static path ran
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[1], grads[2])


def test_a_failed_capture_warns_and_runs_without_a_graph(tiny):
    """A capture that fails (here: asked for on the CPU, where there is no CUDA stream) is
    one RuntimeWarning naming what could not be captured; the forward, and the training
    pass's gradients, then come out as eagerly, and no second capture is tried."""
    model, _ = tiny
    model = copy.deepcopy(model).train()
    x = torch.randn(2, 3, model.config.n_embd, generator=torch.Generator().manual_seed(0))
    recorded = graphs.Recorded(lambda: _lm_head_only(model, x), torch.device("cpu"),
                               (False, torch.bfloat16), graph=True)
    with pytest.warns(RuntimeWarning, match="a forward could not be captured"):
        out = recorded()
    assert not recorded.use_graph and torch.equal(out, _lm_head_only(model, x))
    (_lm_head_only(model, x) ** 2).sum().backward()
    expected = model.transformer.wte.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    graphs.graphed(_lm_head_only, model, x, static=True)  # the shape's first call: eager
    model.zero_grad(set_to_none=True)
    call = graphs.training_calls(model)[-1]
    call.use_graph = True
    with pytest.warns(RuntimeWarning, match="a training forward and its backward could not"):
        out = graphs.graphed(_lm_head_only, model, x, static=True)
    (out ** 2).sum().backward()
    assert call.broken and call.forward_graph is None
    assert torch.equal(model.transformer.wte.weight.grad, expected)
