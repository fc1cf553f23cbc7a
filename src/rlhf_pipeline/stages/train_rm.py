"""Train a Bradley-Terry reward model on preference pairs: loss ``-log sigmoid(r(x, y_c) - r(x, y_r))``.

    rlhf train-rm --model runs/sft --data prefs.jsonl --output runs/rm
    accelerate launch --config_file accelerate_cfgs/zero3.yaml -m rlhf_pipeline.stages.train_rm \\
        --model meta-llama/Meta-Llama-3-8B-Instruct --data ORG/prefs --output runs/rm --bf16 --learning-rate 9e-6

Rows are ``prompt``/``chosen``/``rejected`` (texts, or ``chosen``/``rejected`` as whole conversations ending in the
assistant turn), as the pairs that ``rlhf filter`` writes, or ReaL's ``prompt``/``pos_answers``/``neg_answers``
(lists paired by position: ``pos_answers[i]`` is preferred to ``neg_answers[i]``). ``prompt`` may be text or a list
of messages.

The model is ``AutoModelForSequenceClassification`` with one label, loaded from ``--model``: a causal LM (the SFT
policy, as is usual) gets a new, randomly initialised score head on its decoder; a reward model continues training.
Conversations are rendered with its chat template (``--chat-template``, else the model's own; the saved tokenizer
carries it) and read exactly as ``rlhf score`` reads them (right-padded, the reward taken at the last real token),
and the result is saved with ``save_pretrained`` so that ``AutoModelForSequenceClassification.from_pretrained`` and
``rlhf score --reward-model`` load it. The evaluation
reports the loss and the accuracy (the share of held-out pairs where the chosen response scores higher), before
the first update and at the end. Pairs longer than ``--max-length`` tokens are dropped and counted, and so are pairs
whose chosen and rejected conversations are the same tokens (no preference to learn).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import ChatTemplateOptions, ControlTokenOptions, check_test_size, option
from rlhf_pipeline.chat import check_roles
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.modeling import SAFE_WEIGHTS
from rlhf_pipeline.training.loop import TrainOptions

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainRMConfig(ChatTemplateOptions, ControlTokenOptions, TrainOptions):
    """Train a Bradley-Terry reward model on chosen/rejected pairs."""

    learning_rate: float = option(1e-5, help="Peak learning rate of AdamW.")
    max_length: int = option(2048, help="Pairs whose chosen or rejected conversation has more tokens are dropped.")
    test_size: float = option(
        0.05, help="When the data has no test split: held-out pairs (a count, or a fraction below 1; 0 = none)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_length < 1:
            raise ValueError("--max-length must be at least 1")
        check_test_size(self.test_size)


def expand_pairs(row: dict[str, Any], row_index: int, source: str) -> list[tuple[Any, Any, Any]]:
    """The (prompt, chosen, rejected) pairs of one row, in either supported format. The prompt is the ``prompt``
    column, else ``messages`` (rlhf filter's pairs carry the prompt column the prompts had)."""
    prompt = row.get("prompt")
    messages = row.get("messages")
    if prompt is None and isinstance(messages, list) and not (messages and isinstance(messages[-1], dict)
                                                               and messages[-1].get("role") == "assistant"):
        prompt = messages  # a conversation up to the answer (a whole one, ending with its answer, is not a prompt)
    if "pos_answers" in row or "neg_answers" in row:
        pos, neg = row.get("pos_answers"), row.get("neg_answers")
        if not isinstance(pos, list) or not isinstance(neg, list) or len(pos) != len(neg) or not pos:
            raise PipelineError(
                f"{source}: row {row_index}: 'pos_answers' and 'neg_answers' must be non-empty lists of the same "
                "length (pos_answers[i] is preferred to neg_answers[i])"
            )
        return [(prompt, c, r) for c, r in zip(pos, neg)]
    if row.get("chosen") is None or row.get("rejected") is None:
        raise PipelineError(
            f"{source}: row {row_index} has no 'chosen'/'rejected' (or 'pos_answers'/'neg_answers'); give preference "
            "pairs in one of those formats"
        )
    return [(prompt, row["chosen"], row["rejected"])]


def conversation(prompt: Any, response: Any, row_index: int, source: str) -> tuple[Any, str]:
    """(prompt as text or messages, response text) from a text response or a whole conversation."""
    for turns in (prompt, response):
        if isinstance(turns, list):
            check_roles(turns, f"{source}: row {row_index}")
    if isinstance(response, str):
        if prompt is None:
            raise PipelineError(f"{source}: row {row_index}: text responses need a 'prompt' (or 'messages') column")
        return prompt, response
    if isinstance(response, list) and response and isinstance(response[-1], dict) \
            and response[-1].get("role") == "assistant":
        context = list(response[:-1])
        if context:  # a whole conversation (Anthropic HH style): it carries its own prompt
            return context, response[-1].get("content", "")
        if prompt is None:
            raise PipelineError(f"{source}: row {row_index}: a lone assistant turn needs a 'prompt' (or 'messages') "
                                "column")
        return prompt, response[-1].get("content", "")
    raise PipelineError(
        f"{source}: row {row_index}: a response must be text or a list of messages ending with an assistant turn"
    )


def tokenize(dd, tokenizer, max_length: int, source: str, allow_special_tokens: bool = False):
    """Each split as ``chosen_input_ids`` / ``rejected_input_ids`` conversations; over-long pairs dropped, and pairs
    whose two conversations are the same tokens (``{split}:identical``): they carry no preference (their loss is log 2
    whatever the model, with no gradient), and each would count as a wrong answer in the eval accuracy."""
    from rlhf_pipeline.chat import ChatTemplateRefused, encode_conversations, raw_conversation_error

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        prompts, chosen, rejected, of_row = [], [], [], []
        for row, i in zip(rows, indices):
            for prompt, c, r in expand_pairs(row, i, source):
                of_row += [i, i]
                p_c, t_c = conversation(prompt, c, i, source)
                p_r, t_r = conversation(prompt, r, i, source)
                if not tokenizer.chat_template and not (isinstance(p_c, str) and isinstance(p_r, str)):
                    raise raw_conversation_error(source, i)  # --chat-template none: text only
                prompts += [p_c, p_r]
                chosen.append(t_c)
                rejected.append(t_r)
        texts = [t for pair in zip(chosen, rejected) for t in pair]
        try:
            ids = encode_conversations(tokenizer, prompts, texts, allow_special_tokens=allow_special_tokens)
        except ChatTemplateRefused as e:
            raise e.at(source, of_row[e.index]) from None
        return {"chosen_input_ids": ids[0::2], "rejected_input_ids": ids[1::2],
                "num_tokens": [max(len(c), len(r)) for c, r in zip(ids[0::2], ids[1::2])]}

    from rlhf_pipeline.training.stage import encode_splits

    out, dropped = encode_splits(dd, encode, max_length)
    for split, ds in out.items():
        kept = ds.filter(lambda c, r: c != r, input_columns=["chosen_input_ids", "rejected_input_ids"],
                         desc=f"identical pairs of {split}")
        if kept.num_rows < ds.num_rows:
            dropped[f"{split}:identical"] = ds.num_rows - kept.num_rows
            out[split] = kept
    return out, dropped


class RewardTask:
    """Chosen and rejected of a micro-batch in one forward of the sequence classifier."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def lengths(self, ds) -> list[int]:
        return [len(c) + len(r) for c, r in zip(ds["chosen_input_ids"], ds["rejected_input_ids"])]

    def collate(self, rows: list[dict[str, Any]]):
        from rlhf_pipeline.rewards import pad_right

        return pad_right([r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows], self.pad_id)

    def loss(self, model, batch):
        import torch.nn.functional as F

        from rlhf_pipeline.rewards import reward_from_output

        input_ids, attention_mask = batch
        device = next(model.parameters()).device
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
        rewards = reward_from_output(out).float()
        half = input_ids.shape[0] // 2
        chosen, rejected = rewards[:half], rewards[half:]
        losses = -F.logsigmoid(chosen - rejected)
        metrics = {
            "accuracy": (chosen > rejected).float().detach(),
            "margin": (chosen - rejected).detach(),
            "chosen_reward": chosen.detach(),
            "rejected_reward": rejected.detach(),
        }
        real = int(attention_mask.sum())
        return losses.mean(), metrics, (real, attention_mask.numel())


class NoLoadReport(logging.Filter):
    """Holds back transformers' load report (``<class> LOAD REPORT from: <path>`` and its table), in ``held``."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.held.append(record)
            return False
        return True


def load_reward_model_for_training(path: str, trust_remote_code: bool = False, **kwargs):
    """``path`` as a one-label sequence classifier. From a causal LM its LM head is left out and the reward head is
    new, as always: transformers' load report of that (a table per process, ending "Consider training on your
    downstream task") is not shown. Anything else it would report, weights of the body missing or left out, is a
    warning that names them; where loading fails (mismatched sizes), the report its error points to is shown."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers.modeling_utils")
    no_report = NoLoadReport()  # a filter, not a level: transformers reads its logger's level for other warnings
    logger.addFilter(no_report)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, trust_remote_code=trust_remote_code, output_loading_info=True, **kwargs,
            **SAFE_WEIGHTS)
    except Exception:
        logger.removeFilter(no_report)
        for record in no_report.held:  # "For details look at the above report!"
            logger.handle(record)
        raise
    finally:
        logger.removeFilter(no_report)
    body = f"{model.base_model_prefix}."
    missing = sorted(k for k in info["missing_keys"] if k.startswith(body))
    left_out = sorted(k for k in info["unexpected_keys"] if not k.startswith("lm_head."))
    for what, keys in (("missing from it, so initialised at random", missing), ("in it but not used", left_out)):
        if keys:
            log.warning("%s: %d weight%s of the model %s: %s", path, len(keys), "s" if len(keys) != 1 else "",
                        what, ", ".join(keys[:8]) + (", ..." if len(keys) > 8 else ""))
    return model


def main(config: TrainRMConfig) -> Path:
    from rlhf_pipeline.chat import load_tokenizer, pad_id, use_chat_template
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.datasets_io import parse_ref
    from rlhf_pipeline.rewards import prepare_reward_model
    from rlhf_pipeline.training.stage import StageRun, TrainingJob, run_training, train_test_splits, training_summary

    check_model_ref("--model", config.model)
    ref = parse_ref(config.data)

    def read(run) -> TrainingJob:
        tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        # the saved tokenizer carries the template trained on, so rlhf score renders as this stage did
        template = use_chat_template(tokenizer, config.chat_template, config.model)
        dd = train_test_splits(ref, config.test_size, config.seed)
        rows_in = sum(ds.num_rows for ds in dd.values())
        data, dropped = tokenize(dd, tokenizer, config.max_length, str(ref),
                                 config.allow_special_tokens_in_text)
        if data["train"].num_rows == 0:
            if dropped.get("train:identical") and not dropped.get("train:too_long"):
                raise PipelineError(f"{ref}: every training pair has the same chosen and rejected conversation; "
                                    "check which columns hold them (chosen, rejected)")
            raise PipelineError(f"{ref}: no training pair fits in --max-length {config.max_length}; raise it")
        pad = pad_id(tokenizer)
        reward_task = RewardTask(pad)

        def ready(model) -> None:  # batches padded with the model's own pad id, which its pooling skips
            reward_task.pad_id = prepare_reward_model(model, pad)

        def task(run, setup):
            return reward_task, data["train"], data.get("test")

        def record(run, result):
            accuracy = result.final_eval.get("accuracy")
            return StageRun(
                result=result,
                rows_in=rows_in,
                dropped=dropped,
                extra={"training": {"pairs": {split: ds.num_rows for split, ds in data.items()},
                                    **training_summary(result)},
                       "chat_template": template.record()},
                summary=f"{result.steps} steps, loss {result.first_loss:.4f} -> {result.last_loss:.4f}"
                + (f", eval accuracy {accuracy:.3f}" if accuracy is not None else ""),
            )

        return TrainingJob(tokenizer, data["train"].num_rows, task, record, loader=load_reward_model_for_training,
                           model_ready=ready)

    return run_training("train-rm", config, [ref], read)


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(TrainRMConfig, main, "rlhf train-rm", argv)


if __name__ == "__main__":
    sys.exit(cli())
