"""Pair and group selection, and the train/test split: pure functions on hand-made rows."""

import pytest

from rlhf_pipeline.selection import (
    EQUAL_REWARDS,
    FEWER_THAN_TWO,
    IDENTICAL,
    NO_RESPONSES,
    PROMPT_TOO_LONG,
    RESPONSE_TOO_LONG,
    RESPONSE_TRUNCATED,
    LengthLimits,
    best_and_worst,
    decide_group,
    decide_pair,
    split_by_prompt,
    split_indices,
)

LIMITS = LengthLimits(max_prompt_tokens=4, max_response_tokens=3)


def test_best_and_worst_first_index_wins_ties():
    assert best_and_worst([1.0, 3.0, 3.0, -1.0, -1.0], [True] * 5) == (1, 3)
    assert best_and_worst([5.0, 1.0, 9.0], [True, True, False]) == (0, 1)  # the unusable 9.0 is not chosen
    assert best_and_worst([1.0, 2.0], [True, False]) is None


def test_pair_is_best_versus_worst():
    d = decide_pair(2, [[1], [2], [3]], [0.5, 2.0, -1.0], ["stop"] * 3, LIMITS)
    assert d.pair == (1, 2) and d.reason is None


def test_long_response_is_left_out_not_the_prompt():
    # response 1 has the best reward but 4 tokens > 3: the choice falls on the others.
    d = decide_pair(2, [[1], [2, 2, 2, 2], [3, 3]], [0.0, 9.0, 1.0], None, LIMITS)
    assert d.pair == (2, 0)
    assert d.response_problems == {RESPONSE_TOO_LONG: 1}


def test_truncated_responses_left_out_only_when_asked():
    ids, rewards, finish = [[1], [2], [3]], [3.0, 2.0, 1.0], ["length", "stop", "stop"]
    assert decide_pair(2, ids, rewards, finish, LIMITS).pair == (0, 2)
    strict = LengthLimits(4, 3, drop_truncated=True)
    d = decide_pair(2, ids, rewards, finish, strict)
    assert d.pair == (1, 2) and d.response_problems == {RESPONSE_TRUNCATED: 1}


@pytest.mark.parametrize(
    "prompt_len, ids, rewards, reason",
    [
        (5, [[1], [2]], [1.0, 0.0], PROMPT_TOO_LONG),
        (1, [[1], [2, 2, 2, 2]], [1.0, 0.0], FEWER_THAN_TWO),
        (1, [[1], [2], [3]], [0.7, 0.7, 0.7], EQUAL_REWARDS),
        (1, [[4, 5], [4, 5]], [1.0, 0.0], IDENTICAL),
    ],
)
def test_pair_drop_reasons(prompt_len, ids, rewards, reason):
    d = decide_pair(prompt_len, ids, rewards, None, LIMITS)
    assert d.pair is None and d.reason == reason


def test_group_keeps_all_or_nothing():
    assert decide_group(2, [[1], [2, 2]], ["stop", "stop"], LIMITS) is None
    assert decide_group(2, [[1], [2, 2, 2, 2]], None, LIMITS) == RESPONSE_TOO_LONG
    assert decide_group(9, [[1]], None, LIMITS) == PROMPT_TOO_LONG
    assert decide_group(2, [[1], [2]], ["stop", "length"], LengthLimits(4, 3, True)) == RESPONSE_TRUNCATED
    # a prompt without responses is no group (--drop-uniform-groups took max() of no rewards)
    assert decide_group(2, [], [], LIMITS) == NO_RESPONSES
    assert decide_group(2, [], [], LIMITS, rewards=[], uniform_dropped=True) == NO_RESPONSES


def test_split_is_seeded_disjoint_and_ordered():
    train, test = split_indices(100, 10, seed=0)
    assert len(test) == 10 and len(train) == 90
    assert sorted(train + test) == list(range(100))
    assert train == sorted(train) and test == sorted(test)
    assert split_indices(100, 10, seed=0) == (train, test)
    assert split_indices(100, 10, seed=1)[1] != test
    assert len(split_indices(100, 0.25, seed=0)[1]) == 25
    assert split_indices(5, 0, seed=0) == ([0, 1, 2, 3, 4], [])


def test_the_filter_split_is_by_prompt_seeded_and_keeps_a_prompt_on_its_side_across_iterations():
    """rlhf filter's split: a prompt given twice is on one side; the split is seeded; and as a run's iterations drop
    other prompts, the held-out prompts stay held out (the permutation of surviving rows it replaced moved 6 of 10
    test prompts into training when one prompt in 100 was dropped)."""
    ids = [f"p{i}" for i in range(100)]
    train, test = split_by_prompt(ids, 10, seed=0)
    assert len(test) == 10 and sorted(train + test) == list(range(100)) and train == sorted(train)
    assert split_by_prompt(ids, 10, seed=0) == (train, test) and split_by_prompt(ids, 10, seed=1)[1] != test
    assert len(split_by_prompt(ids, 0.25, seed=0)[1]) == 25 and split_by_prompt(ids[:5], 0, seed=0)[1] == []
    held_out = {ids[i] for i in test}

    # the next iteration drops a prompt the last one trained on, then one it held out
    trained = next(p for p in ids if p not in held_out)
    later = [p for p in ids if p != trained]
    assert {later[i] for i in split_by_prompt(later, 10, seed=0)[1]} == held_out
    dropped = sorted(held_out)[0]
    later = [p for p in ids if p != dropped]
    moved = {later[i] for i in split_by_prompt(later, 10, seed=0)[1]} - held_out
    assert len(moved) == 1  # the prompt ranked next takes the dropped one's place; no other moves

    # a prompt given twice (rows 0 and 3): its rows on one side, whichever
    twice = ["a", "b", "c", "a", "d", "e"]
    for seed in range(20):
        train, test = split_by_prompt(twice, 2, seed)
        assert (0 in test) == (3 in test) and len({twice[i] for i in test}) == 2
    with pytest.raises(ValueError, match="takes 5 of 5 prompts and leaves none to train on"):
        split_by_prompt(twice, 5, seed=0)


def test_split_refuses_a_test_split_that_leaves_nothing():
    with pytest.raises(ValueError, match="leaves none to train on"):
        split_indices(200, 1000, seed=0)
    with pytest.raises(ValueError):
        split_indices(200, 2.5, seed=0)
