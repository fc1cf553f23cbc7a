"""The column contracts: one checker, whose message names the file, the missing columns and the fix, as the
stages' checks always have; and the two pair-column sets, which used to share the name PAIR_COLUMNS."""

import pytest
from datasets import Dataset

from rlhf_pipeline import contracts
from rlhf_pipeline.errors import PipelineError


def test_require_columns_names_the_file_the_missing_columns_and_the_fix():
    ds = Dataset.from_dict({"prompt": ["a"], "responses": [["x"]]})
    contracts.require_columns(ds, ("prompt", "responses"), "gen", "unused")  # all there: no error
    with pytest.raises(PipelineError) as e:
        contracts.require_columns(ds, contracts.SCORED_COLUMNS, "runs/gen", "filter takes the output of rlhf score")
    assert str(e.value) == "runs/gen: missing column(s) prompt_id, rewards; filter takes the output of rlhf score"


def test_score_and_filter_keep_their_messages():
    from rlhf_pipeline.stages.filter import FilterConfig, _check_input
    from rlhf_pipeline.stages.score import _check_generations

    prompts = Dataset.from_dict({"prompt": ["a"]})
    with pytest.raises(PipelineError, match=r"^p\.jsonl: missing column\(s\) prompt_id, responses; score takes "
                                            r"the output of rlhf generate$"):
        _check_generations(prompts, "p.jsonl")
    config = FilterConfig(input="x", output="y", tokenizer="t")
    with pytest.raises(PipelineError, match=r"^gen: missing column\(s\) rewards; filter takes the output of rlhf "
                                            r"score$"):
        _check_input(Dataset.from_dict({"prompt": ["a"], "prompt_id": ["0"], "responses": [["r"]]}), config, "gen",
                     None)


def test_the_two_pair_column_sets_say_what_they_hold():
    # What rlhf filter --mode pairs writes per pair, and what training on pairs reads: different sets.
    assert contracts.CHOSEN_REJECTED_COLUMNS == (
        "chosen", "rejected", "chosen_token_ids", "rejected_token_ids", "chosen_reward", "rejected_reward")
    assert contracts.PAIR_TOKEN_COLUMNS == ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids")
    assert not hasattr(contracts, "PAIR_COLUMNS")
