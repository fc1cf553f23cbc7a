"""The demo's bundled tasks, in one registry (:data:`TASKS`): what ``rlhf demo --task NAME`` runs, and how.

- ``reviews`` (:mod:`rlhf_pipeline.demo.task`, the default): short product reviews; the gold reward is their
  sentiment; a reward model is trained on gold-labelled pairs and the iterations train on it.
- ``topics`` (:mod:`rlhf_pipeline.demo.topics`): name three things that belong to a topic; a verifiable python
  reward, on which the iterations train directly (no reward model).
- ``first_word`` (:mod:`rlhf_pipeline.demo.first_word`): start the answer with the word the prompt names; a
  verifiable format constraint, a python reward (no reward model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class DemoTask:
    name: str
    summary: str
    module: str  # where its data and rewards live
    gold: str  # the gold reward function (--reward-fn spec): evaluation, and training when reward_model is False
    second: str  # a second reward function, beside the training reward, for algorithms that read each source (GDPO)
    reward_model: bool  # train a reward model on gold-labelled pairs and train the policy on it

    def write_data(self, directory: Path, seed: int) -> dict[str, Path]:
        """The task's files (``prompts``, ``eval_prompts``, ``sft``, and ``preferences`` for a reward model)."""
        import importlib

        write: Callable[..., dict[str, Path]] = importlib.import_module(self.module).write_task_data
        return write(directory, seed=seed)


TASKS: dict[str, DemoTask] = {
    task.name: task
    for task in (
        DemoTask("reviews", "positive product reviews, a reward model trained on gold-labelled pairs",
                 "rlhf_pipeline.demo.task", "rlhf_pipeline.demo.task:gold_reward",
                 "rlhf_pipeline.demo.task:brevity_reward", reward_model=True),
        DemoTask("topics", "three things that belong to a topic, a python reward (no reward model)",
                 "rlhf_pipeline.demo.topics", "rlhf_pipeline.demo.topics:gold_reward",
                 "rlhf_pipeline.demo.topics:list_format_reward", reward_model=False),
        DemoTask("first_word", "start the answer with the word the prompt names, a python reward (no reward model)",
                 "rlhf_pipeline.demo.first_word", "rlhf_pipeline.demo.first_word:gold_reward",
                 "rlhf_pipeline.demo.topics:list_format_reward", reward_model=False),
    )
}
DEFAULT_TASK = "reviews"
