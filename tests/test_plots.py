"""Plot helpers: the numbers they draw."""

import pytest

from grpo_lab.course.plots import moving_average


def test_moving_average_is_the_mean_of_the_last_window_values():
    assert moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 3) == pytest.approx([1.0, 1.5, 2.0, 3.0, 4.0])
    assert moving_average([2.0, 4.0], 1) == [2.0, 4.0]  # window 1: unchanged
    assert moving_average([], 5) == []
