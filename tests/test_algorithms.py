"""The algorithm registry: every stage's choices, defaults and dispatch come from it, and a new algorithm is one
entry there (a toy pair loss and a toy group algorithm are added here through ``register`` alone and trained)."""

import json
import typing
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file

from rlhf_pipeline import algorithms
from rlhf_pipeline.algorithms import ALGORITHMS, GROUPS, PAIRS, GroupAlgorithm, PairAlgorithm, names, register


def test_stage_choices_are_the_registry():
    from rlhf_pipeline.stages.demo import DemoConfig
    from rlhf_pipeline.stages.iterate import IterateConfig
    from rlhf_pipeline.stages.train import TrainConfig

    for config in (TrainConfig, IterateConfig, DemoConfig):
        assert typing.get_args(typing.get_type_hints(config)["algo"]) == tuple(ALGORITHMS), config.__name__
    assert names(PAIRS) == ("rebel", "dpo", "cdpo", "ipo", "simpo")
    assert names(GROUPS) == ("ppo", "grpo", "rloo", "reinforce_pp", "dapo", "dr_grpo", "gspo")
    assert {a.name for a in ALGORITHMS.values() if a.uses_critic} == {"ppo"}
    assert all(a.demo for a in ALGORITHMS.values())  # rlhf demo has settings for every algorithm


def test_unknown_and_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="unknown algorithm; choose one of rebel, dpo"):
        algorithms.get("dpp")
    with pytest.raises(ValueError, match="already registered"):
        register(PairAlgorithm("dpo", "rlhf_pipeline.losses:dpo_terms", "again"))


@pytest.fixture
def toy(request):
    """Register an algorithm for one test and remove it afterwards."""
    added = []

    def add(algorithm):
        added.append(register(algorithm).name)
        return algorithm

    yield add
    for name in added:
        ALGORITHMS.pop(name)


def toy_pair_terms(params, policy_chosen, policy_rejected):
    """A reference-free hinge on the raw log-prob gap: max(0, 1 - (logπc - logπr))."""
    gap = policy_chosen - policy_rejected
    return torch.relu(1.0 - gap), gap, policy_chosen, policy_rejected


def toy_advantages(token_rewards, mask, values, params):
    """Every token gets its sequence's total reward."""
    return torch.where(mask, token_rewards.sum(dim=1, keepdim=True), 0.0), None


def toy_baseline(rewards, params):
    return rewards - rewards.mean(dim=-1, keepdim=True)


def dataset(tmp_path: Path, rows: list[dict]) -> Path:
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "data"))
    return tmp_path / "data"


def changed(before: str, after: Path) -> bool:
    wa, wb = load_file(Path(before) / "model.safetensors"), load_file(after / "model.safetensors")
    return any(not torch.equal(wa[k], wb[k]) for k in wa)


def test_a_toy_pair_loss_trains_through_the_registry_alone(toy, tmp_path, tiny_policy, fresh_accelerate_state):
    toy(PairAlgorithm("toy_pair", toy_pair_terms, "hinge on the log-prob gap", needs_reference=False))
    rows = [{"prompt_token_ids": [1, 10 + i, 11], "chosen_token_ids": [20 + i, 21, 22, 2], "rejected_token_ids": [30, 2],
             "chosen_reward": 1.0, "rejected_reward": 0.0} for i in range(4)]
    from rlhf_pipeline.stages.train import TrainConfig, main

    out = tmp_path / "out"
    main(TrainConfig(algo="toy_pair", model=tiny_policy, data=str(dataset(tmp_path, rows)), output=str(out),
                     report_to="none", batch_size=2, max_steps=1, learning_rate=1e-2))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["algo"] == "toy_pair" and manifest["training"]["steps"] == 1
    assert manifest["training"]["loss_first_step"] > 1  # the longer chosen response is far less likely: the hinge is on
    assert changed(tiny_policy, out)


def test_a_toy_group_algorithm_trains_through_the_registry_alone(toy, tmp_path, tiny_policy,
                                                                fresh_accelerate_state):
    toy(GroupAlgorithm("toy_group", toy_advantages, "total reward on every token", baseline=toy_baseline))
    rows = [{"prompt_token_ids": [1, 10 + i, 11], "response_token_ids": [[20, 21, 2], [30, 2], [40, 41, 42]],
             "rewards": [1.0, 0.0, 0.5]} for i in range(2)]
    from rlhf_pipeline.stages.train import TrainConfig, main

    out = tmp_path / "out"
    main(TrainConfig(algo="toy_group", model=tiny_policy, data=str(dataset(tmp_path, rows)), output=str(out),
                     report_to="none", batch_size=2, max_steps=1, learning_rate=1e-2, temperature=1.0,
                     kl_coef=0.0))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["algo"] == "toy_group" and manifest["training"]["steps"] == 1
    assert changed(tiny_policy, out)
    rollout = Dataset.load_from_disk(str(out / "rollout" / "train"))
    # the toy baseline centred each group's rewards: scores (1, 0, 0.5) - 0.5
    assert rollout["score"][:3] == pytest.approx([0.5, -0.5, 0.0])
