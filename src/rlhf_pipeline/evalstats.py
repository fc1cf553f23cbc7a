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


def pair_indices(ours: Sequence[Sequence], theirs: Sequence[Sequence]) -> list[tuple[int, int, int]]:
    """The comparisons of two aligned lists of per-prompt responses, as ``(prompt, ours, theirs)`` indices: response
    j against response j of the same prompt, or every response against the one there is (a reference answer)."""
    found = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if len(b) == 1:
            found.extend((i, j, 0) for j in range(len(a)))
        else:
            found.extend((i, j, j) for j in range(min(len(a), len(b))))
    return found


def outcome(x: float, y: float) -> float:
    """1 for a win of ``x`` over ``y``, 1/2 for a tie, 0 for a loss."""
    return 1.0 if x > y else 0.5 if x == y else 0.0


def reward_comparison(ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]],
                      our_lengths: Sequence[Sequence[int]], their_lengths: Sequence[Sequence[int]],
                      bradley_terry: bool) -> dict:
    """Rewards of the evaluated responses against the other side's, per prompt (and the responses' lengths in
    characters): the win rate (a win 1, a tie 1/2) with its standard error over prompts and its counts, and the
    length-controlled win rate fitted on the judge's preferences, which are the reward model's Bradley-Terry
    probabilities ``sigmoid(r_ours - r_theirs)`` when ``bradley_terry``, else the outcomes themselves (a python
    function's rewards say which is better, not by how much on a probability scale)."""
    pairs = pair_indices(ours, theirs)
    outcomes = [outcome(ours[i][j], theirs[i][k]) for i, j, k in pairs]
    if bradley_terry:
        preferences = [1.0 / (1.0 + math.exp(min(theirs[i][k] - ours[i][j], 700.0))) for i, j, k in pairs]
    else:
        preferences = outcomes
    total = len(outcomes)
    result = {
        "win_rate": sum(outcomes) / total if total else None,
        "win_rate_stderr": _stderr_over_prompts(outcomes, [i for i, _, _ in pairs]),
        "wins": outcomes.count(1.0), "ties": outcomes.count(0.5), "losses": outcomes.count(0.0),
    }
    lengths = [our_lengths[i][j] - their_lengths[i][k] for i, j, k in pairs]
    return {**result, **_length_controlled(preferences, lengths, [i for i, _, _ in pairs],
                                           "bradley-terry" if bradley_terry else "outcome")}


def preference_comparison(preferences: Sequence[float | None], length_differences: Sequence[float],
                          prompts: Sequence[int]) -> dict:
    """A judge's preferences for the evaluated response, one per comparison (None: not both verdicts read, left
    out), with the length differences (ours minus theirs, in characters) and the prompt of each: the win rate (the
    mean preference) with its standard error over prompts, the counts (a preference above, at or below 1/2), and the
    LC win rate."""
    kept = [(p, prompt) for p, prompt in zip(preferences, prompts) if p is not None]
    values = [p for p, _ in kept]
    means = _prompt_means(values, [prompt for _, prompt in kept])
    win_rate, stderr = mean_and_stderr(means) if kept else (None, None)
    result = {
        "win_rate": win_rate, "win_rate_stderr": stderr,
        "wins": sum(p > 0.5 for p in values), "ties": sum(p == 0.5 for p in values),
        "losses": sum(p < 0.5 for p in values),
    }
    return {**result, **_length_controlled(preferences, length_differences, prompts, "judge")}


def _prompt_means(values: Sequence[float], prompts: Sequence[int]) -> list[float]:
    """The mean of the values of each prompt (``prompts[m]`` is value m's), in the order the prompts first appear."""
    by_prompt: dict[int, list[float]] = {}
    for value, prompt in zip(values, prompts):
        by_prompt.setdefault(prompt, []).append(value)
    return [sum(v) / len(v) for v in by_prompt.values()]


def _stderr_over_prompts(values: Sequence[float], prompts: Sequence[int]) -> float | None:
    """The standard error of a mean over comparisons, with the comparisons of one prompt taken together (they share
    its instruction and are not independent): that of the per-prompt means (equal to the cluster-robust one when
    every prompt has as many comparisons)."""
    return mean_and_stderr(_prompt_means(values, prompts))[1] if values else None


def _length_controlled(preferences, length_differences, prompts, kind: str) -> dict:
    fit = length_controlled_win_rate(preferences, length_differences, prompts)
    if fit is None:
        return {"lc_win_rate": None, "lc_stderr": None, "length_controlled": None}
    return {"lc_win_rate": fit["win_rate"], "lc_stderr": fit["stderr"],
            "length_controlled": {**fit, "preferences": kind}}


# ---------------------------------------------------------------------------------------------------------------
# The length-controlled win rate
#
# AlpacaEval 2's length-controlled (LC) win rate (Dubois et al. 2024, "Length-Controlled AlpacaEval: A Simple Way to
# Debias Automatic Evaluators", arXiv:2404.04475; alpaca_eval/metrics/glm_winrate.py in tatsu-lab/alpaca_eval) fits a
# logistic model of the judge's preference for the evaluated response,
#
#     P(ours preferred) = sigmoid(theta + phi * tanh(delta_len / sd(delta_len)) + psi * difficulty_i),
#
# on every comparison (soft preferences in [0, 1] as targets), and reads it at zero length difference: the LC win
# rate is the mean over the comparisons of sigmoid(theta + psi * difficulty_i). ``delta_len`` is the difference in
# characters (ours minus theirs). The instruction term needs a per-prompt difficulty estimated beforehand on many
# models' annotations (AlpacaEval ships one for its 805 instructions); without one the model is AlpacaEval's
# "length_controlled_minimal" GLM and the LC win rate is sigmoid(theta). AlpacaEval's default GLM also regularises
# towards annotations of deliberately verbose and terse baselines, which exist only for its own prompts.
#
# The fit here is maximum likelihood by Newton's method with a weak Gaussian prior (RIDGE) so that a judge that always
# prefers one side still gives a finite answer; the package fits an L1-penalised regression whose strength it picks by
# 5-fold cross-validation. The standard error is the delta method on a sandwich covariance clustered by prompt (the
# n responses of a prompt share its instruction and are not independent); the package reports the spread of the
# predicted preferences over instructions instead, which is zero without an instruction term.

RIDGE = 1e-4  # per comparison: the prior's precision over the number of comparisons


def _sigmoid(x):
    import numpy as np

    return np.exp(-np.logaddexp(0.0, -x))


def length_controlled_win_rate(
    preferences: Sequence[float],
    length_differences: Sequence[float],
    clusters: Sequence[int | str],
    difficulty: Sequence[float] | None = None,
) -> dict | None:
    """The LC win rate of comparisons: ``preferences[m]`` is the judge's probability that ours wins comparison m
    (1 win, 0.5 tie, 0 loss for a verdict; a Bradley-Terry probability for a reward model; None or NaN for no
    verdict, left out), ``length_differences[m]`` our response's length minus theirs, ``clusters[m]`` the prompt it
    belongs to, ``difficulty[m]`` its prompt's instruction difficulty (optional). Returns ``{"win_rate", "stderr",
    "raw_win_rate", "length_coef", "comparisons"}``; None when there is nothing to fit."""
    import numpy as np

    keep = [m for m, p in enumerate(preferences) if p is not None and not math.isnan(p)]
    if not keep:
        return None
    y = np.array([preferences[m] for m in keep], dtype=np.float64)
    delta = np.array([length_differences[m] for m in keep], dtype=np.float64)
    groups = np.unique(np.array([str(clusters[m]) for m in keep]), return_inverse=True)[1]
    sd = delta.std(ddof=1) if len(delta) > 1 else 0.0
    columns = [np.ones_like(y)]
    with_length = bool(sd > 0)
    if with_length:
        columns.append(np.tanh(delta / sd))
    if difficulty is not None:
        columns.append(np.array([difficulty[m] for m in keep], dtype=np.float64))
    x = np.stack(columns, axis=1)
    beta = _fit_logistic(x, y)
    x0 = x.copy()
    if with_length:
        x0[:, 1] = 0.0  # read at zero length difference
    p0 = _sigmoid(x0 @ beta)
    win_rate = float(p0.mean())
    # delta method: d(win rate)/d(beta), through the sandwich covariance clustered by prompt
    grad = (p0 * (1 - p0)) @ x0 / len(y)
    p = _sigmoid(x @ beta)
    scores = np.zeros((groups.max() + 1, x.shape[1]))
    np.add.at(scores, groups, x * (y - p)[:, None])
    bread = np.linalg.pinv(_hessian(x, p))
    clusters_n = scores.shape[0]
    meat = scores.T @ scores * (clusters_n / (clusters_n - 1) if clusters_n > 1 else 1.0)
    variance = float(grad @ bread @ meat @ bread @ grad)
    return {
        "win_rate": win_rate,
        "stderr": math.sqrt(variance) if clusters_n > 1 else None,
        "raw_win_rate": float(y.mean()),
        "length_coef": float(beta[1]) if with_length else 0.0,
        "comparisons": len(y),
    }


def _hessian(x, p):
    """The negative log-posterior's Hessian of the fit at predictions ``p``: the logistic part and the prior's."""
    import numpy as np

    return (x * (p * (1 - p))[:, None]).T @ x + RIDGE * len(p) * np.eye(x.shape[1])


def _fit_logistic(x, y, iterations: int = 100):
    """Maximum likelihood for sigmoid(x @ beta) against soft targets ``y``, with the weak prior RIDGE (Newton)."""
    import numpy as np

    beta = np.zeros(x.shape[1])
    for _ in range(iterations):
        p = _sigmoid(x @ beta)
        gradient = x.T @ (y - p) - RIDGE * len(y) * beta
        step = np.linalg.solve(_hessian(x, p), gradient)
        beta = beta + step
        if np.abs(step).max() < 1e-10:
            break
    return beta



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
