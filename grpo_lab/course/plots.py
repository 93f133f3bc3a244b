"""Plots of a run's metrics: reward and accuracy, grad norm on a log axis, KL, entropy."""

from __future__ import annotations

import math
from pathlib import Path


def moving_average(xs: list[float], window: int) -> list[float]:
    """The mean of each value and the up to window - 1 before it: a noisy per-step curve
    (reward) made readable, the same length as the input."""
    return [sum(xs[max(0, i - window + 1):i + 1]) / len(xs[max(0, i - window + 1):i + 1])
            for i in range(len(xs))]


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(m["step"], m[key]) for m in history if key in m and m[key] is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_run(history: list[dict], path: str | Path | None = None, title: str = "", axes=None):
    """Four panels from one run's metrics; saves a PNG when `path` is given.

    Non-finite grad norms are drawn as red crosses at the top of the log axis, so the
    step where the run broke stands out."""
    import matplotlib

    if path is not None and axes is None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig = None
    if axes is None:
        fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    ax_r, ax_g, ax_k, ax_e = axes.flat

    s, v = _series(history, "reward")
    ax_r.plot(s, v, lw=0.8, alpha=0.6, label="reward (sampled)")
    s, v = _series(history, "eval/accuracy")
    ax_r.plot(s, v, "o-", label="eval/accuracy (greedy)")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.set_title("reward and accuracy")
    ax_r.legend(loc="best", fontsize=8)

    s, v = _series(history, "grad_norm")
    finite = [(a, b) for a, b in zip(s, v, strict=True) if math.isfinite(b) and b > 0]
    broken = [a for a, b in zip(s, v, strict=True) if not math.isfinite(b)]
    if finite:
        ax_g.plot(*zip(*finite, strict=True), lw=0.8)
    ax_g.set_yscale("log")
    if broken:
        top = max((b for _, b in finite), default=1.0) * 10
        ax_g.plot(broken, [top] * len(broken), "rx", ms=10, label="non-finite")
        ax_g.legend(loc="best", fontsize=8)
    ax_g.set_title("grad_norm (before clipping, log scale)")

    s, v = _series(history, "kl")
    ax_k.plot(s, v, lw=0.8)
    ax_k.set_title("kl (k3, per token)")

    s, v = _series(history, "entropy")
    ax_e.plot(s, v, lw=0.8, label="entropy")
    s, v = _series(history, "completions/mean_length")
    ax_e.plot(s, v, lw=0.8, label="completions/mean_length")
    ax_e.set_title("entropy and completion length")
    ax_e.legend(loc="best", fontsize=8)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if fig is not None:
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
            plt.close(fig)
    return fig


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where display handles and widgets exist)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class LivePlot:
    """A training callback that keeps a figure of the run up to date while it trains.

        trainer.train(callback=LivePlot(every=20))

    In a notebook it redraws one figure in place every `every` steps (and at the end,
    via `close()`); elsewhere (a terminal, a headless kernel) it prints one line instead."""

    def __init__(self, every: int = 20, title: str = ""):
        self.every, self.title = every, title
        self.history: list[dict] = []
        self.handle = None
        self.drawn_step: int | None = None
        self.notebook = in_notebook()

    def __call__(self, metrics: dict) -> None:
        self.history.append(metrics)
        if metrics["step"] % self.every == 0:
            self.draw()

    def draw(self) -> None:
        if not self.history or self.history[-1]["step"] == self.drawn_step:
            return
        self.drawn_step = self.history[-1]["step"]
        if not self.notebook:
            m = self.history[-1]
            acc = f", eval/accuracy {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
            print(f"step {m['step']}: reward {m['reward']:.3f}, grad_norm "
                  f"{m['grad_norm']:.3g}, kl {m['kl']:.3g}{acc}")
            return
        import matplotlib.pyplot as plt
        from IPython.display import display

        fig = plot_run(self.history, title=self.title)
        if self.handle is None:
            self.handle = display(fig, display_id=True)
        else:
            self.handle.update(fig)
        plt.close(fig)

    def close(self) -> None:
        self.draw()
