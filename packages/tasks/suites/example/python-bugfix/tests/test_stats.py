import sys

import pytest

sys.path.insert(0, "/workspace")

import stats  # noqa: E402


def test_median_odd():
    assert stats.median([3, 1, 2]) == 2


def test_median_even():
    assert stats.median([1, 2, 3, 4]) == 2.5


def test_median_even_unsorted():
    assert stats.median([10, 2, 8, 4]) == 6


def test_median_single():
    assert stats.median([7]) == 7


def test_median_empty_raises():
    with pytest.raises(ValueError):
        stats.median([])


def test_mean_still_works():
    assert stats.mean([1, 2, 3, 4]) == 2.5
