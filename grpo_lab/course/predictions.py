"""Predict, then run: before a measurement in notebooks 05 to 10 the learner commits a
prediction, the notebook measures, then shows how far the prediction was off.

    guess = predict("05-crash-step", low=10, high=40)   # before the measurement
    ...                                                  # the notebook measures crash_step
    reveal(guess, crash_step)                            # after it

Every question lives here, in QUESTIONS: its text, and what a prediction of it must be, a
range of numbers (`low <= high`, within the question's bounds) or one of its choices. In a
solution notebook the prediction cell sits between `### BEGIN PREDICTION` and `### END
PREDICTION`; the lab gets the same call with every field `None`, for the learner to fill.
`python -m grpo_lab grade` scores each prediction cell for its form only (`form_problem`,
read from the cell's literal arguments, nothing of the submission is run): a prediction is
a commitment, not a test the learner can fail by being wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Question:
    text: str
    low: float | None = None  # a range question: the bounds a prediction must lie within
    high: float | None = None
    choices: tuple[str, ...] = ()  # a choice question: the allowed answers
    unit: str = ""

    @property
    def fields(self) -> tuple[str, ...]:
        return ("choice",) if self.choices else ("low", "high")


QUESTIONS: dict[str, Question] = {
    "05-crash-step": Question(
        "Your step with report 001's loss on the naive preset, 100 steps: at which step will "
        "it crash? (a range of steps; 101 if you expect it to survive all 100)",
        low=1, high=101, unit="step"),
    "06-clamp-only-nan-seeds": Question(
        "A log-ratio clamp alone (±10, the stable preset's; the reports used 5) on the naive "
        "preset, 25 steps: on how many of the 3 seeds will NaN still reach the weights?",
        choices=("0", "1", "2", "3")),
    "07-rollbacks": Question(
        "The naive preset with the health check on, 30 steps: how many times will it roll "
        "back to the last healthy snapshot? (a range)",
        low=0, high=30, unit="rollbacks"),
    "08-step-inside-error": Question(
        "Report 003's step-inside-the-loop bug with 3 micro-batches: the relative error of "
        "the gradient it keeps, against the full batch's (`grpo` loss)? (a range; 0 is exact, "
        "1 is as large as the gradient itself)",
        low=0, high=10),
    "09-clamp-growth": Question(
        "Three times the learning rate lets the policy drift further: the exact KL grows. By "
        "what factor will report 003's clamped reading grow? (a range; 1 means not at all)",
        low=0, high=100, unit="x"),
    "10-temperature-zero": Question(
        "A hand-rolled sampler at temperature 0 (logits / T, softmax, torch.multinomial): "
        "what happens?",
        choices=("ZeroDivisionError", "greedy tokens, the argmax",
                 "torch.multinomial refuses NaN probabilities", "uniformly random tokens")),
}


@dataclass
class Prediction:
    question: str
    values: dict = field(default_factory=dict)
    problem: str | None = None  # None: a valid prediction


def form_problem(question: str, values: dict) -> str | None:
    """None when `values` is a well-formed prediction of `question`; else what is wrong, in
    the learner's terms."""
    q = QUESTIONS.get(question)
    if q is None:
        return f"no question is named {question!r}"
    if all(values.get(f) is None for f in q.fields):
        return "no prediction yet: fill in " + " and ".join(q.fields)
    if q.choices:
        choice = values.get("choice")
        if choice not in q.choices:
            return (f"choice must be one of {', '.join(repr(c) for c in q.choices)} "
                    f"(got {choice!r})")
        return None
    low, high = values.get("low"), values.get("high")
    for name, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return f"{name} must be a number (got {v!r})"
        if not q.low <= v <= q.high:
            return f"{name} must lie between {q.low:g} and {q.high:g} (got {v!r})"
    if low > high:
        return f"low must be <= high (got low={low!r}, high={high!r})"
    return None


def predict(question: str, **values) -> Prediction:
    """Commit a prediction of `question` before its measurement: `low=..., high=...` for a
    range question, `choice=...` for a choice question. Prints the question and whether the
    prediction is well formed; returns it for `reveal`."""
    q = QUESTIONS.get(question)
    if q is None:
        raise ValueError(f"predict: no question is named {question!r}; the questions are "
                         + ", ".join(QUESTIONS))
    unknown = sorted(set(values) - set(q.fields))
    if unknown:
        raise ValueError(f"predict({question!r}): this question takes "
                         f"{' and '.join(q.fields)}, not {', '.join(unknown)}")
    p = Prediction(question, dict(values), form_problem(question, values))
    print(f"🔮 {q.text}")
    if q.choices:
        print("   choices: " + "; ".join(repr(c) for c in q.choices))
    mark = "⏳" if p.problem and p.problem.startswith("no prediction yet") else "❌"
    print("   " + (f"{mark} {p.problem}" if p.problem else f"your prediction: {_shown(q, values)}"))
    return p


class Revealed(str):
    """reveal's line: a str that a notebook does not show again as the cell's value (it was
    printed already; as the last line of a cell it would appear twice)."""

    def _ipython_display_(self) -> None:
        pass


def reveal(prediction: Prediction, measured) -> str:
    """After the measurement: print the prediction next to what was measured, and how far
    off it was; return that line (a Revealed, which a notebook does not display twice)."""
    q = QUESTIONS[prediction.question]
    got = f"{measured:.3g}" if isinstance(measured, (int, float)) else repr(measured)
    if prediction.problem:
        line = f"measured: {got}{' ' + q.unit if q.unit else ''} (no well-formed prediction was made)"
    elif q.choices:
        right = prediction.values["choice"] == measured
        line = (f"you predicted {prediction.values['choice']!r}; measured {got}: "
                + ("right" if right else "not this time"))
    else:
        low, high = prediction.values["low"], prediction.values["high"]
        if low <= measured <= high:
            verdict = "inside your range"
        else:
            edge = low if measured < low else high
            verdict = f"outside your range, by {abs(measured - edge):.3g}"
            if edge:
                verdict += f" ({measured / edge:.3g} x the nearer bound)"
        line = f"you predicted {low:g} to {high:g}; measured {got}: {verdict}"
    print(f"🔮 {line}")
    return Revealed(line)


def _shown(q: Question, values: dict) -> str:
    if q.choices:
        return repr(values["choice"])
    return f"{values['low']:g} to {values['high']:g}{' ' + q.unit if q.unit else ''}"
