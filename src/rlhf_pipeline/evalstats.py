"""Pure statistics of an evaluation: means with standard errors, win rates, the length-controlled win rate, pass@k
and maj@k. Plain numbers and lists in, plain numbers out; ``rlhf eval`` (``stages.eval``) reads the samples and
calls these."""

from __future__ import annotations

import math
from typing import Sequence


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample standard deviation / sqrt(count)); no error bar for one value."""
    count = len(values)
    mean = sum(values) / count
    if count < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (count - 1)
    return mean, math.sqrt(var / count)


def win_counts(ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]]) -> tuple[int, int, int]:
    """(wins, ties, losses) of response j against response j of the same prompt, over prompts and j."""
    wins = ties = losses = 0
    for a, b in zip(ours, theirs):
        for x, y in zip(a, b):
            wins += x > y
            ties += x == y
            losses += x < y
    return wins, ties, losses


# ---------------------------------------------------------------------------------------------------------------
# The length-controlled win rate


# ---------------------------------------------------------------------------------------------------------------
# pass@k and maj@k

