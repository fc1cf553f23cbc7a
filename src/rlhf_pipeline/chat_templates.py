"""The built-in chat templates that ``--chat-template NAME`` names: Jinja text, nothing else.

Each is written from its family's published turn layout (not copied from a model repository), in the form
``tokenizer.chat_template`` takes: the messages in ``messages``, ``add_generation_prompt``, and the tokenizer's
``bos_token``/``eos_token``. The markup strings (``<|im_start|>``, ``<|eot_id|>``) are encoded as the tokenizer
encodes them: one control token each where the tokenizer has them as special tokens (a model of that family),
plain text otherwise (a base model fine-tuned onto the layout with ``rlhf sft --chat-template``).
The tiny kit's families of the same name (``tiny.CHAT_FORMATS``) use these same texts.
"""

from __future__ import annotations

# ChatML (Qwen2/2.5 Instruct and many fine-tunes): <|im_start|>role\ncontent<|im_end|>\n per turn, no BOS; the
# generation prompt opens the assistant turn.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama-3 Instruct: the BOS once, then <|start_header_id|>role<|end_header_id|>\n\n content<|eot_id|> per turn,
# content trimmed (no default system prompt).
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Zephyr (HuggingFaceH4/zephyr-7b, TRL's and the alignment handbook's default): <|role|>\n content, the tokenizer's
# EOS and a newline per turn; the generation prompt opens the assistant turn.
ZEPHYR = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "llama3": LLAMA3, "zephyr": ZEPHYR}
