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


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", arXiv:2107.03374, eq. 1): the probability that at least one of ``k``
    samples drawn without replacement from the ``n`` is correct, ``1 - C(n-c, k) / C(n, k)``.

    Computed as the paper's numerically stable form, ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (the binomials overflow a
    float for n in the hundreds); with fewer than ``k`` wrong samples (``n - c < k``) every draw of ``k`` holds a
    correct one, and the estimate is exactly 1.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool | float], k: int) -> float:
    """maj@k of one prompt: 1.0 when the most frequent answer among its first ``k`` samples is correct, else 0.0.

    ``answers[j]`` is sample j's canonical answer (None: no answer found, which casts no vote); ``correct[j]`` whether
    sample j is right (a 0/1 reward). A tie goes to the answer that appeared first; the majority answer's correctness
    is that of its first sample. No answer among the first ``k`` scores 0.
    """
    if not 1 <= k <= len(answers) or len(answers) != len(correct):
        raise ValueError(f"maj_at_k needs 1 <= k <= {len(answers)} samples and one correctness per answer")
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for j, answer in enumerate(answers[:k]):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        first.setdefault(answer, j)
    if not counts:
        return 0.0
    # the highest count; among equal counts the smallest first position (dicts keep insertion = first-seen order)
    winner = max(counts, key=lambda a: (counts[a], -first[a]))
    return 1.0 if correct[first[winner]] else 0.0


def k_ladder(n: int) -> list[int]:
    """The k at which pass@k and maj@k are reported for ``n`` samples a prompt: 1, 2, 4, ... up to ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def at_k_summary(per_prompt: Sequence[dict[int, float]]) -> dict[str, dict[str, float | None]]:
    """``{"k": {"mean": ..., "stderr": ...}}`` for every k: the mean over prompts of ``per_prompt[i][k]`` (prompt i's
    pass@k or maj@k) and its standard error (:func:`mean_and_stderr`), k in increasing order, keys as strings (JSON)."""
    ks = sorted(per_prompt[0]) if per_prompt else []
    summary = {}
    for k in ks:
        mean, stderr = mean_and_stderr([values[k] for values in per_prompt])
        summary[str(k)] = {"mean": mean, "stderr": stderr}
    return summary


def pass_at_k_summary(correct: Sequence[Sequence[bool | float]]) -> dict[str, dict[str, float | None]]:
    """pass@k over prompts, ``correct[i][j]`` whether sample j of prompt i is right, for every k of
    :func:`k_ladder` (of the fewest samples any prompt has)."""
    n = min(len(c) for c in correct)
    return at_k_summary([{k: pass_at_k(len(c), int(sum(map(bool, c))), k) for k in k_ladder(n)} for c in correct])


def maj_at_k_summary(answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool | float]]
                     ) -> dict[str, dict[str, float | None]]:
    """maj@k over prompts (``answers[i][j]``, ``correct[i][j]`` of sample j of prompt i), for every k of
    :func:`k_ladder`."""
    n = min(len(c) for c in correct)
    return at_k_summary([{k: maj_at_k(a, c, k) for k in k_ladder(n)} for a, c in zip(answers, correct)])
