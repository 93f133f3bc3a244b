"""GPT-2's forwards replayed as CUDA graphs: the sampler's forward over the prompts and its
one-token decode step, the reference's forward, and the training forward with its backward.

On a GPU the course's small batches wait on the host, not on the card: each of GPT-2's ~17
operators per layer is a kernel launch issued from Python, and the kernels run in less
time than their launches take (benchmarks/step_profile.py; on GPT-2 124M the sampler is
about 36% of a step's operators and the reference's forward 13%). A CUDA graph records the
launches of a computation once and replays them all with one call. It replays fixed
addresses, so the computation reads and writes static buffers, set in place before each
replay (`Recorded` captures and replays; a failed capture warns, and the computation then
runs as it is).

- The decode step (`static_decoder`, `StaticDecoder`): the keys and values of every column
  a rollout can reach (prompt + max_new_tokens - 1, rounded up to a multiple of 8 so that
  prompts of nearby lengths share a graph), the new token, its position and the key mask;
  the new column's keys and values are written into the cache inside the step
  (`fast.gpt2_forward`'s `write_at`). Finished rows stay in the batch, since a graph's
  shapes are fixed: they run on token id 0 (a real token: the pad id may lie outside the
  embedding, report 002), and their logits are replaced by zeros as the eager loop's are, so
  every row draws as it would there.
- The sampler's forward over the prompts (`static_prompt_forward`, through `graphed`), one
  graph per prompt shape: with the decode step replayed, the one forward of a rollout that
  still ran eagerly.
- The reference's forward (`graphed`): fast.shared_prompt_logits' forward from the distinct
  prompts (found on the host first: their number decides the shapes), over static copies of
  its inputs, one graph per set of input shapes.
- The training forward (`graphed` with autograd on, `TrainingCall`): the same forward of the
  policy and its backward for the parameters, two graphs per set of input shapes; the loss
  stays eager (it is the learner's code), and the parameters' gradients reach .grad through
  autograd, as an eager backward's do. With the decode step's and the reference's graphs,
  it was over half of the step on an H200 (benchmarks/gpu/phase-times.txt).

GRPO_LAB_CUDA_GRAPHS=1 turns them on. benchmarks/decode_graphs.py (in benchmarks/gpu_checks.sh)
checks them against the eager computations, which are the reference: on an H200 (2026-11-28,
benchmarks/gpu/decode-graphs*.txt) the decode step and the reference's forward gave the same
completions in every batch and the same error against float64, bf16 and float32; the
prompts' forward and the training pass have not yet run as graphs on a GPU. Off by default
until they have, and the notebooks have run with the graphs on (the run's notebooks take
GRPO_LAB_CUDA_GRAPHS from NOTEBOOK_GRAPHS). On the CPU the same code runs over the same
static buffers without a graph (`static=True`), which is how tests/test_graphs.py checks the
buffers against the eager path, and benchmarks/static_notebooks.sh runs every notebook.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from functools import partial

import torch
from torch.nn.utils.stateless import _reparametrize_module

from .config import ConfigError
from .fast import _global_hooks, gpt2_forward, hooked, writes_out

GRAPHS_ENV = "GRPO_LAB_CUDA_GRAPHS"
COLUMN_MULTIPLE = 8  # the cache's columns rounded up to this: fewer distinct graphs
# graphs kept per model (decoders and forwards; each holds its buffers and its graph's
# memory): the reference's forward has one per prompt length x completion length
KEPT_PER_MODEL = 16
# training passes kept in the process, all models together (a notebook keeps dozens of
# trainers): each holds its parameters' gradients (GPT-2 124M: 0.5 GiB in float32) and its
# forward's activations between the forward and the backward
KEPT_TRAINING = 3

_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: graph}
_KEPT_TRAINING: OrderedDict = OrderedDict()  # (id(model), key) -> TrainingCall (weakly to model)


def graphs_wanted() -> bool:
    """$GRPO_LAB_CUDA_GRAPHS: '1' on, '0' or unset off."""
    value = os.environ.get(GRAPHS_ENV, "0").strip() or "0"
    if value not in ("0", "1"):
        raise ConfigError(f"{GRAPHS_ENV} must be 0 or 1 (got {value!r})")
    return value == "1"


@contextmanager
def graphs_off():
    """GRPO_LAB_CUDA_GRAPHS=0 inside (the value before restored after): the eager
    computations, for a tool that measures a step's own memory (tools/memory.py). A graph
    keeps static buffers and a memory pool of its own from one step to the next, and a
    training pass copies its gradients out of them: with the graphs on, two micro-batches
    of one shape no longer peak at one micro-batch's activations."""
    before = os.environ.get(GRAPHS_ENV)
    os.environ[GRAPHS_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GRAPHS_ENV, None)
        else:
            os.environ[GRAPHS_ENV] = before


def _hooked(model: torch.nn.Module) -> bool:
    """A hook a replay would skip (it runs once, at capture), on any of the model's modules
    or on every module."""
    return _global_hooks() or any(map(hooked, model.modules()))


def _applies(model, device: torch.device, static: bool | None) -> bool:
    """Whether a static version runs: `static` when given, else a GPU with
    GRPO_LAB_CUDA_GRAPHS=1 and no hook on the model."""
    if static is not None:
        return static
    return graphs_wanted() and device.type == "cuda" and not _hooked(model)


def _kept(model, key: tuple, build, training: bool = False):
    """The graph kept for (model, key), built by build() the first time; at most
    KEPT_PER_MODEL per model, and KEPT_TRAINING training passes in all, the least recently
    used dropped first. The key holds the parameters' addresses (a graph reads them there:
    new tensors, a reload, need a new one), the modules, and the autocast state (a graph
    records the casts)."""
    device = next(model.parameters()).device
    amp = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
    key = (*key, amp, tuple(p.data_ptr() for p in model.parameters()),
           tuple(map(id, model.modules())))  # a module swapped in (fuse_gelu) is another graph
    if training:  # one store for every model: a dead model's id may come back, so check
        key, kept, limit = (id(model), *key), _KEPT_TRAINING, KEPT_TRAINING
        if key in kept and kept[key].model_ref() is not model:
            del kept[key]
    else:
        kept, limit = _KEPT.setdefault(model, OrderedDict()), KEPT_PER_MODEL
    if key not in kept:
        kept[key] = build(amp)
        while len(kept) > limit:
            kept.popitem(last=False)
    kept.move_to_end(key)
    return kept[key]


def training_calls(model) -> list[TrainingCall]:
    """The training passes kept for this model, the most recently used last."""
    return [c for c in _KEPT_TRAINING.values() if c.model_ref() is model]


def _same_output(replayed: torch.Tensor, expected: torch.Tensor) -> bool:
    """A first replay against the warm-up's output: the same kernels on the same inputs, so
    equal up to another GEMM algorithm's rounding (a few units of bf16's 2^-8): within 5% of
    the largest finite value, with NaN and inf in the same places (an fp16 overflow is an
    inf in both). A replay that ran nothing leaves the NaN it was filled with, and one that
    read other inputs is off by the output's own size."""
    e, r = expected.float(), replayed.float()
    if not (torch.equal(e.isnan(), r.isnan()) and torch.equal(e.isinf(), r.isinf())
            and torch.equal(e[e.isinf()], r[r.isinf()])):
        return False
    finite = e.isfinite()
    if not finite.any():
        return True
    scale = e[finite].abs().max()
    return bool((e[finite] - r[finite]).abs().max() <= 0.05 * scale)


def _autocast(device: torch.device, amp: tuple[bool, torch.dtype]):
    """autocast as `amp` = (enabled, dtype) records it, its cache of the weights' casts off:
    a graph records the casts themselves."""
    enabled, dtype = amp
    return torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=False)


def _warmed_up(device: torch.device, run):
    """run() twice on a side stream, as a capture needs first (lazy initialisations, cuBLAS's
    workspaces), the device caught up after: the last run's result."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            result = run()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    return result


def _recorded(graph: torch.cuda.CUDAGraph, run, pool=None):
    """run() captured into graph on the current stream (one of the buffers' device: a
    capture on another device's stream records nothing), sharing `pool` where given: its
    result. capture_begin/end by hand, not torch.cuda.graph, whose __enter__ leaves its
    stream current for good when capture_begin raises."""
    graph.capture_begin(pool=pool)
    try:
        return run()
    finally:
        graph.capture_end()


def _load(statics: list[torch.Tensor], tensors) -> None:
    """The inputs' values into the static copies a graph reads."""
    for static, t in zip(statics, tensors, strict=True):
        static.copy_(t)


def _into(buffer: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """values, copied into buffer (a new one where there is none of their shape and dtype)."""
    if buffer is None or (buffer.shape, buffer.dtype) != (values.shape, values.dtype):
        buffer = torch.empty_like(values)
    return buffer.copy_(values)


def _no_graph(what: str, error: Exception) -> None:
    """A failed capture: said once, as a warning; the computation runs without a graph."""
    warnings.warn(f"{GRAPHS_ENV}=1: {what} could not be captured as a CUDA graph "
                  f"({type(error).__name__}: {error}); it runs without one", RuntimeWarning,
                  stacklevel=5)


class Recorded:
    """forward() (a function of static buffers, returning a tensor) as a CUDA graph: captured
    at the first call, replayed after; with graph=False, or after a failed capture, called
    as it is. Either way the output is one buffer that the next call overwrites, as a
    replay's is (the graph's own memory): read it, or copy it, before the next call."""

    def __init__(self, forward, device: torch.device, amp: tuple[bool, torch.dtype],
                 graph: bool):
        self.forward, self.device, self.amp, self.use_graph = forward, device, amp, graph
        self.graph, self.output = None, None

    def __call__(self) -> torch.Tensor:
        if self.use_graph and self.graph is None:
            self._capture()
        if self.graph is None:
            # a replay's semantics, also on the CPU (tests): one buffer, overwritten
            self.output = _into(self.output, self.forward())
            return self.output
        self.graph.replay()
        return self.output

    def _capture(self) -> None:
        """Warm up, capture, and replay once against the warm-up's output. Any failure is
        a warning, and forward() then runs as it is."""
        device = self.device
        try:
            with torch.cuda.device(device), _autocast(device, self.amp):
                expected = _warmed_up(device, self.forward)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(torch.cuda.Stream(device)):
                    self.output = _recorded(graph, self.forward)
                self.output.fill_(float("nan"))
                graph.replay()
                if not _same_output(self.output, expected):
                    raise RuntimeError("its first replay did not give the warm-up's output")
            self.graph = graph
        except Exception as e:  # noqa: BLE001 - any capture failure: run without the graph
            self.use_graph, self.output = False, None
            _no_graph("a forward", e)


def static_decoder(model, cache, columns: int, static: bool | None = None):
    """The StaticDecoder for this model and batch, or None where the eager loop runs.

    `cache`: gpt2_forward's cache after the prompt, (keys, values) of shape (B, H, P, D/H)
    per layer, one row per sampled row (transformers' cache object: None). `columns`: the
    most columns a row's keys reach (P + max_new_tokens - 1). `static`: None decides by the
    environment (a CUDA graph on a GPU with GRPO_LAB_CUDA_GRAPHS=1, no hook on the model);
    True: a static decoder anyway (a graph on a GPU, the plain step on the CPU); False: None.
    """
    if not isinstance(cache, list):
        return None
    k = cache[0][0]
    if not _applies(model, k.device, static):
        return None
    B, H, _, head = k.shape
    S = -(-columns // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
    return _kept(model, ("decoder", B, H, S, head, k.dtype, k.device), lambda amp: StaticDecoder(
        model, B, H, S, head, k.dtype, k.device, graph=k.is_cuda, amp=amp))


def static_prompt_forward(model, ids: torch.Tensor, mask: torch.Tensor,
                          positions: torch.Tensor, static: bool | None = None):
    """The sampler's forward over its U distinct prompts, (U, P) ids, mask and positions
    (gpt2_forward without a cache), through graphed(): a CUDA graph per prompt shape where
    the static decoder runs (`_applies`, and a model gpt2_forward writes out), else None
    (the caller runs the forward itself). The same values as that forward: ((U, 1, V)
    logits of the last column, in the keys' dtype, and the cache as a list of (keys,
    values) of shape (U, H, P, D/H) per layer). Not for no rows, nor for an LM head other
    than GPT-2's own Linear (one that returned float32 logits under autocast would not
    give them in the keys' dtype)."""
    if not (len(ids) and writes_out(model) and type(model.lm_head) is torch.nn.Linear
            and _applies(model, ids.device, static)):
        return None
    with torch.inference_mode():  # graphed() captures a forward in inference mode only
        flat = graphed(_prompt_pass, model, ids, mask, positions, static=True)
    cfg = model.config
    (U, P), H = ids.shape, cfg.n_head
    shape = (U, H, P, cfg.n_embd // H)
    per_tensor = shape[0] * shape[1] * shape[2] * shape[3]
    logits, *kv = flat.split([flat.numel() - 2 * cfg.n_layer * per_tensor]
                             + [per_tensor] * (2 * cfg.n_layer))
    cache = [(k.view(shape), v.view(shape)) for k, v in zip(kv[::2], kv[1::2], strict=True)]
    return logits.view(U, 1, -1), cache


def _prompt_pass(model, ids, mask, positions) -> torch.Tensor:
    """gpt2_forward over prompts as the one tensor graphed() replays: the last column's
    logits, then every layer's keys and values, flat. One dtype for all: the logits come out
    of a linear layer as the keys do (autocast's dtype, or the weights'), so the cast is
    none; tests/test_graphs.py checks the values against the eager forward's."""
    logits, cache = gpt2_forward(model, ids, mask, positions)
    dtype = cache[0][0].dtype
    return torch.cat([logits[:, -1].to(dtype).reshape(-1),
                      *(t.reshape(-1) for kv in cache for t in kv)])


class StaticDecoder:
    """One batch shape's decode step: static buffers, and on a GPU the step's CUDA graph
    (captured at the first step). `start` loads a rollout's prompt, `step` runs one token."""

    def __init__(self, model, B: int, H: int, S: int, head: int, dtype: torch.dtype,
                 device: torch.device, graph: bool, amp: tuple[bool, torch.dtype]):
        # weakly: _KEPT holds the decoders per model, weakly, so that they go with it
        self.model_ref, self.amp = weakref.ref(model), amp
        layers = model.config.n_layer
        with torch.inference_mode():
            self.keys = [torch.zeros(B, H, S, head, dtype=dtype, device=device)
                         for _ in range(layers)]
            self.values = [torch.zeros_like(k) for k in self.keys]
            self.token = torch.zeros(B, 1, dtype=torch.long, device=device)
            self.position = torch.zeros(B, 1, dtype=torch.long, device=device)
            self.mask = torch.zeros(B, S, dtype=torch.bool, device=device)
            self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.written = 0
        self.run = Recorded(self._forward, device, amp, graph)

    @torch.inference_mode()
    def start(self, cache, prompt_mask: torch.Tensor, position: torch.Tensor) -> None:
        """Load a rollout's prompt: its keys and values in the first P columns and zeros
        after them (a masked key's weight is 0, and 0 x a NaN an earlier rollout left would
        be NaN), its mask, and each row's last prompt position (B, 1)."""
        P = cache[0][0].shape[2]
        for (k, v), keys, values in zip(cache, self.keys, self.values, strict=True):
            keys[:, :, :P].copy_(k)
            keys[:, :, P:].zero_()
            values[:, :, :P].copy_(v)
            values[:, :, P:].zero_()
        self.mask.zero_()
        self.mask[:, :P] = prompt_mask.bool()
        self.position.copy_(position)
        self.column.fill_(P - 1)
        self.written = P

    @torch.inference_mode()
    def step(self, token: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """(B,) the tokens just drawn, (B,) the rows that have finished -> (B, V) float32
        logits for the next token, zeros on the finished rows (the eager loop's stand-in)."""
        self.token.copy_(token.masked_fill(done, 0)[:, None])  # finished rows: id 0
        self.position.add_(1)
        self.column.add_(1)
        self.mask[:, self.written] = True
        self.written += 1
        return self.run()[:, -1].float().masked_fill(done[:, None], 0.0)

    def _forward(self) -> torch.Tensor:
        cache = list(zip(self.keys, self.values, strict=True))
        logits, _ = gpt2_forward(self.model_ref(), self.token, self.mask, self.position, cache,
                                 write_at=self.column)
        return logits  # (B, 1, V)


def graphed(fn, model, *tensors: torch.Tensor, static: bool | None = None) -> torch.Tensor:
    """fn(model, *tensors) -> a tensor, as a CUDA graph per set of input shapes where graphs
    apply (`_applies`), else fn(model, *tensors) itself. In inference mode, the forward alone
    (GraphedCall); with autograd on, the forward and its backward for the model's parameters
    (TrainingCall), in one process (not under DDP); under plain no_grad, no graph. A set of
    shapes is captured at its second call, so that one-off shapes cost no capture. The graph
    runs over static copies of the inputs, and its output is returned as a copy. `fn`: a
    module-level function of its tensors' values (a closure over the model would keep the
    model alive) that returns a tensor and reads nothing back to the host."""
    if not _applies(model, tensors[0].device, static):
        return fn(model, *tensors)
    shapes = tuple((t.shape, t.dtype, t.device) for t in tensors)
    if torch.is_inference_mode_enabled():
        call = _kept(model, (fn, *shapes), lambda amp: GraphedCall(fn, model, tensors, amp))
        return call(*tensors)
    if (torch.is_grad_enabled() and not _distributed()
            and any(p.requires_grad for p in model.parameters())
            and not any(t.requires_grad for t in tensors)):  # gradients for parameters only
        key = (fn, model.training, tuple(p.requires_grad for p in model.parameters()), *shapes)
        call = _kept(model, key, lambda amp: TrainingCall(fn, model, tensors, amp),
                     training=True)
        return call(*tensors)
    return fn(model, *tensors)


def _distributed() -> bool:
    """A process group is up: DDP's gradient hooks and its one-forward-per-backward
    bookkeeping stay with the eager forward."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class GraphedCall:
    """fn(model, *inputs) for one set of input shapes, over static copies of the inputs
    from its second call on (the first runs fn as it is)."""

    def __init__(self, fn, model, tensors, amp: tuple[bool, torch.dtype]):
        # built and called by graphed(), in inference mode, as the static inputs are made
        self.fn, self.model_ref = fn, weakref.ref(model)  # weakly, as StaticDecoder
        self.inputs = [torch.empty_like(t) for t in tensors]
        device = tensors[0].device
        self.run = Recorded(lambda: fn(self.model_ref(), *self.inputs), device, amp,
                            graph=device.type == "cuda")
        self.calls = 0

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            out = self.fn(self.model_ref(), *tensors)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"graphed: {self.fn.__name__} returned "
                                f"{type(out).__name__}, not a tensor")
            return out
        _load(self.inputs, tensors)
        return self.run().clone()


class TrainingCall:
    """fn(model, *inputs) and its gradient for the model's trainable parameters, for one set
    of input shapes. The first call runs fn itself (`eager`); from the second, the forward and
    the backward each replay a CUDA graph over static copies of the inputs (captured together,
    in one memory pool, on one stream: autograd runs a backward op on its forward op's
    stream), as torch.cuda.make_graphed_callables does, with two differences: the parameters'
    gradients leave the graph as one fresh copy (make_graphed_callables hands out its static
    buffers, which the next replay overwrites: with two micro-batches of one shape, .grad
    would hold the second twice), and a failed capture warns and runs the eager forward.
    The forward runs on aliases of the parameters (the same storage, so a replay reads the
    parameters as they are then), which the backward differentiates: the parameters' own
    gradient accumulators are autograd's for `_Replayed`, made on the caller's stream, and
    never enter a capture (one made before it, by a graph still alive, would make the
    capture wait on the default stream, which a capture cannot; one made during it would
    pin every later accumulation to the capture's stream).
    With graph=False (the CPU), the same calls over the same static inputs without a graph:
    how tests/test_graphs.py checks the gradients against the eager ones. There the forward's
    autograd graph (over the aliases, so the parameters' storage) is held from a forward to
    its backward, as an eager forward's is; with a graph, nothing of it is kept."""

    def __init__(self, fn, model, tensors, amp: tuple[bool, torch.dtype]):
        self.fn, self.model_ref, self.amp = fn, weakref.ref(model), amp
        self.inputs = [torch.empty_like(t) for t in tensors]
        self.device = tensors[0].device
        self.use_graph = self.device.type == "cuda"
        self.forward_graph = self.backward_graph = None
        self.output = self.grad_output = None  # the forward's output, with its autograd graph
        self.aliases = None  # the parameters' aliases it was computed from (no graph only)
        self.static_output = None  # its values, in the buffer the next forward overwrites
        self.grads = None  # the backward's gradients: static buffers that the next one reuses
        self.unused: list[bool] = []  # per parameter: the output does not depend on it
        # the trainable parameters' shapes, for the gradients' views (a backward may come
        # after the model has gone: eagerly it still runs)
        self.shapes = [p.shape for p in self.params()]
        self.calls = 0
        self.forwards = 0  # forwards so far: the last one's activations are held ...
        self.live = None  # ... until its backward has used them: then None
        self.broken = False  # a capture failed: fn runs as it is from then on

    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model_ref().parameters() if p.requires_grad]

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1 and not self.broken:
            _load(self.inputs, tensors)
            if self.use_graph and self.forward_graph is None:
                self._capture()
            if not self.broken:
                return _Replayed.apply(self, tensors, *self.params())
        return self.eager(*tensors)

    def eager(self, *tensors: torch.Tensor) -> torch.Tensor:
        """fn itself (a shape's first call, or after a failed capture), with autocast's
        weight cache off, as in the graph: under bf16 a weight is then cast at each use and
        its gradients are summed in float32 (with the cache, in bf16 first). So a run's
        numbers do not depend on which of its calls were a shape's first: a resumed run's
        first call of a shape was a later one in the run it resumes."""
        with _autocast(self.device, self.amp):
            return self.fn(self.model_ref(), *tensors)

    def _forward(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """fn over the static inputs and aliases of the trainable parameters (tied ones
        stay tied): (output, aliases)."""
        model = self.model_ref()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        aliases = [p.detach().requires_grad_() for _, p in named]
        with torch.enable_grad(), _autocast(self.device, self.amp), _reparametrize_module(
                model, {n: a for (n, _), a in zip(named, aliases, strict=True)},
                tie_weights=True):
            return self.fn(model, *self.inputs), aliases

    def _gradients(self, output, aliases, grad_output) -> list[torch.Tensor]:
        """The gradients of the parameters the output depends on, for d(output) =
        grad_output; `unused` marks the others (they get no gradient, as in an eager
        backward). Outside autocast, as the step's own backward runs."""
        with torch.autocast(self.device.type, enabled=False):
            grads = torch.autograd.grad(output, aliases, grad_output, allow_unused=True)
        self.unused = [g is None for g in grads]
        return [g for g in grads if g is not None]

    def forward_pass(self) -> tuple[torch.Tensor, int]:
        """The output (a copy: the next forward overwrites the static one), and which
        forward it was."""
        if self.forward_graph is None:
            self.output, self.aliases = self._forward()
            self.static_output = _into(self.static_output, self.output.detach())
        else:
            self.forward_graph.replay()
        self.forwards += 1
        self.live = self.forwards
        return self.static_output.clone(), self.forwards

    def backward_pass(self, grad_output: torch.Tensor, tensors, forward: int
                      ) -> list[torch.Tensor | None]:
        """The parameters' gradients for d(output) = grad_output, of the output of the
        `forward`-th forward, whose inputs were `tensors`. Where its activations are not the
        ones held (another forward of this shape ran since, or a backward already used them:
        a second backward with retain_graph), the forward is run again on its inputs first."""
        if forward != self.live:
            _load(self.inputs, tensors)
            self.forward_pass()
        if self.backward_graph is None:
            grads = self._gradients(self.output, self.aliases, grad_output)
            self.grads = [_into(b, g) for b, g in zip(self.grads or [None] * len(grads), grads,
                                                      strict=True)]
            self.output = self.aliases = None  # its autograd graph is used: let it go
        else:
            self.grad_output.copy_(grad_output)
            self.backward_graph.replay()
        self.live = None  # the backward's temporaries took the activations' memory
        # the static buffers are the next call's: copied, fresh for .grad (see the class), in
        # one kernel: one flat tensor, which each gradient views. Without a graph too, so
        # that tests see a replay's reuse
        flat = torch.cat([g.reshape(-1) for g in self.grads])
        grads, start = [], 0
        for shape, unused in zip(self.shapes, self.unused, strict=True):
            n = 0 if unused else shape.numel()
            grads.append(None if unused else flat[start:start + n].view(shape))
            start += n
        return grads

    def _capture(self) -> None:
        """Warm up; capture the forward, then the backward, on one stream, in one pool;
        replay both once against the warm-up's output and gradients. Any failure: a
        warning, and fn runs as it is from then on."""
        device = self.device

        def warm_up():
            out, aliases = self._forward()
            probe = torch.ones_like(out)  # any fixed d(output) will do
            return out.detach(), probe, self._gradients(out, aliases, probe)

        try:
            with torch.cuda.device(device):
                expected, probe, expected_grads = _warmed_up(device, warm_up)
                forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.stream(torch.cuda.Stream(device)):
                    output, aliases = _recorded(forward_graph, self._forward)
                    grad_output = torch.empty_like(output)
                    grads = _recorded(backward_graph, partial(
                        self._gradients, output, aliases, grad_output), forward_graph.pool())
                    output = output.detach()  # the captured autograd graph is not kept
                    del aliases
                output.fill_(float("nan"))
                for g in grads:
                    g.fill_(float("nan"))
                forward_graph.replay()
                grad_output.copy_(probe)
                backward_graph.replay()
                if not (_same_output(output, expected) and all(
                        map(_same_output, grads, expected_grads))):
                    raise RuntimeError("its first replay did not give the warm-up's output "
                                       "and gradients")
            self.forward_graph, self.backward_graph = forward_graph, backward_graph
            self.grad_output, self.grads, self.static_output = grad_output, grads, output
        except Exception as e:  # noqa: BLE001 - any capture failure: run without the graph
            self.broken, self.output = True, None
            _no_graph("a training forward and its backward", e)


class _Replayed(torch.autograd.Function):
    """A TrainingCall's forward and backward, to autograd: the gradients it returns for the
    parameters reach .grad through autograd's own accumulation, as an eager backward's do
    (and DDP's or a user's gradient hooks would see them)."""

    @staticmethod
    def forward(ctx, call: TrainingCall, tensors, *params: torch.Tensor) -> torch.Tensor:
        ctx.call, ctx.tensors = call, tensors
        output, ctx.forward = call.forward_pass()
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        grads = ctx.call.backward_pass(grad_output, ctx.tensors, ctx.forward)
        return (None, None, *grads)
