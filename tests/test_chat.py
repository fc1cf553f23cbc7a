"""Prompt validation and tokenization: one template application, one BOS, stop tokens from the model."""

import json

import pytest
from datasets import Dataset

from rlhf_pipeline.chat import (
    as_text,
    encode_conversations,
    encode_prompts,
    load_tokenizer,
    stop_token_ids,
    validate_prompts,
)
from rlhf_pipeline.errors import PipelineError


def test_prompt_column_missing_names_the_file_and_the_fix():
    ds = Dataset.from_dict({"question": ["hi"]})
    with pytest.raises(PipelineError, match=r"data.jsonl: has neither a 'prompt' nor a 'messages' column.*rename"):
        validate_prompts(ds, "data.jsonl")


@pytest.mark.parametrize(
    "column, values, match",
    [
        ("prompt", ["fine", "   "], r"row 1: 'prompt' is empty"),
        ("messages", [[{"role": "user", "content": "hi"}], []], r"row 1: 'messages' is empty"),
        (
            "messages",
            [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]],
            r"row 0: 'messages' ends with an assistant turn",
        ),
    ],
)
def test_bad_prompt_rows_are_named(column, values, match):
    with pytest.raises(PipelineError, match=match):
        validate_prompts(Dataset.from_dict({column: values}), "p.jsonl")


def test_prompt_wins_over_messages():
    ds = Dataset.from_dict({"prompt": ["q"], "messages": [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]})
    assert validate_prompts(ds, "uf") == "prompt"


def test_template_applied_once_with_a_single_bos(tiny_policy):
    tok = load_tokenizer(tiny_policy)
    (ids,) = encode_prompts(tok, ["Write a short review of the park Oak Hollow."])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")  # the generation prompt
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short review of the park Oak Hollow."}],
        add_generation_prompt=True, tokenize=False,
    )
    # The trap this avoids: re-encoding the rendered string adds the tokenizer's own BOS in front.
    assert tok(rendered)["input_ids"][:2] == [tok.bos_token_id, tok.bos_token_id]
    assert tok(rendered, add_special_tokens=False)["input_ids"] == ids


def test_messages_and_prompt_give_the_same_ids(tiny_policy):
    tok = load_tokenizer(tiny_policy)
    a = encode_prompts(tok, ["hello there"])
    b = encode_prompts(tok, [[{"role": "user", "content": "hello there"}]])
    assert a == b


def test_conversation_ends_with_the_turn_end(tiny_policy):
    tok = load_tokenizer(tiny_policy)
    (ids,) = encode_conversations(tok, ["q"], ["a fine answer"])
    assert ids[-1] == tok.eos_token_id and ids.count(tok.bos_token_id) == 1


def test_stop_tokens_include_generation_config_eos(tiny_policy, tmp_path):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_policy, model)
    tok = load_tokenizer(str(model))
    assert stop_token_ids(tok, str(model)) == [tok.eos_token_id]
    cfg = json.loads((model / "generation_config.json").read_text())
    end_of_turn = tok.convert_tokens_to_ids("<|user|>")  # stands in for Llama-3's <|eot_id|>
    cfg["eos_token_id"] = [tok.eos_token_id, end_of_turn]
    (model / "generation_config.json").write_text(json.dumps(cfg))
    assert stop_token_ids(tok, str(model)) == [tok.eos_token_id, end_of_turn]


def test_as_text():
    assert as_text("plain") == "plain"
    assert as_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == "u"
