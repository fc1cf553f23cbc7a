"""The column contracts between stages (docs/stages.md, "Data contracts"), each named once, and the one check of them.

A stage that reads a dataset calls :func:`require_columns` with the columns it needs, and :func:`require_types` with
what they hold (read from the features, no row decoded); the error names the file, the columns and the fix. Extra
columns are always allowed: stages carry them through.

- prompts: one of ``PROMPT_COLUMNS``; read by generate and eval (``chat.prompt_column``).
- generations: the prompt columns, ``prompt_id`` and ``GENERATED_COLUMNS``; written by generate and merge, read by
  score, which needs ``GENERATIONS_COLUMNS``.
- scored: generations + ``rewards``; written by score, read by filter, which needs ``SCORED_COLUMNS``. Scored with
  several reward sources it also holds each source's raw rewards, ``rewards_<key>`` (``SOURCE_REWARDS_PREFIX``; one
  float per response, like ``rewards``), which later stages carry as extra columns and never train on.
- pairs: ``prompt_id``, ``prompt_token_ids`` and ``CHOSEN_REJECTED_COLUMNS``; written by filter --mode pairs, read
  by ref-logps and train, which need ``PAIR_TOKEN_COLUMNS``.
- reference log-probs: pairs + ``REF_LOGP_COLUMNS``; written by ref-logps (or train itself), read by train.
- groups: ``prompt_id``, ``prompt_token_ids`` and ``PER_RESPONSE_COLUMNS``; written by filter --mode groups, read by
  train (PPO family), which needs ``GROUP_COLUMNS``.
- unpaired: ``prompt_id``, ``prompt_token_ids``, ``response_index`` and ``UNPAIRED_COLUMNS``, one row per labelled
  response; written by filter --mode unpaired, read by ref-logps and train (KTO), which need
  ``UNPAIRED_TOKEN_COLUMNS``; ref-logps adds ``UNPAIRED_REF_LOGP_COLUMNS``.
- best responses: ``prompt_id``, ``prompt_token_ids``, ``completion``, ``completion_token_ids``, ``reward``,
  ``finish_reason``, one row per prompt (its best response); written by filter --mode best, read by sft and train
  --algo raft, which need ``SFT_TOKEN_COLUMNS``.
- SFT rows: ``prompt``/``answer``, or ``messages`` (or ShareGPT's ``conversations``) ending with the assistant turn
  the loss is on; read by sft.
- reward-model pairs: ``chosen``/``rejected`` (texts, or conversations ending with the assistant turn) with a
  ``prompt``, or ReaL's ``pos_answers``/``neg_answers`` lists; read by train-rm.

SFT rows and reward-model pairs are checked row by row (``sft.split_conversation``, ``train_rm.expand_pairs``),
not by columns: a JSON file may mix the formats, so each row is in one format or the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from rlhf_pipeline.errors import PipelineError

if TYPE_CHECKING:
    from datasets import Dataset

# The kinds of training data rlhf filter makes (its --mode choices), which the algorithm families train on
# (algorithms.registry): preference pairs, groups of all n responses, unpaired labelled responses (KTO) and each
# prompt's best response (rejection sampling).
PAIRS, GROUPS, UNPAIRED, BEST = "pairs", "groups", "unpaired", "best"
TRAINING_DATA_KINDS = (PAIRS, GROUPS, UNPAIRED, BEST)

# Prompts: a ``prompt`` string or a ``messages`` list of {role, content}; ``prompt`` wins when both are present.
PROMPT_COLUMNS = ("prompt", "messages")

# What rlhf generate adds to the prompt columns (besides ``prompt_id``); a prompt dataset must not have them.
GENERATED_COLUMNS = ("prompt_token_ids", "responses", "response_token_ids", "finish_reasons", "response_logprobs")
# What rlhf score needs of generations (token ids and finish reasons are optional for data made elsewhere).
GENERATIONS_COLUMNS = ("prompt_id", "responses")
# What rlhf filter needs of scored generations.
SCORED_COLUMNS = ("prompt_id", "responses", "rewards")
# What the per-response columns of scored generations hold (checked where present).
SCORED_KINDS = {"responses": "list of text", "rewards": "list of number", "prompt_token_ids": "list of int",
                "response_token_ids": "list of list of int", "finish_reasons": "list of text",
                "response_logprobs": "list of list of number"}
# Each reward source's own rewards, when rlhf score combines several: ``rewards_<key>`` (stages.score.reward_sources).
SOURCE_REWARDS_PREFIX = "rewards_"
# Scored columns that hold one entry per response (n per prompt): pairs mode replaces them, groups mode keeps them.
PER_RESPONSE_COLUMNS = ("responses", "response_token_ids", "rewards", "finish_reasons")
# The sampler's log-prob of each sampled token, as it drew it (after temperature, top-k and top-p: the manifest's
# ``sampling`` says which), one list per response; rlhf generate writes it, score keeps it, filter carries it to
# each response it keeps under the names below. Optional: data without it trains, without rollout correction.
SAMPLER_LOGPROBS = "response_logprobs"
SAMPLER_LOGPROBS_OUT = {PAIRS: ("chosen_logprobs", "rejected_logprobs"), UNPAIRED: ("completion_logprobs",),
                        BEST: ("completion_logprobs",), GROUPS: (SAMPLER_LOGPROBS,)}

# The chosen and rejected response of each pair as rlhf filter --mode pairs writes them: text, token ids, reward.
CHOSEN_REJECTED_COLUMNS = (
    "chosen", "rejected", "chosen_token_ids", "rejected_token_ids", "chosen_reward", "rejected_reward"
)
# The token ids that training on pairs (and the reference pass) reads.
PAIR_TOKEN_COLUMNS = ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids")
# Sequence log-probs of chosen and rejected under the sampling policy, added by rlhf ref-logps.
REF_LOGP_COLUMNS = ("chosen_ref_logp", "rejected_ref_logp")

# What the PPO family trains on (rlhf filter --mode groups): every response of a prompt, with its reward.
GROUP_COLUMNS = ("prompt_token_ids", "response_token_ids", "rewards")

# What supervised training reads as token ids (rlhf filter --mode best writes it: each prompt's best response):
# trained on as they are, nothing re-rendered (rlhf sft, rlhf train --algo raft).
SFT_TOKEN_COLUMNS = ("prompt_token_ids", "completion_token_ids")

# What KTO trains on (rlhf filter --mode unpaired): one row per labelled response, its text, token ids, reward, label
# (``desirable``: above the prompt's mean reward) and, for KTO's reference point, the mismatched response (the
# completion of a row of another prompt, ``kl_prompt_id``'s) that is scored after this row's prompt.
UNPAIRED_COLUMNS = (
    "completion", "completion_token_ids", "reward", "desirable", "kl_completion_token_ids", "kl_prompt_id"
)
# The token ids and label that training on unpaired responses (and its reference pass) reads.
UNPAIRED_TOKEN_COLUMNS = ("prompt_token_ids", "completion_token_ids", "kl_completion_token_ids", "desirable")
# Sequence log-probs of the completion and of the mismatched pair under the reference, added by rlhf ref-logps.
UNPAIRED_REF_LOGP_COLUMNS = ("completion_ref_logp", "kl_ref_logp")


def require_columns(ds: Dataset, columns: Sequence[str], source: str, hint: str) -> None:
    """Raise a PipelineError naming ``source`` and the missing columns when ``ds`` lacks any of ``columns``.

    ``hint`` says what to pass instead, e.g. "score takes the output of rlhf generate".
    """
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise PipelineError(f"{source}: missing column(s) {', '.join(missing)}; {hint}")


def require_types(ds: Dataset, kinds: dict[str, str], source: str, hint: str) -> None:
    """Raise a PipelineError naming ``source``, the column and both kinds when a present column of ``ds`` holds
    values of another kind than ``kinds`` says: ``text``, ``int``, ``number`` (int or float), and ``list of ...``
    of those (``list of list of int``). Read from the dataset's features, so no row is decoded."""
    for column, expected in kinds.items():
        if column in ds.column_names:
            found = feature_kind(ds.features[column])
            if not _kind_matches(found, expected):
                raise PipelineError(f"{source}: column '{column}' holds {found}, not {expected}; {hint}")


def require_token_ids(ds: Dataset, vocab_size: int, source: str, hint: str, owner: str = "this model") -> None:
    """Raise a PipelineError naming ``source``, the row, the column and the id when a token id of ``ds`` (every column
    whose name ends in ``token_ids``, nested lists included) is negative or not below ``vocab_size``, the number of
    ids of ``owner`` (a model, or a tokenizer): such an id would index past the model's embedding, a traceback on a CPU and a device-side assert on a GPU. Read with
    Arrow's min and max, so no row is decoded unless one is out of range."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for column in (c for c in ds.column_names if c.endswith("token_ids")):
        values = ds.with_format("arrow")[column]
        while pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
            values = pc.list_flatten(values)
        if not pa.types.is_integer(values.type) or len(values) == 0:
            continue  # require_types names a column of another kind
        low, high = (x.as_py() for x in pc.min_max(values).values())
        if low is None or (low >= 0 and high < vocab_size):
            continue
        for row, ids in enumerate(ds[column]):
            flat = [t for part in ids or [] for t in (part if isinstance(part, list) else [part])]
            bad = next((t for t in flat if t is not None and not 0 <= t < vocab_size), None)
            if bad is not None:
                raise PipelineError(f"{source}: row {row}: {column} holds token id {bad}, outside the {vocab_size} "
                                    f"ids of {owner}; {hint}")


def check_prompt_ids(ds: Dataset, source: str, column: str) -> None:
    """A dataset's own prompt ids (``prompt_id``, else ``id``) name one prompt each (``column``, its prompt column):
    later stages match responses, rewards, an evaluation's baseline and the train/test split by them, so two
    different prompts under one id would be compared across, and rows of different prompts kept on one side. One
    prompt given twice under its id (a content hash, as ids made from the text are) is the same prompt, and passes.
    A null id is refused, naming the row."""
    name = next((c for c in ("prompt_id", "id") if c in ds.column_names), None)
    if name is None:
        return
    first: dict[str, tuple[int, object]] = {}
    for row, (value, prompt) in enumerate(zip(ds[name], ds[column])):
        if value is None:
            raise PipelineError(f"{source}: row {row} has no {name} (null); give every prompt one (responses, rewards, "
                                "baselines and the train/test split are matched by it)")
        earlier, earlier_prompt = first.setdefault(str(value), (row, prompt))
        if earlier != row and earlier_prompt != prompt:
            raise PipelineError(f"{source}: rows {earlier} and {row} have the same {name} {str(value)!r} but other "
                                "prompts; give every prompt its own (responses, rewards, baselines and the train/test "
                                "split are matched by it)")


def feature_kind(feature) -> str:
    """A ``datasets`` feature in words: ``text``, ``int``, ``float``, ``bool``, ``list of ...``, ``mapping``."""
    from datasets import LargeList, List, Value

    if isinstance(feature, (List, LargeList)):
        return "list of " + feature_kind(feature.feature)
    if isinstance(feature, dict):
        return "mapping"
    if isinstance(feature, Value):
        dtype = feature.dtype
        if dtype in ("string", "large_string"):
            return "text"
        if dtype.startswith(("int", "uint")):
            return "int"
        if dtype.startswith("float") or dtype == "double":
            return "float"
        return dtype  # bool, null (a column or list with no values), timestamps, ...
    return type(feature).__name__


def _kind_matches(found: str, expected: str) -> bool:
    *found_lists, found_leaf = found.split("list of ")
    *expected_lists, expected_leaf = expected.split("list of ")
    if found_leaf == "null":  # empty lists: no values to disagree with, as deep as they go
        return len(found_lists) <= len(expected_lists)
    if len(found_lists) != len(expected_lists):
        return False
    return found_leaf == expected_leaf or (expected_leaf == "number" and found_leaf in ("int", "float"))
