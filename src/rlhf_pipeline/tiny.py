"""Tiny models built offline: a BPE tokenizer trained on bundled text and a small random-initialised Llama.

They go through exactly the path a Hub model does (``save_pretrained`` with safetensors, then ``from_pretrained``),
so tests and the CPU demo exercise the real code. Nothing here downloads anything.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

from rlhf_pipeline.chat_templates import CHATML, LLAMA3
from rlhf_pipeline.compat import allow_legacy_remote_code

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

TINY_HEAD_DIM = 32  # the smallest head size vLLM's CPU attention accepts (its supported sizes start at 32)
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


@dataclass(frozen=True)
class ChatFormat:
    """A chat-template family for the tiny kit: its special tokens, which of them the tokenizer calls bos/eos/pad,
    its chat template, and the ids its generation config stops on, as the family's instruct models ship them.

    The templates are written from each family's published format (not copied from a model repo), so the tiny
    tokenizers render the same token layout the real ones do; only the vocabulary between the special tokens is
    the tiny kit's own BPE.
    """

    bos: Optional[str]  # prepended by the template and by plain ``tokenizer(text)``; None: the family has no BOS
    eos: str  # the tokenizer's eos_token
    pad: Optional[str]  # the tokenizer's pad_token; None: the family ships none (the pipeline pads with EOS)
    end_of_turn: str  # what closes an assistant turn in the template: the token sampling must stop on
    specials: tuple[str, ...]  # the other special tokens (roles, headers, turn markers)
    template: Optional[str]  # the Jinja chat template; None: a base model's tokenizer, which has none
    generation_eos: tuple[str, ...]  # generation_config.json's eos_token_id (an int when one, a list when more)

    def special_tokens(self) -> list[str]:
        """Every special token once: pad, bos, eos first (the BPE trainer gives them the lowest ids), then the rest."""
        named = [t for t in (self.pad, self.bos, self.eos) if t is not None]
        return list(dict.fromkeys(named + list(self.specials)))


CHAT_FORMATS: dict[str, ChatFormat] = {
    # The tiny kit's own format (the default): <|role|>content<|end|> turns after one BOS.
    "tiny": ChatFormat(
        bos=BOS, eos=EOS, pad=PAD, end_of_turn=EOS, specials=tuple(ROLE_TOKENS), template=CHAT_TEMPLATE,
        generation_eos=(EOS,),
    ),
    # Llama-3 Instruct: <|begin_of_text|> once, then <|start_header_id|>role<|end_header_id|>\n\n content<|eot_id|>
    # (content trimmed). The tokenizer's EOS is <|end_of_text|> (as Meta-Llama-3-8B-Instruct first shipped it), so
    # the turn end <|eot_id|> is a stop token only through generation_config.json's [end_of_text, eot_id]. No pad.
    "llama3": ChatFormat(
        bos="<|begin_of_text|>", eos="<|end_of_text|>", pad=None, end_of_turn="<|eot_id|>",
        specials=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        template=LLAMA3,
        generation_eos=("<|end_of_text|>", "<|eot_id|>"),
    ),
    # ChatML (Qwen2/2.5 Instruct): <|im_start|>role\ncontent<|im_end|>\n, no BOS; <|im_end|> is the EOS and ends a
    # turn, <|endoftext|> pads; the generation config stops on both. The "\n" after <|im_end|> is the template's.
    "chatml": ChatFormat(
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", end_of_turn="<|im_end|>", specials=("<|im_start|>",),
        template=CHATML,
        generation_eos=("<|im_end|>", "<|endoftext|>"),
    ),
    # Mistral Instruct: <s>[INST] user [/INST] answer</s>[INST] ... ; [INST]/[/INST] are control tokens (v0.3), the
    # system prompt is folded into the first user turn, roles must alternate; </s> ends a turn. No pad.
    "mistral": ChatFormat(
        bos="<s>", eos="</s>", pad=None, end_of_turn="</s>", specials=("[INST]", "[/INST]"),
        template=(
            "{% if messages[0]['role'] == 'system' %}"
            "{% set system_message = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
            "{% else %}{% set loop_messages = messages %}{% endif %}"
            "{{ bos_token }}"
            "{% for message in loop_messages %}"
            "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('After the optional system message, roles must alternate user/assistant') }}"
            "{% endif %}"
            "{% if message['role'] == 'user' %}"
            "{% if loop.first and system_message is defined %}"
            "{{ '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
            "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
            "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
            "{% endfor %}"
        ),
        generation_eos=("</s>",),
    ),
    # Gemma Instruct: <bos><start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n; the assistant role is
    # written "model", the system prompt is folded into the first user turn (as Gemma 3's template does), content is
    # trimmed, roles alternate. The tokenizer's EOS is <eos>; <end_of_turn> stops through the generation config.
    "gemma": ChatFormat(
        bos="<bos>", eos="<eos>", pad="<pad>", end_of_turn="<end_of_turn>",
        specials=("<start_of_turn>", "<end_of_turn>"),
        template=(
            "{{ bos_token }}"
            "{% if messages[0]['role'] == 'system' %}"
            "{% set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' %}"
            "{% set loop_messages = messages[1:] %}"
            "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
            "{% for message in loop_messages %}"
            "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('After the optional system message, roles must alternate user/assistant') }}"
            "{% endif %}"
            "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
            "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '')"
            " + message['content'] | trim + '<end_of_turn>\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
        ),
        generation_eos=("<eos>", "<end_of_turn>"),
    ),
    # A base model: the kit's own tokens and no chat template, as a pretrained-only checkpoint ships (the stages
    # that render conversations then need --chat-template: chat.use_chat_template).
    "base": ChatFormat(
        bos=BOS, eos=EOS, pad=PAD, end_of_turn=EOS, specials=tuple(ROLE_TOKENS), template=None, generation_eos=(EOS,),
    ),
}
ChatFormatName = Literal[tuple(CHAT_FORMATS)]  # type: ignore[valid-type]  # the CLI's choices, from the table


def bundled_path(name: str) -> Path:
    """Path of a file shipped in ``rlhf_pipeline/data`` (the tokenizer corpus, the bundled prompt set)."""
    return Path(str(resources.files("rlhf_pipeline") / "data" / name))


def chat_format_spec(name: str) -> ChatFormat:
    """The family called ``name`` in :data:`CHAT_FORMATS`, or an error that lists them."""
    if name not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {name!r}; expected one of {', '.join(CHAT_FORMATS)}")
    return CHAT_FORMATS[name]


def build_tokenizer(vocab_size: int = 1024, chat_format: str = "tiny") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the bundled corpus, with the special tokens and chat template of
    ``chat_format`` (see :data:`CHAT_FORMATS`; ``tiny`` is the kit's own).

    Plain ``tokenizer(text)`` prepends BOS where the family has one (as Llama's, Mistral's and Gemma's do), which is
    what makes a double BOS possible when a rendered template is re-encoded; the pipeline never does that, and the
    tests check it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    fmt = chat_format_spec(chat_format)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = fmt.special_tokens()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = bundled_path("tiny_corpus.txt").read_text().splitlines()
    tok.train_from_iterator(lines, trainer)
    if fmt.bos is not None:
        bos_id = tok.token_to_id(fmt.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fmt.bos} $A", pair=f"{fmt.bos} $A {fmt.bos} $B", special_tokens=[(fmt.bos, bos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=fmt.bos,
        eos_token=fmt.eos,
        pad_token=fmt.pad,
        additional_special_tokens=[t for t in specials if t not in (fmt.bos, fmt.eos, fmt.pad)],
        model_max_length=2048,
    )
    fast.chat_template = fmt.template
    return fast


def _llama_config_kwargs(tokenizer: PreTrainedTokenizerFast, hidden_size: int, num_layers: int) -> dict:
    """The tiny Llama's configuration. Heads are 32 wide (``hidden_size // 32`` query heads, half as many KV heads):
    vLLM's CPU attention kernel takes head sizes of 32 and up only, and 32 keeps the projections as small as the
    hidden size allows, so the same tiny model runs on both engines."""
    if hidden_size % TINY_HEAD_DIM:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of the tiny kit's head size {TINY_HEAD_DIM}")
    heads = hidden_size // TINY_HEAD_DIM
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    kind: str = "policy",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
) -> PreTrainedModel:
    """A random-initialised Llama (:func:`_llama_config_kwargs`): a causal LM (``policy``) or a 1-label sequence
    classifier (``reward``). The ``armo`` kind is remote code, built by :func:`save_tiny_model` alone."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(**_llama_config_kwargs(tokenizer, hidden_size, num_layers))
    torch.manual_seed(seed)
    if kind == "policy":
        return LlamaForCausalLM(config)
    if kind == "reward":
        config.num_labels = 1
        return LlamaForSequenceClassification(config)
    raise ValueError(f"unknown kind {kind!r}; expected 'policy' or 'reward'")


# What the tiny kit builds: a causal LM, a sequence classifier, or a reward model that ships its own code (ArmoRM's
# layout: see save_tiny_armo_model).
KINDS = ("policy", "reward", "armo")
TinyKind = Literal[KINDS]  # type: ignore[valid-type]  # the CLI's choices, from the table
ARMO_CODE = "modeling_tiny_armo.py"  # the remote code, a file of rlhf_pipeline/data copied into the model directory
ARMO_OBJECTIVES = 4


def save_tiny_model(
    output: str | Path, kind: str = "policy", seed: int = 0, chat_format: str = "tiny", **model_kwargs
) -> Path:
    """Build and save a tiny tokenizer + model into ``output`` (safetensors), loadable with ``from_pretrained``.

    ``chat_format`` picks the tokenizer's family (:data:`CHAT_FORMATS`). A policy's ``generation_config.json`` names
    the family's stop tokens as its real models do: one id as an int, several as a list (Llama-3:
    ``[<|end_of_text|>, <|eot_id|>]``). ``kind="armo"`` writes :func:`save_tiny_armo_model`'s remote-code model.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    tokenizer = build_tokenizer(chat_format=chat_format)
    output = Path(output)
    if kind == "armo":
        model = _build_armo(tokenizer, seed=seed, **model_kwargs)
    else:
        model = build_model(tokenizer, kind=kind, seed=seed, **model_kwargs)
    if kind == "policy":
        stops = [tokenizer.convert_tokens_to_ids(t) for t in chat_format_spec(chat_format).generation_eos]
        model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(output, safe_serialization=True)
    if kind == "armo":
        shutil.copyfile(bundled_path(ARMO_CODE), output / ARMO_CODE)
    tokenizer.save_pretrained(output)
    return output


def save_tiny_armo_model(output: str | Path, seed: int = 0, chat_format: str = "tiny", **model_kwargs) -> Path:
    """A tiny reward model laid out as ArmoRM is: remote code (``modeling_tiny_armo.py``, named in ``config.json``'s
    ``auto_map`` for ``AutoConfig`` and ``AutoModelForSequenceClassification``, with a ``model_type`` of its own) that
    transformers runs only with ``trust_remote_code=True``; a Llama body, a regression layer to
    :data:`ARMO_OBJECTIVES` objectives, a gating network over the hidden state of the token that opens the answer,
    and an output with ``rewards``, ``gating_output`` and ``score`` (the gated sum, one per sequence; no ``logits``).
    Seeded and offline like every tiny model."""
    return save_tiny_model(output, kind="armo", seed=seed, chat_format=chat_format, **model_kwargs)


def _build_armo(tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden_size: int = 64, num_layers: int = 2):
    """The model of :func:`save_tiny_armo_model`, made from the bundled file by this process (the kit's own code, so
    nothing of a model directory runs here). The gating token is the last special token of the chat template's
    generation prompt: the one that opens the assistant turn (``<|assistant|>``, Llama-3's ``<|end_header_id|>``)."""
    import importlib.util

    import torch

    allow_legacy_remote_code()  # the file imports a name of transformers 4, as ArmoRM's code does
    spec = importlib.util.spec_from_file_location("rlhf_tiny_armo", bundled_path(ARMO_CODE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    special = set(tokenizer.all_special_ids)
    gating_token = next(t for t in reversed(prompt) if t in special)
    name = module.TinyArmoForRewardModel.__name__
    config = module.TinyArmoConfig(
        **_llama_config_kwargs(tokenizer, hidden_size, num_layers),
        num_labels=1,
        num_objectives=ARMO_OBJECTIVES,
        gating_hidden_dim=hidden_size,
        gating_temperature=1.0,
        gating_token_id=gating_token,
        auto_map={"AutoConfig": f"{Path(ARMO_CODE).stem}.{module.TinyArmoConfig.__name__}",
                  "AutoModelForSequenceClassification": f"{Path(ARMO_CODE).stem}.{name}"},
    )
    torch.manual_seed(seed)
    model = module.TinyArmoForRewardModel(config)
    model.config.architectures = [name]
    return model
