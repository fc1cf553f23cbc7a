"""Where things are, and what training metrics are called: the one place their names are spelled.

A run directory (``rlhf iterate``, ``rlhf demo``)::

    RUN/iterate.json            the resolved config of the latest invocation
    RUN/steps.jsonl             one line per launched stage: name, command, exit status, wall time
    RUN/.lock                   held while rlhf iterate runs stages (a second one on the run is refused)
    RUN/iter_0/eval/            the starting policy evaluated (when there are eval prompts)
    RUN/iter_<t>/<stage>/       t = 1..T, stage in ITERATION_STAGES
    RUN/sft/, RUN/reward_model/ (rlhf demo) the warm start and the reward model
    RUN/summary.json            (rlhf demo) the held-out numbers per iteration
    RUN/report.md, RUN/plots/   rlhf report

Inside a stage's output, besides the dataset and ``manifest.json`` (``datasets_io``): a training stage's
``metrics.jsonl`` and ``checkpoints/``, and the caches that let a resumed run skip finished work (``ref_logps/``,
``rollout/``); PPO's critic is saved in ``critic/``; ``rlhf eval`` writes ``results.json`` and ``samples/``.

Metric names: ``loss/<split>`` for the loss, ``<group>/train_<name>`` for a training-step metric and
``<group>/<name>`` for an evaluation metric, the group from :data:`METRIC_GROUPS` (``reward/accuracy``: the share
of held-out pairs where the trained model prefers the chosen response: the policy's implicit reward in
``rlhf train``, the reward model's score in ``rlhf train-rm``).
"""

from __future__ import annotations

import re
from pathlib import Path

ITERATE_CONFIG = "iterate.json"
STEPS_LOG = "steps.jsonl"
RUN_LOCK = ".lock"
SUMMARY = "summary.json"
REPORT = "report.md"
PLOTS_DIR = "plots"
ITERATION_STAGES = ("generate", "score", "filter", "train", "eval")
ITER_DIR = re.compile(r"^iter_(\d+)$")

MANIFEST = "manifest.json"  # in every stage output, written last: the output is complete
RUN_RECORD = "run_started.json"  # an in-place output's config and inputs, written when it starts
PARTS_DIR = "parts"  # an unfinished output's finished pieces (generate's and score's chunks), kept for a rerun
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
TRACKER_DIR = "runs"  # a training output's TensorBoard events (and its wandb run's id)
REF_LOGPS_CACHE = "ref_logps"
ROLLOUT_CACHE = "rollout"
CRITIC = "critic"
EVAL_RESULTS = "results.json"
EVAL_SAMPLES = "samples"
LM_EVAL_DIR = "lm_eval"  # rlhf eval --lm-eval: the harness's results.json


def iteration_dir(run: Path, t: int) -> Path:
    return Path(run) / f"iter_{t}"


def step_name(t: int, stage: str) -> str:
    """A stage run's name in steps.jsonl and in messages: ``iter_<t>/<stage>``."""
    return f"iter_{t}/{stage}"


# The group of each metric a training task reports; any other metric goes in the split's own group.
METRIC_GROUPS = {
    "policy_loss": "loss", "value_loss": "loss", "nll": "loss",
    "margin": "reward", "accuracy": "reward", "chosen_reward": "reward", "rejected_reward": "reward",
    "chosen_logratio": "logp", "rejected_logratio": "logp", "logratio": "logp",
    "desirable_logratio": "logp", "undesirable_logratio": "logp",
    "kl": "kl", "kl_to_ref": "kl", "approx_kl": "kl",
    "clip_frac": "ppo", "ratio_mean": "ppo", "gate_mean": "ppo",
    "value_clip_frac": "critic", "value_mean": "critic", "return_mean": "critic",
    "entropy": "policy", "logratio_mean": "logp", "target_mean": "reward",
    "kl_sampler": "rollout", "correction_weight": "rollout", "corrected_fraction": "rollout",
    "response_length": "policy", "reward": "reward",
}


# A task's metric ``NAME`` returned beside ``NAME@weight`` (per example) is a weighted mean: its per-example values are
# the example's weight times the value (a micro-batch's token mean times each example's tokens, say), and the trainer's
# mean over a step, a split or a logging window is their sum over the sum of the weights, whatever micro-batches and
# processes the step was cut into (``training.loop.means``). Other metrics are means over the examples.
METRIC_WEIGHT = "@weight"


def metric_names(values: dict[str, float], split: str) -> dict[str, float]:
    """A task's metrics (``loss`` and the rest) under their logged names, for ``split`` "train" or "eval"."""
    def name(key: str) -> str:
        if key == "loss":
            return f"loss/{split}"
        group = METRIC_GROUPS.get(key, split)
        return f"{group}/train_{key}" if split == "train" else f"{group}/{key}"

    return {name(k): v for k, v in values.items()}
