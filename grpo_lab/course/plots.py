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

    shown = []  # the learner's step logs no entropy: neither a line nor a title for it
    for key, name in (("entropy", "entropy"), ("completions/mean_length", "completion length")):
        s, v = _series(history, key)
        if s:
            ax_e.plot(s, v, lw=0.8, label=key)
            shown.append(name)
    ax_e.set_title(" and ".join(shown) or "entropy and completion length: not logged")
    if ax_e.get_lines():
        ax_e.legend(loc="best", fontsize=8)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if fig is not None:
        if title:
            fig.suptitle(title)
        # fixed margins: tight_layout measured every tick label, half of a CLI run's plot time
        fig.subplots_adjust(left=0.07, right=0.985, bottom=0.075, top=0.9 if title else 0.95,
                            wspace=0.2, hspace=0.38)
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

        trainer.train(callback=LivePlot(every=20, history=trainer.history))

    In a notebook it redraws one figure in place every `every` steps (and at the end,
    via `close()`); elsewhere (a terminal, a headless kernel) it prints one line instead."""

    def __init__(self, every: int = 20, title: str = "", history: list[dict] | None = None):
        """history: the list to draw, e.g. `trainer.history`, which the trainer keeps and
        which starts with the step-0 evaluation; None: the metrics this callback is given
        (from step 1 on)."""
        self.every, self.title = every, title
        self.keeps_history = history is None
        self.history: list[dict] = [] if history is None else history
        self.handle = None
        self.drawn_step: int | None = None
        self.notebook = in_notebook()

    def __call__(self, metrics: dict) -> None:
        if self.keeps_history:
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


# --- one GRPO step, drawn ----------------------------------------------------------------
# key: (label, centre x, centre y, kind); kind picks the colour. The canvas is 19 x 11.
STEP_BOXES: dict[str, tuple[str, float, float, str]] = {
    "prompts": ("prompts", 1.6, 9.3, "sample"),
    "sample": ("sample G completions\nwith $\\pi_\\mathrm{old}$\n"
               "(= $\\pi_\\theta$ at the step's start)", 5.2, 9.3, "sample"),
    "reward": ("reward", 9.2, 9.3, "sample"),
    "advantages": ("group-normalised\nadvantages $\\hat A_i$", 13.2, 9.3, "sample"),
    "train_fwd": ("training forward\n($\\pi_\\theta$, with gradient)", 5.2, 6.4, "loss"),
    "logp": ("log-probs\nlogp", 9.2, 6.4, "loss"),
    "ref_fwd": ("reference forward\n(frozen $\\pi_\\mathrm{ref}$)", 5.2, 4.0, "reference"),
    "ref_logp": ("ref log-probs\nref_logp", 9.2, 4.0, "reference"),
    "ratio": ("ratio vs $\\pi_\\mathrm{old}$, clip\n$r = \\exp(\\mathrm{logp} - \\mathrm{old\\_logp})$"
              "\n$-\\min(rA,\\ \\mathrm{clip}(r)A)$", 13.2, 6.4, "loss"),
    "kl": ("k3 KL, times $\\beta$\n$\\rho = \\mathrm{ref\\_logp} - \\mathrm{logp}$\n"
           "$\\beta\\,(e^{\\rho} - \\rho - 1)$", 13.2, 4.0, "loss"),
    "aggregate": ("token aggregation\n$\\sum_{i,t} w_{i,t}\\,(\\cdot)$", 17.3, 5.2, "loss"),
    "loss": ("loss", 17.3, 1.6, "loss"),
    "backward": ("backward", 13.2, 1.6, "update"),
    "clip_grads": ("clip grads\n(max_grad_norm)", 9.2, 1.6, "update"),
    "opt_step": ("optimizer step", 5.2, 1.6, "update"),
    "health": ("health check", 1.6, 1.6, "update"),
}
# (from, to, label on the arrow or "")
STEP_ARROWS: list[tuple[str, str, str]] = [
    ("prompts", "sample", ""),
    ("sample", "reward", "completions"),
    ("reward", "advantages", ""),
    ("sample", "train_fwd", "completions"),
    ("sample", "ref_fwd", ""),
    ("train_fwd", "logp", ""),
    ("ref_fwd", "ref_logp", ""),
    ("logp", "ratio", ""),
    ("advantages", "ratio", ""),
    ("logp", "kl", ""),
    ("ref_logp", "kl", ""),
    ("ratio", "aggregate", ""),
    ("kl", "aggregate", ""),
    ("aggregate", "loss", ""),
    ("loss", "backward", ""),
    ("backward", "clip_grads", ""),
    ("clip_grads", "opt_step", ""),
    ("opt_step", "health", ""),
]
STEP_COLOURS = {"sample": "#dbe9f6", "reference": "#e6e6e6", "loss": "#fde3c8",
                "update": "#d9f0d3"}
STEP_KINDS = {"sample": "sampling and scoring (no gradient)",
              "reference": "frozen reference (no gradient)",
              "loss": "the loss (the gradient flows back through these)",
              "update": "the update"}


def grpo_step_diagram():
    """A box-and-arrow figure of one GRPO step's data flow (`Trainer.step()`), returned as
    a matplotlib Figure: prompts, G completions sampled with pi_old (the weights at the
    step's start), reward, group-normalised advantages; the frozen reference's and the
    training forward's log-probs; the ratio against pi_old with the clip, and the k3 KL;
    token aggregation into the loss; backward, gradient clipping, the optimizer step and
    the health check. Each box's label is one text artist of the figure's axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    fig, ax = plt.subplots(figsize=(13, 7.2))
    ax.set_xlim(-0.1, 19.0)
    ax.set_ylim(0.2, 11.0)
    ax.axis("off")
    patches = {}
    for key, (label, x, y, kind) in STEP_BOXES.items():
        w = 2.6 if key in ("prompts", "health", "aggregate") else 3.0
        h = 0.55 + 0.42 * (label.count("\n") + 1)
        box = FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.08",
                             facecolor=STEP_COLOURS[kind], edgecolor="0.3", lw=1.2)
        ax.add_patch(box)
        patches[key] = box
        ax.text(x, y, label, ha="center", va="center", fontsize=9.5)
    for src, dst, label in STEP_ARROWS:
        curved = (src, dst) == ("sample", "ref_fwd")  # around the left of the training forward
        ax.annotate("", xy=STEP_BOXES[dst][1:3], xytext=STEP_BOXES[src][1:3],
                    arrowprops=dict(arrowstyle="-|>", color="0.25", lw=1.3,
                                    patchA=patches[src], patchB=patches[dst],
                                    shrinkA=2, shrinkB=2,
                                    connectionstyle="arc3,rad=0.75" if curved else "arc3"))
        if label:
            (x0, y0), (x1, y1) = STEP_BOXES[src][1:3], STEP_BOXES[dst][1:3]
            ax.text((x0 + x1) / 2 + 0.12, (y0 + y1) / 2 + (0.35 if y0 == y1 else 0.0),
                    label, fontsize=8.5, color="0.3", ha="left" if y0 != y1 else "center",
                    va="center")
    # the next step samples with the updated (or rolled-back) weights
    ax.annotate("", xy=(0.75, patches["prompts"].get_y() - 0.1),
                xytext=(0.75, patches["health"].get_y() + patches["health"].get_height() + 0.1),
                arrowprops=dict(arrowstyle="-|>", color="0.5", lw=1.1, ls="--"))
    ax.text(0.95, 5.5, "next step", rotation=90, fontsize=8.5, color="0.4", ha="left",
            va="center")
    ax.legend(handles=[Patch(facecolor=STEP_COLOURS[k], edgecolor="0.3", label=v)
                       for k, v in STEP_KINDS.items()],
              loc="upper center", bbox_to_anchor=(0.5, 0.02), ncol=4, fontsize=8.5,
              frameon=False)
    ax.set_title("One GRPO step (Trainer.step): sample and score, two forward passes, "
                 "the loss, the update", fontsize=11)
    fig.tight_layout()
    return fig
