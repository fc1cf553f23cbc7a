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


@pytest.mark.parametrize("family", ["tiny", "llama3", "chatml", "mistral", "gemma", "no_template"])
def test_chunked_threaded_encoding_gives_transformers_own_ids(family, tmp_path):
    """``encode_texts`` renders and encodes a large batch in chunks over threads, calling the Rust encoder directly:
    the ids must be exactly what ``apply_chat_template(tokenize=True)`` (or the tokenizer itself, without a template)
    gives, for every chat format, over more conversations than one chunk, with texts that look like special tokens,
    unicode, whitespace and empty responses. A tokenizer whose backend truncates is left to transformers."""
    from rlhf_pipeline import chat
    from rlhf_pipeline.tiny import build_tokenizer

    tok = build_tokenizer(chat_format="tiny" if family == "no_template" else family)
    if family == "no_template":
        tok.chat_template = None
    texts = ["hello there", "<|eot_id|> is not a turn end here", "naïve café — ünïcode ✓", "  spaced  ", "",
             "a longer answer " * 9, "<s></s>[INST]", "\n\nnew\nlines\n"]
    n = chat.ENCODE_CHUNK * 2 + 37
    prompts = [f"prompt {i}: {texts[i % len(texts)]}" if i % 3 else
               [{"role": "user", "content": f"q{i} {texts[(i + 1) % len(texts)]}"}] for i in range(n)]
    if family == "no_template":
        prompts = [p if isinstance(p, str) else p[0]["content"] for p in prompts]
    responses = [texts[(i * 7) % len(texts)] + f" {i}" * (i % 4) for i in range(n)]
    assert chat._direct_backend(tok) is not None  # the fast path is the one under test

    if tok.chat_template:
        convs = [chat.as_messages(p) + [{"role": "assistant", "content": r}] for p, r in zip(prompts, responses)]
        expected = tok.apply_chat_template(convs, tokenize=True, return_dict=True)["input_ids"]
        expected_prompts = tok.apply_chat_template([chat.as_messages(p) for p in prompts], tokenize=True,
                                                   add_generation_prompt=True, return_dict=True)["input_ids"]
    else:
        expected = tok([chat.as_text(p) + r for p, r in zip(prompts, responses)], add_special_tokens=True)["input_ids"]
        expected_prompts = tok(prompts, add_special_tokens=True)["input_ids"]
    assert encode_conversations(tok, prompts, responses) == [list(x) for x in expected]
    assert encode_prompts(tok, prompts) == [list(x) for x in expected_prompts]

    tok.backend_tokenizer.enable_truncation(8)  # transformers turns it off for its own call: so must the fast path
    assert chat._direct_backend(tok) is None
    assert encode_conversations(tok, prompts, responses) == [list(x) for x in expected]
