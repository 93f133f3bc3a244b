"""The sampler's one-token decode step over a static cache, replayed as a CUDA graph.

On a GPU, a decode step of a small batch waits on the host, not on the card: each of GPT-2's
~17 operators per layer is a kernel launch issued from Python, and the kernels run in less
time than their launches take (benchmarks/step_profile.py). A CUDA graph records a step's
launches once and replays them all with one call. It replays fixed addresses, so the step
reads and writes static buffers: the keys and values of every column a rollout can reach
(prompt + max_new_tokens - 1, rounded up to a multiple of 8 so that prompts of nearby lengths
share a graph), the new token, its position and the key mask, set in place before each
replay; the new column's keys and values are written into the cache inside the step
(`fast.gpt2_forward`'s `write_at`). Finished rows stay in the batch, since a graph's shapes
are fixed: they run on token id 0 (a real token: the pad id may lie outside the embedding,
report 002), and their logits are replaced by zeros as the eager loop's are, so every row
draws as it would there.

GRPO_LAB_CUDA_GRAPHS=1 turns it on; off by default until a GPU run has checked it
(benchmarks/decode_graphs.py, in benchmarks/gpu_checks.sh): the eager loop is the reference.
On the CPU the same decoder runs its step without a graph, which is how tests/test_graphs.py
checks the static buffers against the eager loop.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import OrderedDict

import torch

from .config import ConfigError
from .fast import _global_hooks, gpt2_forward

GRAPHS_ENV = "GRPO_LAB_CUDA_GRAPHS"
COLUMN_MULTIPLE = 8  # the cache's columns rounded up to this: fewer distinct graphs
KEPT_PER_MODEL = 4  # decoders kept per model; each holds its cache and its graph's memory

_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: decoder}


def graphs_wanted() -> bool:
    """$GRPO_LAB_CUDA_GRAPHS: '1' on, '0' or unset off."""
    value = os.environ.get(GRAPHS_ENV, "0").strip() or "0"
    if value not in ("0", "1"):
        raise ConfigError(f"{GRAPHS_ENV} must be 0 or 1 (got {value!r})")
    return value == "1"


def _hooked(model: torch.nn.Module) -> bool:
    """A hook a replay would skip (it runs once, at capture)."""
    return _global_hooks() or any(
        m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__
        for m in model.modules())


def static_decoder(model, cache, columns: int, static: bool | None = None):
    """The StaticDecoder for this model and batch, or None where the eager loop runs.

    `cache`: gpt2_forward's cache after the prompt, (keys, values) of shape (B, H, P, D/H)
    per layer, one row per sampled row (transformers' cache object: None). `columns`: the
    most columns a row's keys reach (P + max_new_tokens - 1). `static`: None decides by the
    environment (a CUDA graph on a GPU with GRPO_LAB_CUDA_GRAPHS=1, no hook on the model);
    True: a static decoder anyway (a graph on a GPU, the plain step on the CPU); False: None.
    """
    if static is False or not isinstance(cache, list):
        return None
    k = cache[0][0]
    if static is None and not (graphs_wanted() and k.is_cuda and not _hooked(model)):
        return None
    B, H, _, head = k.shape
    S = -(-columns // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
    amp = (torch.is_autocast_enabled(k.device.type), torch.get_autocast_dtype(k.device.type))
    # the parameters' addresses: a graph reads them, so new tensors (a reload) need a new one
    key = (B, H, S, head, k.dtype, k.device, amp, tuple(p.data_ptr() for p in model.parameters()))
    kept = _DECODERS.setdefault(model, OrderedDict())
    if key not in kept:
        kept[key] = StaticDecoder(model, B, H, S, head, k.dtype, k.device, graph=k.is_cuda,
                                  amp=amp)
        while len(kept) > KEPT_PER_MODEL:
            kept.popitem(last=False)
    kept.move_to_end(key)
    return kept[key]


class StaticDecoder:
    """One batch shape's decode step: static buffers, and on a GPU the step's CUDA graph
    (captured at the first step). `start` loads a rollout's prompt, `step` runs one token."""

    def __init__(self, model, B: int, H: int, S: int, head: int, dtype: torch.dtype,
                 device: torch.device, graph: bool, amp: tuple[bool, torch.dtype]):
        # weakly: _DECODERS holds decoders per model, weakly, so that they go with it
        self.model_ref, self.use_graph, self.amp = weakref.ref(model), graph, amp
        layers = model.config.n_layer
        with torch.inference_mode():
            self.keys = [torch.zeros(B, H, S, head, dtype=dtype, device=device)
                         for _ in range(layers)]
            self.values = [torch.zeros_like(k) for k in self.keys]
            self.token = torch.zeros(B, 1, dtype=torch.long, device=device)
            self.position = torch.zeros(B, 1, dtype=torch.long, device=device)
            self.mask = torch.zeros(B, S, dtype=torch.bool, device=device)
            self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.graph, self.logits, self.written = None, None, 0

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
        if not self.use_graph:
            logits = self._forward()
        else:
            if self.graph is None:
                self._capture()
            if self.graph is not None:
                self.graph.replay()
                logits = self.logits
            else:  # the capture failed: the same step without a graph
                logits = self._forward()
        return logits[:, -1].float().masked_fill(done[:, None], 0.0)

    def _forward(self) -> torch.Tensor:
        cache = list(zip(self.keys, self.values, strict=True))
        logits, _ = gpt2_forward(self.model_ref(), self.token, self.mask, self.position, cache,
                                 write_at=self.column)
        return logits  # (B, 1, V)

    def _autocast(self):
        enabled, dtype = self.amp
        # a graph records the casts of the weights: autocast's cache of them must be off
        return torch.autocast(self.token.device.type, dtype=dtype, enabled=enabled,
                              cache_enabled=False)

    def _capture(self) -> None:
        """Record the step: warmed up twice on a side stream, as CUDA graphs need, then
        captured on a stream of the decoder's device (a capture on another device's stream
        records nothing), then replayed once against the warm-up's output. Any failure is a
        warning, and this decoder runs its step without a graph."""
        device = self.token.device
        try:
            with torch.cuda.device(device):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side), self._autocast():
                    for _ in range(2):  # both write the column the replay writes again
                        expected = self._forward()
                torch.cuda.current_stream(device).wait_stream(side)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                # capture_begin/end by hand, not torch.cuda.graph: its __enter__ leaves its
                # stream current for good when capture_begin raises
                with torch.cuda.stream(torch.cuda.Stream(device)), self._autocast():
                    graph.capture_begin()
                    try:
                        self.logits = self._forward()
                    finally:
                        graph.capture_end()
                self.logits.fill_(float("nan"))
                graph.replay()
                # the same kernels on the same inputs: equal up to another GEMM algorithm's
                # rounding (a few units of bf16's 2^-8), where a replay that ran nothing
                # leaves NaN and one that read other inputs is off by the logits' own size
                scale = expected.float().abs().max()
                if not (self.logits.float() - expected.float()).abs().max() <= 0.05 * scale:
                    raise RuntimeError("its first replay did not give the warm-up's logits")
            self.graph = graph
        except Exception as e:  # noqa: BLE001 - any capture failure: run without the graph
            self.use_graph = False
            warnings.warn(f"{GRAPHS_ENV}=1: the decode step could not be captured as a CUDA "
                          f"graph ({type(e).__name__}: {e}); sampling runs it without one",
                          RuntimeWarning, stacklevel=3)
