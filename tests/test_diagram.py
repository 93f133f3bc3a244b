"""grpo_step_diagram: one GRPO step's data flow, drawn with the expected boxes and arrows."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402

from grpo_lab.course.plots import STEP_ARROWS, STEP_BOXES, grpo_step_diagram  # noqa: E402

# the stages of Trainer.step(), in the order the data flows
EXPECTED = ["prompts", "sample G completions", r"\pi_\mathrm{old}", "step's start", "reward",
            "group-normalised", "reference forward", "frozen", "ref log-probs",
            "training forward", "log-probs", r"ratio vs $\pi_\mathrm{old}$, clip", "k3 KL",
            "token aggregation", "loss", "backward", "clip grads", "optimizer step",
            "health check"]


def test_the_diagram_draws_every_stage_as_a_labelled_box():
    fig = grpo_step_diagram()
    try:
        assert isinstance(fig, matplotlib.figure.Figure)
        ax, = fig.axes
        texts = [t.get_text() for t in ax.texts if not isinstance(t, Annotation)]
        for label in EXPECTED:
            assert any(label in t for t in texts), (label, texts)
        boxes = [p for p in ax.patches if isinstance(p, FancyBboxPatch)]
        assert len(boxes) == len(STEP_BOXES)
        # one arrow per edge of the flow, plus the dashed "next step" arrow
        arrows = [t for t in ax.texts if isinstance(t, Annotation)]
        assert len(arrows) == len(STEP_ARROWS) + 1
        fig.canvas.draw()  # the mathtext labels render
    finally:
        plt.close(fig)


def test_the_flow_is_connected_from_prompts_to_the_health_check():
    edges: dict[str, set[str]] = {}
    for src, dst, _ in STEP_ARROWS:
        assert src in STEP_BOXES and dst in STEP_BOXES, (src, dst)
        edges.setdefault(src, set()).add(dst)
    reached, todo = set(), ["prompts"]
    while todo:
        node = todo.pop()
        if node not in reached:
            reached.add(node)
            todo += sorted(edges.get(node, ()))
    assert reached == set(STEP_BOXES)  # every box lies on the flow
    # the loss needs the advantages, the old and the reference log-probs
    assert {"advantages", "logp"} <= {s for s, d, _ in STEP_ARROWS if d == "ratio"}
    assert {"ref_logp", "logp"} <= {s for s, d, _ in STEP_ARROWS if d == "kl"}
    order = ["loss", "backward", "clip_grads", "opt_step", "health"]
    assert all((a, b, "") in STEP_ARROWS for a, b in zip(order, order[1:], strict=False))
