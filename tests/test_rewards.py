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


def test_reward_from_output_reads_an_armorm_style_model_output():
    """ArmoRM's remote code returns a ModelOutput with rewards (B, 19), gating_output and score of shape (B,), and a
    model output may have neither field: read score, whatever its logits, and say what the output has."""
    from dataclasses import dataclass
    from typing import Optional

    from transformers.utils import ModelOutput

    @dataclass
    class Gated(ModelOutput):
        rewards: Optional[torch.Tensor] = None
        gating_output: Optional[torch.Tensor] = None
        score: Optional[torch.Tensor] = None
        logits: Optional[torch.Tensor] = None

    out = Gated(rewards=torch.ones(2, 19), gating_output=torch.full((2, 19), 1 / 19), score=torch.tensor([0.25, -2.0]))
    assert reward_from_output(out).tolist() == [0.25, -2.0]
    assert reward_from_output(Gated(logits=torch.tensor([[3.0], [4.0]]))).tolist() == [3.0, 4.0]  # score None
    with pytest.raises(PipelineError, match=r"output \(Gated: rewards, gating_output\) has neither a score nor a "
                                            "logits tensor"):
        reward_from_output(Gated(rewards=torch.ones(2, 3), gating_output=torch.ones(2, 3)))
    with pytest.raises(PipelineError, match=r"rewards of shape \(\); expected one per sequence"):
        reward_from_output(Gated(score=torch.tensor(1.0)))


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
    with pytest.raises(PipelineError, match="cannot import module 'no_such_module_xyz'; pass path/to/file.py:"):
        load_reward_fn("no_such_module_xyz:fn")


def test_a_module_spec_naming_a_file_of_the_working_directory_says_how_to_load_the_file(tmp_path, monkeypatch):
    """``myreward:fn`` run beside myreward.py: the working directory is not on the import path, so it does not
    import; the error names the file form that loads it."""
    (tmp_path / "myreward.py").write_text("def fn(p, r, **c):\n    return [0.0] * len(r)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError, match="to load the file myreward.py, pass --reward-fn myreward.py:fn"):
        load_reward_fn("myreward:fn")
    assert load_reward_fn("myreward.py:fn")(["p"], ["r"]) == [0.0]


def test_a_column_named_as_the_functions_own_argument_is_one_line_not_the_users_traceback():
    """A prompts file with a ``prompts`` column made every call raise TypeError ("got multiple values for argument"),
    which was reported as the user's function raising, with its traceback."""
    with pytest.raises(PipelineError, match=r"^the reward function lengths: the data has a column named 'prompts', "
                                            r"the name of the function's own argument; rename that column"):
        call_reward_fn(lambda prompts, responses, **c: [1.0], ["a"], ["x"], {"prompts": ["b"]}, name="lengths")
    # the names the function gives its arguments count, not the documented ones
    assert call_reward_fn(lambda texts, outs, **c: [2.0], ["a"], ["x"], {"prompts": ["b"]}) == [2.0]
    with pytest.raises(PipelineError, match=r"a column named 'outs', the name of the function's own argument"):
        call_reward_fn(lambda texts, outs, **c: [2.0], ["a"], ["x"], {"outs": ["b"]})
    assert call_reward_fn(lambda *args, **c: [3.0], ["a"], ["x"], {"prompts": ["b"]}) == [3.0]


def test_reward_fn_wrong_length_is_an_error():
    with pytest.raises(PipelineError, match="returned 1 rewards for 2 responses"):
        call_reward_fn(lambda p, r, **c: [1.0], ["a", "b"], ["x", "y"], {})


# ---------------------------------------------------------------------------------------------------------------
# Several reward sources: "normalise, then sum" (issue 14, item 4)


def test_combine_rewards_by_hand():
    """Source a = [1, 3, 5, 7]: mean 4, population variance (9 + 1 + 1 + 9) / 4 = 5, std sqrt(5).
    Source b = [0, 0, 1, 1]: mean 0.5, std 0.5. Weights (1, 2):
    response 0: (1 - 4)/sqrt5 + 2 (0 - 0.5)/0.5 = -3/sqrt5 - 2 = -3.341641, response 1: -1/sqrt5 - 2 = -2.447214,
    response 2: +1/sqrt5 + 2 = 2.447214, response 3: 3/sqrt5 + 2 = 3.341641 (eps = 1e-6 moves them by ~3e-6)."""
    from rlhf_pipeline.rewards import combine_rewards

    combined, stats = combine_rewards([[1.0, 3.0, 5.0, 7.0], [0.0, 0.0, 1.0, 1.0]], [1.0, 2.0])
    assert combined == pytest.approx([-3.341641, -2.447214, 2.447214, 3.341641], abs=1e-5)
    assert (stats[0].mean, stats[0].std, stats[0].constant) == (4.0, pytest.approx(5 ** 0.5, abs=1e-15), False)
    assert (stats[1].mean, stats[1].std) == (0.5, 0.5)
    # a scale change of one source changes nothing once it is standardised (what summing raw rewards lacks)
    rescaled, _ = combine_rewards([[100.0, 300.0, 500.0, 700.0], [0.0, 0.0, 1.0, 1.0]], [1.0, 2.0])
    assert rescaled == pytest.approx(combined, abs=1e-5)
    # negative weights penalise; given statistics (eval's baseline) are used as they are
    from rlhf_pipeline.rewards import SourceStats

    fixed = [SourceStats(mean=0.0, std=2.0, constant=False), SourceStats(mean=1.0, std=1.0, constant=False)]
    combined, used = combine_rewards([[2.0, 4.0], [1.0, 3.0]], [1.0, -0.5], fixed, eps=0.0)
    assert combined == [1.0 - 0.0, 2.0 - 1.0] and used == fixed  # 2/2 - 0.5*0/1, 4/2 - 0.5*2/1


def test_a_constant_source_adds_exactly_zero():
    """0.1 ten times: fsum/10 rounds, so (v - mean) may be ~1e-17, which / eps would add ~1e-11 noise and break
    the ties the filter relies on. A constant source is detected on the values (max == min) and skipped."""
    from rlhf_pipeline.rewards import combine_rewards, source_stats

    a = [float(i) for i in range(10)]
    alone, _ = combine_rewards([a], [1.0])
    with_constant, stats = combine_rewards([a, [0.1] * 10], [1.0, 5.0])
    assert with_constant == alone  # exactly
    assert stats[1].constant and stats[1].std == 0.0 and stats[1].mean == pytest.approx(0.1)
    assert source_stats([3.0]).constant  # one value is constant too
    with pytest.raises(ValueError, match="2 reward sources but 1 weights"):
        combine_rewards([a, a], [1.0])


def test_reward_source_keys_and_columns():
    from rlhf_pipeline.stages.score import reward_sources

    # the only source of its kind is keyed by its kind: the columns rlhf eval has always written
    assert [(s.key, s.column) for s in reward_sources("runs/rm", "r.py:length")] == [
        ("reward_model", "rewards_reward_model"), ("reward_fn", "rewards_reward_fn")]
    # several of a kind: the model's directory / repo name, the function's name, made of [A-Za-z0-9_]
    sources = reward_sources(["runs/rm/", "RLHFlow/ArmoRM-Llama3-8B-v0.1"], ["a.py:format", "pkg.mod:length"])
    assert [s.key for s in sources] == ["reward_model_rm", "reward_model_ArmoRM_Llama3_8B_v0_1",
                                        "reward_fn_format", "reward_fn_length"]
    # the same name twice: _2, _3 in the order given (models first, then functions: the order of the weights)
    sources = reward_sources(None, ["a.py:reward", "b.py:reward", "c.py:reward"])
    assert [s.column for s in sources] == ["rewards_reward_fn_reward", "rewards_reward_fn_reward_2",
                                           "rewards_reward_fn_reward_3"]
    assert [s.kind for s in reward_sources(["m1", "m2"], "f.py:g")] == ["reward_model", "reward_model", "reward_fn"]


@pytest.mark.parametrize("source", [
    "def reward(prompts, responses, **c):\n    return [0.0] * len(responses)\n",
    "import functools\nreward = functools.partial(len)\n",
    "try:\n    from math import fsum as reward\nexcept ImportError:\n    pass\n",
    "if True:\n    def reward(p, r, **c):\n        return [0.0] * len(r)\n",
    "from math import *\n",  # a star import may bring it
    "def __getattr__(name):\n    return lambda p, r, **c: [0.0] * len(r)\n",
    "globals()['reward'] = lambda p, r, **c: [0.0] * len(r)\n",
    "vars()['reward'] = lambda p, r, **c: [0.0] * len(r)\n",
    "exec('def reward(p, r, **c):\\n    return [0.0] * len(r)')\n",
    "class reward:\n    pass\n",
])
def test_iterates_preflight_reads_a_reward_files_names_without_running_it(tmp_path, source):
    from rlhf_pipeline.rewards import check_reward_fn_spec

    path = tmp_path / "r.py"
    path.write_text("raise SystemExit('the file must not run')\n" + source)
    assert check_reward_fn_spec(f"{path}:reward", read_file=True) == (str(path), "reward")


def test_iterates_preflight_names_a_missing_function_or_a_file_that_does_not_parse(tmp_path):
    from rlhf_pipeline.errors import PipelineError
    from rlhf_pipeline.rewards import check_reward_fn_spec

    path = tmp_path / "r.py"
    path.write_text("def reward(p, r, **c):\n    return [0.0] * len(r)\nrewards_table = {}\n")
    with pytest.raises(PipelineError, match="defines no 'rewrad'; check the name after the ':'"):
        check_reward_fn_spec(f"{path}:rewrad", read_file=True)
    assert check_reward_fn_spec(f"{path}:rewrad") == (str(path), "rewrad")  # without reading it: the stage finds it
    path.write_text("def reward(p, r, **c)\n    return []\n")
    with pytest.raises(PipelineError, match="does not parse"):
        check_reward_fn_spec(f"{path}:reward", read_file=True)
