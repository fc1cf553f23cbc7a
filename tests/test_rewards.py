"""Reward model scoring (batched against one-by-one) and reward functions."""

import types

import pytest
import torch

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.rewards import RewardModelScorer, call_reward_fn, load_reward_fn, reward_from_output


def test_batched_length_sorted_scores_equal_one_by_one(tiny_rm):
    """The fast path (sorted, padded batches) against the naive one (one sequence per forward, no padding)."""
    prompts = ["Write a short review of the hotel The Willow.", "Hi", "What did you think of the album Low Tide?"]
    responses = ["Great staff and a lovely view.", "ok", "The songs were dull, but the vocals were warm and fun."]
    batched = RewardModelScorer(tiny_rm, batch_size=3)
    one = RewardModelScorer(tiny_rm, batch_size=1)
    a = batched.score(prompts * 2, responses + responses[::-1])
    b = one.score(prompts * 2, responses + responses[::-1])
    assert a == pytest.approx(b, abs=1e-5)
    assert len(set(round(x, 6) for x in a)) > 1  # a constant reward would make the check empty


def test_truncation_keeps_the_first_tokens_and_is_counted(tiny_rm):
    scorer = RewardModelScorer(tiny_rm, max_length=8)
    ids = scorer.encode(["a long prompt with many words in it"], ["and a long answer too"])
    assert len(ids[0]) == 8 and scorer.truncated == 1


def test_reward_from_output_prefers_score_field():
    out = types.SimpleNamespace(score=torch.tensor([[0.5], [1.5]]), logits=torch.zeros(2, 19))
    assert reward_from_output(out).tolist() == [0.5, 1.5]  # ArmoRM: .score, not its 19 objective logits
    plain = types.SimpleNamespace(logits=torch.tensor([[2.0], [-1.0]]))
    assert reward_from_output(plain).tolist() == [2.0, -1.0]
    with pytest.raises(PipelineError, match="outputs 2 values per sequence"):
        reward_from_output(types.SimpleNamespace(logits=torch.zeros(2, 2)))


def test_load_reward_fn_from_file_and_module(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def length(prompts, responses, **cols):\n    return [len(r) for r in responses]\n")
    fn = load_reward_fn(f"{f}:length")
    assert call_reward_fn(fn, ["p"], ["abc"], {}) == [3.0]
    assert load_reward_fn("math:sqrt")(4) == 2.0
    with pytest.raises(PipelineError, match="no function 'nope'"):
        load_reward_fn(f"{f}:nope")
    with pytest.raises(PipelineError, match="expected module:function"):
        load_reward_fn("justaname")
    with pytest.raises(PipelineError, match="cannot import module"):
        load_reward_fn("no_such_module_xyz:fn")


def test_reward_fn_wrong_length_is_an_error():
    with pytest.raises(PipelineError, match="returned 1 rewards for 2 responses"):
        call_reward_fn(lambda p, r, **c: [1.0], ["a", "b"], ["x", "y"], {})
