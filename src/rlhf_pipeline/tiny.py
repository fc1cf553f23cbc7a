"""Tiny models built offline: a BPE tokenizer trained on bundled text and a small random-initialised Llama.

They go through exactly the path a Hub model does (``save_pretrained`` with safetensors, then ``from_pretrained``),
so tests and the CPU demo exercise the real code. Nothing here downloads anything.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Each turn is <|role|>content<|end|>; the generation prompt opens the assistant turn, and the model ends its
# answer with <|end|> (the EOS), exactly as chat models built on special role tokens do.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def bundled_path(name: str) -> Path:
    """Path of a file shipped in ``rlhf_pipeline/data`` (the tokenizer corpus, the bundled prompt set)."""
    return Path(str(resources.files("rlhf_pipeline") / "data" / name))


def build_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the bundled corpus, with bos/eos/pad and a chat template.

    Plain ``tokenizer(text)`` prepends BOS (as Llama's does), which is what makes a double BOS possible when a
    rendered template is re-encoded; the pipeline never does that, and the tests check it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, EOS, *ROLE_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = bundled_path("tiny_corpus.txt").read_text().splitlines()
    tok.train_from_iterator(lines, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    kind: str = "policy",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
) -> PreTrainedModel:
    """A random-initialised Llama: a causal LM (``policy``) or a 1-label sequence classifier (``reward``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if kind == "policy":
        return LlamaForCausalLM(config)
    if kind == "reward":
        config.num_labels = 1
        return LlamaForSequenceClassification(config)
    raise ValueError(f"unknown kind {kind!r}; expected 'policy' or 'reward'")


def save_tiny_model(output: str | Path, kind: str = "policy", seed: int = 0, **model_kwargs) -> Path:
    """Build and save a tiny tokenizer + model into ``output`` (safetensors), loadable with ``from_pretrained``."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, kind=kind, seed=seed, **model_kwargs)
    if kind == "policy":
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
    output = Path(output)
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    return output
