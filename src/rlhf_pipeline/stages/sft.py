"""Supervised fine-tuning: the warm start of a policy, on demonstrations, with the loss on answer tokens only.

    rlhf sft --model M --data demos.jsonl --output runs/sft
    accelerate launch --config_file accelerate_cfgs/zero3.yaml -m rlhf_pipeline.stages.sft \\
        --model meta-llama/Meta-Llama-3-8B --chat-template llama3 --data ORG/demos --output runs/sft --bf16 \\
        --learning-rate 1e-5

Rows are ``prompt``/``answer`` (ReaL's format), ``messages`` (a conversation that ends with an
assistant turn; the loss is on that last turn, the earlier turns are the prompt; ShareGPT's ``conversations`` of
``{from, value}`` turns are read as such), or token ids
(``prompt_token_ids``/``completion_token_ids``, what ``rlhf filter --mode best`` writes: rejection sampling), which
are trained on as they are (``rlhf_pipeline.algorithms.supervised``). Each row is rendered with the
model's chat template exactly as ``rlhf generate`` renders a prompt, so the policy learns the ids it will later be
fed: the prompt is the template with the generation prompt, the answer is what the template puts after it (the
answer text and the turn's end token, which is what generation stops on), up to that stop token: what a template
writes after it (ChatML's and Gemma's "\\n") is never sampled, so it is not trained on. When a template does not
render the prompt as a prefix of the whole conversation, the answer is tokenized on its own and followed by EOS;
the manifest counts those rows. The template is ``--chat-template`` when given, else the model's own (none at all is
an error; ``--chat-template none`` trains on raw prompt + answer text, and ``messages`` rows are then an error); the
saved tokenizer carries it, so every later stage renders as the policy was trained, and the manifest records it.

The loss of an example is the mean negative log-likelihood of its answer tokens, averaged over the examples of
the batch (so batch size, accumulation and process count give the same update, as in every training stage).
Rows longer than ``--max-length`` tokens are dropped and counted. Data without a ``test`` split has
``--test-size`` rows held out for the evaluation loss.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import ChatTemplateOptions, ControlTokenOptions, check_test_size, option
from rlhf_pipeline.chat import check_roles, from_sharegpt, is_sharegpt
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.algorithms.supervised import SFTTask, has_token_ids, sampled_rows
from rlhf_pipeline.training.loop import TrainOptions


@dataclass(kw_only=True)
class SFTConfig(ChatTemplateOptions, ControlTokenOptions, TrainOptions):
    """Supervised fine-tuning on prompt/answer or messages rows, with the loss on answer tokens."""

    learning_rate: float = option(1e-5, help="Peak learning rate of AdamW.")
    max_length: int = option(2048, help="Rows with more prompt + answer tokens are dropped (and counted).")
    test_size: float = option(
        0.05, help="When the data has no test split: held-out rows (a count, or a fraction below 1; 0 = none)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_length < 1:
            raise ValueError("--max-length must be at least 1")
        check_test_size(self.test_size)


def split_conversation(row: dict[str, Any], row_index: int, source: str) -> tuple[Any, str]:
    """(prompt as text or messages, answer text) of a ``prompt``/``answer`` or ``messages`` row."""
    if row.get("prompt") is not None and row.get("answer") is not None:
        prompt, answer = row["prompt"], row["answer"]
        if not isinstance(answer, str) or not answer:
            raise PipelineError(f"{source}: row {row_index}: 'answer' must be non-empty text; fix or drop the row")
        return prompt, answer
    messages, column = row.get("messages"), "messages"
    if messages is None and is_sharegpt(row.get("conversations")):
        messages, column = from_sharegpt(row["conversations"], f"{source}: row {row_index}"), "conversations"
    if isinstance(messages, list) and len(messages) >= 2:
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant" or not last.get("content"):
            raise PipelineError(
                f"{source}: row {row_index}: '{column}' must end with a non-empty assistant turn (the answer "
                "the loss is on); fix or drop the row"
            )
        check_roles(messages, f"{source}: row {row_index}")
        return list(messages[:-1]), last["content"]
    raise PipelineError(
        f"{source}: row {row_index} has neither 'prompt' and 'answer' nor 'messages' (at least a user and an "
        "assistant turn) nor ShareGPT 'conversations'; give demonstrations in one of those formats"
    )


def tokenize(dd, tokenizer, max_length: int, source: str, stop_ids: Iterable[int] = (),
             allow_special_tokens: bool = False):
    """Add ``prompt_token_ids``, ``answer_token_ids`` and ``num_tokens``; drop rows over ``max_length``."""
    counts = {"fallback": 0}

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        from rlhf_pipeline.chat import ChatTemplateRefused, encode_answers, raw_conversation_error

        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        prompts, answers = zip(*(split_conversation(r, i, source) for r, i in zip(rows, indices)))
        if not tokenizer.chat_template:  # --chat-template none: prompt/answer text only
            for prompt, i in zip(prompts, indices):
                if not isinstance(prompt, str):
                    raise raw_conversation_error(source, i)
        try:
            prompt_ids, answer_ids, fallbacks = encode_answers(tokenizer, list(prompts), list(answers), stop_ids,
                                                                 allow_special_tokens)
        except ChatTemplateRefused as e:
            raise e.at(source, indices[e.index]) from None
        counts["fallback"] += fallbacks
        return {
            "prompt_token_ids": prompt_ids,
            "answer_token_ids": answer_ids,
            "num_tokens": [len(p) + len(a) for p, a in zip(prompt_ids, answer_ids)],
        }

    from rlhf_pipeline.training.stage import encode_splits

    out, dropped = encode_splits(dd, encode, max_length)
    return out, dropped, counts["fallback"]


def _sampled_template(tokenizer, config: SFTConfig, ref):
    """The chat template the model gets when it trains on sampled token ids (``rlhf filter --mode best``): the one
    the sampling recorded by name (``--chat-template`` zephyr, a file, none), as ``rlhf train --algo raft`` gives it
    (``training.stage.adopt_data_template``), so that the next ``rlhf generate`` renders prompts as they were
    trained on; else ``--model``'s own. A ``--chat-template`` given here that does not render as the data was
    rendered is refused, with the fix."""
    from rlhf_pipeline.chat import check_same_template, use_chat_template
    from rlhf_pipeline.datasets_io import find_in_lineage
    from rlhf_pipeline.training.stage import adopt_data_template

    if config.chat_template is not None:
        template = use_chat_template(tokenizer, config.chat_template, config.model, required=False)
        record = (find_in_lineage([ref], "sampling") or {}).get("chat_template")
        check_same_template(template, record, str(ref), f"--chat-template {config.chat_template}")
        return template
    own = use_chat_template(tokenizer, None, config.model, required=False)
    return adopt_data_template(tokenizer, str(ref), config.model) or own


def main(config: SFTConfig) -> Path:
    from rlhf_pipeline.chat import load_tokenizer, pad_id, stop_token_ids, use_chat_template
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.datasets_io import parse_ref
    from rlhf_pipeline.training.stage import StageRun, TrainingJob, run_training, train_test_splits, training_summary

    check_model_ref("--model", config.model)
    ref = parse_ref(config.data)

    def read(run) -> TrainingJob:
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        dd = train_test_splits(ref, config.test_size, config.seed)
        rows_in = sum(ds.num_rows for ds in dd.values())
        if has_token_ids(dd["train"]):  # sampled token ids (rlhf filter --mode best): trained on as they are
            (data, dropped), fallbacks = sampled_rows(dd, config.max_length, str(ref)), 0
            template = _sampled_template(tokenizer, config, ref)
        else:
            # the saved tokenizer carries the template trained on, so the next stages render as this one did
            template = use_chat_template(tokenizer, config.chat_template, config.model)
            stops = stop_token_ids(tokenizer, config.model, config.trust_remote_code)
            data, dropped, fallbacks = tokenize(dd, tokenizer, config.max_length, str(ref), stops,
                                                     config.allow_special_tokens_in_text)
        if data["train"].num_rows == 0:
            raise PipelineError(f"{ref}: no training row fits in --max-length {config.max_length}; raise it")

        def task(run, setup):
            return SFTTask(pad_id(tokenizer), config.pack_ratio), data["train"], data.get("test")

        def record(run, result):
            eval_loss = result.final_eval.get("loss")
            return StageRun(
                result=result,
                rows_in=rows_in,
                dropped=dropped,
                extra={"training": {"answer_tokenized_alone": fallbacks, **training_summary(result)},
                       "chat_template": template.record()},
                summary=f"{result.steps} steps, loss {result.first_loss:.4f} -> {result.last_loss:.4f}"
                + (f", eval loss {eval_loss:.4f}" if eval_loss is not None else ""),
            )

        return TrainingJob(tokenizer, data["train"].num_rows, task, record, data=data)

    return run_training("sft", config, [ref], read)


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(SFTConfig, main, "rlhf sft", argv)


if __name__ == "__main__":
    sys.exit(cli())
