"""Predict, then run: the questions, the form check the grader scores, and what the
notebook shows after the measurement."""

import pytest

from grpo_lab.course import labs
from grpo_lab.course.labs import MarkerError, blank_predictions, predict_calls, student_source
from grpo_lab.course.predictions import QUESTIONS, form_problem, predict, reveal


@pytest.mark.parametrize("question,values,problem", [
    ("07-rollbacks", {"low": 1, "high": 5}, None),
    ("07-rollbacks", {"low": 2.5, "high": 2.5}, None),
    ("07-rollbacks", {"low": None, "high": None}, "no prediction yet: fill in low and high"),
    ("07-rollbacks", {}, "no prediction yet"),
    ("07-rollbacks", {"low": 5, "high": 1}, "low must be <= high"),
    ("07-rollbacks", {"low": -1, "high": 3}, "low must lie between 0 and 30"),
    ("07-rollbacks", {"low": 1, "high": None}, "high must be a number (got None)"),
    ("07-rollbacks", {"low": True, "high": 3}, "low must be a number (got True)"),
    ("07-rollbacks", {"low": float("nan"), "high": 3}, "low must be a number"),
    ("07-rollbacks", {"low": "1", "high": 3}, "low must be a number (got '1')"),
    ("06-clamp-only-nan-seeds", {"choice": "2"}, None),
    ("06-clamp-only-nan-seeds", {"choice": 2}, "choice must be one of '0', '1', '2', '3'"),
    ("nope", {"low": 1}, "no question is named 'nope'"),
])
def test_the_form_of_a_prediction(question, values, problem):
    got = form_problem(question, values)
    assert got is None if problem is None else problem in got, got


def test_predict_refuses_what_the_question_does_not_take(capsys):
    with pytest.raises(ValueError, match="takes low and high, not choice"):
        predict("07-rollbacks", choice="3")
    with pytest.raises(ValueError, match="no question is named '07'; the questions are"):
        predict("07", low=1, high=2)


def test_reveal_says_how_far_off_the_prediction_was(capsys):
    inside = reveal(predict("07-rollbacks", low=1, high=5), 3)
    assert inside == "you predicted 1 to 5; measured 3: inside your range"
    above = reveal(predict("09-clamp-growth", low=2, high=4), 1.3512)
    assert above == "you predicted 2 to 4; measured 1.35: outside your range, by 0.649 (0.676 x the nearer bound)"
    assert reveal(predict("06-clamp-only-nan-seeds", choice="3"), "0").endswith("not this time")
    none = reveal(predict("05-crash-step", low=None, high=None), 23)
    assert none == "measured: 23 step (no well-formed prediction was made)"
    reveal(predict("07-rollbacks", low=5, high=1), 3)
    out = capsys.readouterr().out
    assert "⏳ no prediction yet: fill in low and high" in out and "🔮" in out
    assert "❌ low must be <= high" in out


def test_the_lab_gets_the_call_with_every_field_blank():
    solution = ("# your prediction\n### BEGIN PREDICTION\n"
                'guess = predict("10-temperature-zero", choice="greedy tokens, the argmax")\n'
                "### END PREDICTION\nprint(guess)")
    lab = student_source(solution)
    assert lab == ("# your prediction\nguess = predict('10-temperature-zero', choice=None)\n"
                   "print(guess)")
    assert predict_calls(lab) == [("10-temperature-zero", {"choice": None})]
    with pytest.raises(MarkerError, match="without a predict"):
        blank_predictions("x = 1")


def test_a_non_literal_argument_is_read_not_run():
    source = 'guess = predict("07-rollbacks", low=__import__("os").getpid(), high=3)'
    assert predict_calls(source) == [("07-rollbacks", {"low": "<not a literal>", "high": 3})]
    assert "low must be a number" in form_problem("07-rollbacks", predict_calls(source)[0][1])


def test_notebooks_05_to_10_each_ask_for_a_prediction_before_they_measure():
    manifest = labs.load_manifest()["notebooks"]
    asked = {name[:2]: [p["question"] for p in nb["predictions"]] for name, nb in manifest.items()
             if nb["predictions"]}
    assert sorted(asked) == ["05", "06", "07", "08", "09", "10"]
    assert sorted(q for qs in asked.values() for q in qs) == sorted(QUESTIONS)


def test_reveal_prints_its_line_once_in_a_notebook(capsys):
    # as a cell's last line its return value would be displayed again under the print
    line = reveal(predict("07-rollbacks", low=1, high=5), 3)
    assert capsys.readouterr().out.count("measured 3") == 1
    assert line.endswith("inside your range")
    from IPython.core.formatters import DisplayFormatter  # what a cell's value goes through

    assert DisplayFormatter().format(line) == ({}, {})  # nothing shown again
