"""Pure functions that decide which responses become training data. No I/O, no torch.

Pairs (REBEL, DPO family): among the responses that pass the length filters, the best becomes ``chosen`` and the
worst ``rejected`` (the first index wins a tie, as ``argmax``/``argmin`` do in REBEL's ``filter_tokenize.py``).
A prompt whose surviving rewards are all equal, or whose best and worst responses are the same tokens, gives no
preference and is dropped. Unlike REBEL, one over-long response does not drop its whole prompt: it is left out
of the choice.

Groups (PPO family): all n responses are kept, so a prompt is dropped when any response fails a filter (a group
keeps a fixed size, which the group baselines assume). With ``uniform_dropped`` (DAPO's dynamic sampling, Yu et al.
2025, §3.2) a group whose rewards are all equal is dropped too: its group-relative advantages are all 0, so it adds
nothing but dilution to a batch.

Reward shaping (:class:`OverlongPenalty`, DAPO §3.4) is applied to the rewards before either choice.

Unpaired (KTO): every response that passes the filters, labelled desirable above its prompt's mean reward and
undesirable below it (:func:`decide_unpaired`), with a response of another prompt to pair it with for KTO's
reference point (:func:`mismatched_partners`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

# Reasons, as recorded in the manifest.
PROMPT_TOO_LONG = "prompt_too_long"
RESPONSE_TOO_LONG = "response_too_long"
RESPONSE_TRUNCATED = "response_truncated"
FEWER_THAN_TWO = "fewer_than_two_responses_left"
EQUAL_REWARDS = "equal_rewards"
IDENTICAL = "identical_chosen_rejected"
UNIFORM_REWARDS = "uniform_rewards"
NO_RESPONSES = "no_responses"


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment (Yu et al. 2025, §3.4, eq. 13), added to a response's reward by its length
    |y| in tokens, with L_max = ``max_tokens`` (the generation's token limit) and L_cache = ``buffer``::

        0                                   |y| <= L_max - L_cache
        factor * ((L_max - L_cache) - |y|) / L_cache    L_max - L_cache < |y| <= L_max   (0 down to -factor)
        -factor                             |y| > L_max

    verl's DAPO reward manager (``verl/workers/reward_manager/dapo.py``) computes the same for |y| <= L_max as
    ``min(-(|y| - (L_max - L_cache)) / L_cache * factor, 0)``; a response longer than L_max (which generation's own
    limit prevents) gets -factor here, as in the paper, where verl's line would keep falling.
    """

    max_tokens: int
    buffer: int
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.buffer <= self.max_tokens:
            raise ValueError(f"the overlong buffer ({self.buffer}) must be in 1..{self.max_tokens} (the token limit)")

    def __call__(self, length: int) -> float:
        start = self.max_tokens - self.buffer
        if length <= start:
            return 0.0
        if length > self.max_tokens:
            return -self.factor
        return self.factor * (start - length) / self.buffer


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
    rewards: Sequence[float] | None = None,
    uniform_dropped: bool = False,
) -> str | None:
    """Why a whole group is dropped, or None when it is kept (``rewards`` are needed for ``uniform_dropped``)."""
    if prompt_length > limits.max_prompt_tokens:
        return PROMPT_TOO_LONG
    if not response_ids:  # nothing to compare, nor to train on
        return NO_RESPONSES
    for j, ids in enumerate(response_ids):
        problem = response_problem(len(ids), finish_reasons[j] if finish_reasons else None, limits)
        if problem:
            return problem
    if uniform_dropped and rewards is not None and max(rewards) == min(rewards):
        return UNIFORM_REWARDS
    return None


def _test_count(test_size: float, total: int, what: str) -> int:
    """How many of ``total`` rows or prompts (``what``) ``test_size`` takes: a fraction below 1, else a count."""
    if test_size < 0 or (test_size >= 1 and test_size != int(test_size)):
        raise ValueError(f"test_size {test_size}: use a fraction in (0, 1) or a whole number of {what}")
    n_test = round(test_size * total) if 0 < test_size < 1 else int(test_size)
    if n_test >= total:
        raise ValueError(f"test_size {test_size} takes {n_test} of {total} {what} and leaves none to train on")
    return n_test


def split_indices(num_rows: int, test_size: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded train/test split of ``range(num_rows)``; each split keeps the original row order.

    ``test_size`` below 1 is a fraction of the rows, otherwise a row count.
    """
    import numpy as np

    n_test = _test_count(test_size, num_rows, "rows")
    perm = np.random.default_rng(seed).permutation(num_rows)
    return sorted(perm[n_test:].tolist()), sorted(perm[:n_test].tolist())


def split_by_prompt(prompt_ids: Sequence, test_size: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded train/test split of rows by their prompt (``prompt_ids``, one per row): every row of a prompt goes to
    the same split, and which one depends on the prompt, not on its row. The test prompts are the first
    ``test_size`` (a fraction of the prompts below 1, else a count) in the order of a seeded hash of their ids.

    So a prompt given twice is never on both sides, and the iterations of a run that samples the same prompts hold
    out the same ones as far as the survivors allow: a held-out prompt moves to training only when a prompt ranked
    before it survives now and did not before, or the count changed (a fraction of another number of survivors);
    one dropped before it only lets the next one in. (A permutation of the surviving rows moved most of them: 6 of 10
    test prompts had been trained on when one prompt in 100 was dropped.) Each split keeps the rows' order."""
    keys = [str(k) for k in prompt_ids]
    prompts = list(dict.fromkeys(keys))
    n_test = _test_count(test_size, len(prompts), "prompts")
    ranked = sorted(prompts, key=lambda p: hashlib.sha256(f"{seed}\x00{p}".encode()).digest())
    test = set(ranked[:n_test])
    return [i for i, k in enumerate(keys) if k not in test], [i for i, k in enumerate(keys) if k in test]


# ----------------------------------------------------------------------------------------------------------------
# Unpaired (KTO): each response labelled against its own prompt's mean reward

REWARD_AT_MEAN = "response_at_mean"  # a response left out: its reward is exactly its prompt's mean


@dataclass
class UnpairedDecision:
    """What happened to one prompt in unpaired mode: ``labels`` ((response index, desirable) of each kept response,
    in response order) when kept, else ``reason``; ``response_problems`` counts the responses left out (the length
    filters, and :data:`REWARD_AT_MEAN`)."""

    labels: list[tuple[int, bool]]
    reason: str | None
    response_problems: dict[str, int]


def decide_unpaired(
    prompt_length: int,
    response_ids: Sequence[Sequence[int]],
    rewards: Sequence[float],
    finish_reasons: Sequence[str] | None,
    limits: LengthLimits,
) -> UnpairedDecision:
    """KTO's labels from one prompt's scored samples: among the responses that pass the length filters, those above
    the mean of their rewards are desirable, those below it undesirable.

    Why the prompt's mean, not a fixed threshold: a reward model's score is only defined up to a per-prompt constant
    (Bradley-Terry fits differences), so "good" can only mean "better than what the policy usually says to this
    prompt"; the mean is the group baseline of GRPO and RLOO, and the label is the sign of that advantage. Why not
    only the best and worst (TRL's ``unpair_preference_dataset`` applied to our pairs): that throws away n − 2 of
    the n samples, while KTO's point is that every response with a good/bad signal is usable. Class balance: at
    least one response of each class per kept prompt, about as many of each over the data when rewards are not
    skewed; the counts go in the manifest, and ``rlhf train`` warns, as TRL does, when λ_D·n_D / λ_U·n_U leaves the
    paper's [1, 4/3] (eq. 8).

    Ties: a response whose reward is the mean carries no signal and is left out (counted as :data:`REWARD_AT_MEAN`);
    "is the mean" allows 1e-9 of the prompt's reward spread (max − min), so that float rounding does not label it
    (the mean of 0.1, 0.2 and 0.3 is 0.19999999999999998 in floats). A prompt whose usable rewards are all equal
    has no signal at all and is dropped (``equal_rewards``, exact equality, as in pairs mode), as is one with fewer
    than two usable responses.
    """
    import math

    if prompt_length > limits.max_prompt_tokens:
        return UnpairedDecision([], PROMPT_TOO_LONG, {})
    problems: dict[str, int] = {}
    usable = []
    for j, ids in enumerate(response_ids):
        problem = response_problem(len(ids), finish_reasons[j] if finish_reasons else None, limits)
        if problem:
            problems[problem] = problems.get(problem, 0) + 1
        else:
            usable.append(j)
    if len(usable) < 2:
        return UnpairedDecision([], FEWER_THAN_TWO, problems)
    values = [float(rewards[j]) for j in usable]
    spread = max(values) - min(values)
    if spread == 0:
        return UnpairedDecision([], EQUAL_REWARDS, problems)
    mean = math.fsum(values) / len(values)
    labels = []
    for j, r in zip(usable, values):
        if abs(r - mean) <= 1e-9 * spread:
            problems[REWARD_AT_MEAN] = problems.get(REWARD_AT_MEAN, 0) + 1
        else:
            labels.append((j, r > mean))
    return UnpairedDecision(labels, None, problems)


def mismatched_partners(prompt_keys: Sequence, seed: int) -> list[int]:
    """For each row (rows of one prompt share a key), the row whose response it is paired with for KTO's reference
    point: always a row of another prompt, and, whenever no prompt has more than half of the rows, each row's response
    used exactly once (a permutation), so the mismatched responses are the same set as the responses themselves.

    The prompts' blocks of rows are laid out in a seeded order and the responses shifted by the largest block: the
    shift by one within a batch that TRL makes (``trl/trainer/kto_trainer.py``, ``_prepare_dataset``'s
    ``add_kl_completion_ids``), made prompt-aware, since our data has several responses per prompt and a row must
    not be paired with its own prompt's response. Made once per dataset, so that the reference pass computes the
    mismatched pairs' reference log-probs with the responses'. Raises ValueError with fewer than two prompts.
    """
    import numpy as np

    blocks: dict = {}
    for i, key in enumerate(prompt_keys):
        blocks.setdefault(key, []).append(i)
    if len(blocks) < 2:
        raise ValueError(f"mismatched pairs need rows of at least 2 prompts, got {len(blocks)}")
    keys = list(blocks)
    layout = [i for b in np.random.default_rng(seed).permutation(len(keys)).tolist() for i in blocks[keys[b]]]
    n, shift = len(layout), max(len(b) for b in blocks.values())
    partners = [0] * n
    for k, row in enumerate(layout):
        j = shift
        while prompt_keys[layout[(k + j) % n]] == prompt_keys[row]:  # only when one prompt holds over half the rows
            j += 1
        partners[row] = layout[(k + j) % n]
    return partners
