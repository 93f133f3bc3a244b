"""Plot helpers: the numbers they draw."""

import pytest

from grpo_lab.course.plots import moving_average


def test_moving_average_is_the_mean_of_the_last_window_values():
    assert moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 3) == pytest.approx([1.0, 1.5, 2.0, 3.0, 4.0])
    assert moving_average([2.0, 4.0], 1) == [2.0, 4.0]  # window 1: unchanged
    assert moving_average([], 5) == []


def test_live_plot_draws_the_trainer_history_from_step_0(tiny, capsys):
    """Given trainer.history, the live plot includes the step-0 evaluation (the text compares
    step 0 with the end); given nothing, it keeps the metrics it is called with."""
    from grpo_lab.config import GRPOConfig
    from grpo_lab.course.plots import LivePlot
    from grpo_lab.trainer import Trainer

    model, tok = tiny
    trainer = Trainer(GRPOConfig(steps=2, prompts_per_step=2, group_size=2, eval_size=4,
                                 eval_every=0), model, tok)
    shared, own = LivePlot(every=1, history=trainer.history), LivePlot(every=1)
    trainer.train(progress=False, callback=lambda m: (shared(m), own(m)))
    assert shared.history is trainer.history
    assert [m["step"] for m in shared.history] == [0, 1, 2]
    assert "eval/accuracy" in shared.history[0]
    assert [m["step"] for m in own.history] == [1, 2]


def test_the_last_panel_is_titled_by_what_it_draws():
    """A trainer history logs entropy and completion length; the learner's step logs no
    entropy, and its panel must not promise one."""
    import matplotlib

    matplotlib.use("Agg")
    from grpo_lab.course.plots import plot_run

    def history(**extra):
        return [{"step": s, "reward": 0.5, "grad_norm": 1.0, "kl": 0.1,
                 "completions/mean_length": 3.0 + s, **extra} for s in (1, 2, 3)]

    titles = {}
    for name, h in (("trainer", history(entropy=1.0)), ("learner", history()),
                    ("neither", [{"step": 1, "reward": 0.5, "grad_norm": 1.0, "kl": 0.1}])):
        fig = plot_run(h)
        titles[name] = fig.axes[-1].get_title()
        matplotlib.pyplot.close(fig)
    assert titles == {"trainer": "entropy and completion length",
                      "learner": "completion length",
                      "neither": "entropy and completion length: not logged"}
