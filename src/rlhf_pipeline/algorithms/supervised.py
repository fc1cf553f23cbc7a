"""The supervised family: training on (prompt, answer) token ids, shared by ``rlhf sft`` and rejection-sampling fine-tuning
(``rlhf train --algo raft`` on ``rlhf filter --mode best``).

:class:`SFTTask` is the loss: the mean negative log-likelihood of each example's answer tokens, averaged over the
examples (so batch size, accumulation and process count give the same update). :func:`sampled_rows` takes data
that already holds token ids, the prompt's ids as generation saw them and the ids the policy sampled (the
``SFT_TOKEN_COLUMNS`` contract that best mode writes), and trains on exactly those: nothing is re-rendered or
re-tokenized, so the answer ends where sampling stopped (its stop token included when it stopped on one).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rlhf_pipeline.algorithms.registry import BEST, Family, register, register_family
from rlhf_pipeline.contracts import SFT_TOKEN_COLUMNS


@dataclass(frozen=True)
class SupervisedAlgorithm:
    """Supervised fine-tuning on selected responses (``rlhf filter --mode best``: each prompt's highest-reward
    response), the mean NLL of their sampled token ids (:class:`SFTTask`): rejection-sampling fine-tuning."""

    name: str
    help: str
    demo: dict[str, Any] = field(default_factory=dict)
    filter: dict[str, Any] = field(default_factory=dict)
    data: str = BEST
    # rlhf iterate --overlap 1 trains on samples of the policy one behind: a reason why this algorithm cannot (refused
    # then), or "" (it can: the selected responses are supervised data, whoever sampled them)
    refuses_stale_sampler: str = ""
    needs_reference: ClassVar[bool] = False  # no reference pass, no rewards in the loss, no critic
    uses_rewards: ClassVar[bool] = False
    uses_critic: ClassVar[bool] = False
    logp_at_sampling_temperature: ClassVar[bool] = False


def has_token_ids(ds) -> bool:
    """Whether a split holds the token-id contract (then it is trained on as is)."""
    return all(c in ds.column_names for c in SFT_TOKEN_COLUMNS)


def sampled_rows(dd, max_length: int, source: str):
    """The splits with ``answer_token_ids`` (the sampled completion) and ``num_tokens``, rows over ``max_length``
    dropped; returns the splits and the dropped counts, as ``training.stage.encode_splits`` does."""
    from rlhf_pipeline.contracts import require_columns, require_types
    from rlhf_pipeline.training.stage import encode_splits

    for split, ds in dd.items():
        hint = "train on the output of rlhf filter --mode best (or prompt/answer text with rlhf sft)"
        require_columns(ds, SFT_TOKEN_COLUMNS, f"{source}:{split}", hint)
        require_types(ds, {c: "list of int" for c in SFT_TOKEN_COLUMNS}, f"{source}:{split}", hint)

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        for row, answer in zip(indices, batch["completion_token_ids"]):
            if not answer:
                from rlhf_pipeline.errors import PipelineError

                raise PipelineError(f"{source}: row {row}: completion_token_ids is empty; drop the row")
        return {
            "prompt_token_ids": batch["prompt_token_ids"],
            "answer_token_ids": batch["completion_token_ids"],
            "num_tokens": [len(p) + len(a) for p, a in zip(batch["prompt_token_ids"], batch["completion_token_ids"])],
        }

    return encode_splits(dd, encode, max_length)


class SFTTask:
    """Per-example mean NLL of the answer tokens, through ``logprobs.sequence_logps``."""

    def __init__(self, pad_id: int, pack_ratio: float = 0.0):
        self.pad_id, self.pack_ratio = pad_id, pack_ratio

    def lengths(self, ds) -> list[int]:
        return ds["num_tokens"]

    def collate(self, rows: list[dict[str, Any]]):
        from rlhf_pipeline.logprobs import build_batch

        return build_batch(
            [r["prompt_token_ids"] for r in rows], [r["answer_token_ids"] for r in rows], self.pad_id, self.pack_ratio
        )

    def loss(self, model, batch):
        from rlhf_pipeline.logprobs import positions_processed, response_lengths, sequence_logps

        batch = batch.to(next(model.parameters()).device)
        nll = -sequence_logps(model, batch)  # (B,) summed over each answer's tokens
        per_example = nll / response_lengths(batch).to(nll.dtype).clamp(min=1)
        return per_example.mean(), {}, (batch.num_real_tokens, positions_processed(model, batch))


def train(config) -> Path:
    """``rlhf train --algo raft``: supervised fine-tuning on each prompt's best response (``rlhf filter --mode
    best``), on its sampled token ids."""
    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.datasets_io import find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.training.stage import TrainingJob, run_training, training_record, training_summary

    check_model_ref("--model", config.model)
    ref = parse_ref(config.data)
    algo = config.algorithm

    def read(run) -> TrainingJob:
        dd = load_dataset_dict(ref, required=("train",))
        data, _ = sampled_rows(dd, max_length=sys.maxsize, source=str(ref))  # the filter applied the length limits
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)

        def task(run, setup):
            return SFTTask(pad_id(tokenizer), config.pack_ratio), data["train"], data.get("test")

        def record(run, result):
            training = {"algo": algo.name, "loss": "mean NLL of each best response's sampled tokens",
                        **training_summary(result)}
            return training_record(algo.name, result, dd, find_in_lineage([ref], "sampling"), training,
                                   config.model)

        # the ids checked as read (rows and columns as the data names them), not as renamed for the loss
        return TrainingJob(tokenizer, data["train"].num_rows, task, record, data=dd)

    return run_training("train", config, [ref], read)


register_family(Family(BEST, None, train, "each prompt's best response (rlhf filter --mode best)"))

register(SupervisedAlgorithm(
    "raft", "rejection sampling: SFT on each prompt's best of n responses (RAFT, best-of-n fine-tuning)",
    demo={"learning_rate": 3e-4}))
