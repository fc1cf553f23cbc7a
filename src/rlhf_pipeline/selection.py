"""Pure functions that decide which responses become training data. No I/O, no torch.

Pairs (REBEL, DPO family): among the responses that pass the length filters, the best becomes ``chosen`` and the
worst ``rejected`` (the first index wins a tie, as ``argmax``/``argmin`` do in REBEL's ``filter_tokenize.py``).
A prompt whose surviving rewards are all equal, or whose best and worst responses are the same tokens, gives no
preference and is dropped. Unlike REBEL, one over-long response does not drop its whole prompt: it is left out
of the choice.

Groups (PPO family): all n responses are kept, so a prompt is dropped when any response fails a filter (a group
keeps a fixed size, which the group baselines assume).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Reasons, as recorded in the manifest.
PROMPT_TOO_LONG = "prompt_too_long"
RESPONSE_TOO_LONG = "response_too_long"
RESPONSE_TRUNCATED = "response_truncated"
FEWER_THAN_TWO = "fewer_than_two_responses_left"
EQUAL_REWARDS = "equal_rewards"
IDENTICAL = "identical_chosen_rejected"


@dataclass(frozen=True)
class LengthLimits:
    max_prompt_tokens: int
    max_response_tokens: int
    drop_truncated: bool = False


def response_problem(length: int, finish_reason: str | None, limits: LengthLimits) -> str | None:
    """Why a response fails the filters, or None when it passes."""
    if length > limits.max_response_tokens:
        return RESPONSE_TOO_LONG
    if limits.drop_truncated and finish_reason == "length":
        return RESPONSE_TRUNCATED
    return None


def best_and_worst(rewards: Sequence[float], usable: Sequence[bool]) -> tuple[int, int] | None:
    """Indices of the highest and lowest reward among usable responses (first on ties); None if fewer than 2."""
    candidates = [i for i, ok in enumerate(usable) if ok]
    if len(candidates) < 2:
        return None
    best = max(candidates, key=lambda i: (rewards[i], -i))
    worst = min(candidates, key=lambda i: (rewards[i], i))
    return best, worst


@dataclass
class PairDecision:
    """What happened to one prompt: ``pair`` when kept, else ``reason``; ``response_problems`` counts the rest."""

    pair: tuple[int, int] | None
    reason: str | None
    response_problems: dict[str, int]


def decide_pair(
    prompt_length: int,
    response_ids: Sequence[Sequence[int]],
    rewards: Sequence[float],
    finish_reasons: Sequence[str] | None,
    limits: LengthLimits,
) -> PairDecision:
    if prompt_length > limits.max_prompt_tokens:
        return PairDecision(None, PROMPT_TOO_LONG, {})
    problems: dict[str, int] = {}
    usable = []
    for j, ids in enumerate(response_ids):
        problem = response_problem(len(ids), finish_reasons[j] if finish_reasons else None, limits)
        usable.append(problem is None)
        if problem:
            problems[problem] = problems.get(problem, 0) + 1
    chosen_rejected = best_and_worst(rewards, usable)
    if chosen_rejected is None:
        return PairDecision(None, FEWER_THAN_TWO, problems)
    best, worst = chosen_rejected
    if rewards[best] == rewards[worst]:
        return PairDecision(None, EQUAL_REWARDS, problems)
    if list(response_ids[best]) == list(response_ids[worst]):
        return PairDecision(None, IDENTICAL, problems)
    return PairDecision((best, worst), None, problems)


def decide_group(
    prompt_length: int,
    response_ids: Sequence[Sequence[int]],
    finish_reasons: Sequence[str] | None,
    limits: LengthLimits,
) -> str | None:
    """Why a whole group is dropped, or None when it is kept."""
    if prompt_length > limits.max_prompt_tokens:
        return PROMPT_TOO_LONG
    for j, ids in enumerate(response_ids):
        problem = response_problem(len(ids), finish_reasons[j] if finish_reasons else None, limits)
        if problem:
            return problem
    return None


def split_indices(num_rows: int, test_size: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded train/test split of ``range(num_rows)``; each split keeps the original row order.

    ``test_size`` below 1 is a fraction of the rows, otherwise a row count.
    """
    import numpy as np

    n_test = round(test_size * num_rows) if 0 < test_size < 1 else int(test_size)
    if test_size < 0 or (test_size >= 1 and test_size != int(test_size)):
        raise ValueError(f"test_size {test_size}: use a fraction in (0, 1) or a whole number of rows")
    if n_test >= num_rows:
        raise ValueError(f"test_size {test_size} takes {n_test} of {num_rows} rows and leaves none to train on")
    perm = np.random.default_rng(seed).permutation(num_rows)
    return sorted(perm[n_test:].tolist()), sorted(perm[:n_test].tolist())
