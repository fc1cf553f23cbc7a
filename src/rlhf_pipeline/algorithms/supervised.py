"""Supervised training on (prompt, answer) token ids, shared by ``rlhf sft`` and rejection-sampling fine-tuning
(``rlhf train --algo raft`` on ``rlhf filter --mode best``).

:class:`SFTTask` is the loss: the mean negative log-likelihood of each example's answer tokens, averaged over the
examples (so batch size, accumulation and process count give the same update). :func:`sampled_rows` takes data
that already holds token ids, the prompt's ids as generation saw them and the ids the policy sampled (the
``SFT_TOKEN_COLUMNS`` contract that best mode writes), and trains on exactly those: nothing is re-rendered or
re-tokenized, so the answer ends where sampling stopped (its stop token included when it stopped on one).
"""

from __future__ import annotations

from typing import Any

from rlhf_pipeline.contracts import SFT_TOKEN_COLUMNS


def has_token_ids(ds) -> bool:
    """Whether a split holds the token-id contract (then it is trained on as is)."""
    return all(c in ds.column_names for c in SFT_TOKEN_COLUMNS)


def sampled_rows(dd, max_length: int, source: str):
    """The splits with ``answer_token_ids`` (the sampled completion) and ``num_tokens``, rows over ``max_length``
    dropped; returns the splits and the dropped counts, as ``training_stage.encode_splits`` does."""
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
        from rlhf_pipeline.logprobs import response_lengths, sequence_logps

        batch = batch.to(next(model.parameters()).device)
        nll = -sequence_logps(model, batch)  # (B,) summed over each answer's tokens
        per_example = nll / response_lengths(batch).to(nll.dtype).clamp(min=1)
        return per_example.mean(), {}, (batch.num_real_tokens, batch.num_real_tokens + batch.num_padded_tokens)
