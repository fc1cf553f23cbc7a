"""Build a tiny model offline: a BPE tokenizer trained on bundled text and a random-initialised Llama.

    rlhf tiny-model --output models/tiny-policy
    rlhf tiny-model --output models/tiny-rm --kind reward --seed 1
    rlhf tiny-model --output models/tiny-llama3 --chat-format llama3
    rlhf tiny-model --output models/tiny-armo --kind armo     # remote code: score it with --trust-remote-code

The directory loads with ``from_pretrained`` like any Hub model, so every stage runs on it unchanged.
``--chat-format`` gives the tokenizer a real family's special tokens and chat template (Llama-3, ChatML/Qwen,
Mistral, Gemma; see ``rlhf_pipeline.tiny.CHAT_FORMATS``), so a pipeline can be checked on that layout offline;
``--chat-format base`` gives it none, as a base model ships (the stages then need ``--chat-template``).
``--kind armo`` writes a reward model laid out as ArmoRM is (``rlhf_pipeline.tiny.save_tiny_armo_model``): its own
modeling code named in config.json's auto_map, a multi-objective head with a gating layer, and a ``score`` output.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import option
from rlhf_pipeline.datasets_io import atomic_directory, clean_stale
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.tiny import ARMO_CODE, TINY_HEAD_DIM, ChatFormatName, TinyKind


@dataclass(kw_only=True)
class TinyModelConfig:
    """Build a tiny tokenizer + Llama offline and save it with save_pretrained (safetensors)."""

    output: str = option(help="Directory to write the model and tokenizer to.")
    kind: TinyKind = option(
        "policy", help="policy: LlamaForCausalLM; reward: LlamaForSequenceClassification with num_labels=1; armo: a "
        "multi-objective reward model with a gating layer that ships its own code, as ArmoRM does (score it with "
        "--trust-remote-code)."
    )
    seed: int = option(0, help="Seed of the random initialisation.")
    hidden_size: int = option(64, help="Hidden size of the Llama.")
    num_layers: int = option(2, help="Number of decoder layers.")
    chat_format: ChatFormatName = option(
        "tiny", help="Tokenizer family: special tokens, chat template and stop tokens (tiny: the kit's own format; "
        "base: the kit's tokens without a chat template, as a base model ships)."
    )
    overwrite: bool = option(False, help="Replace an existing directory.")

    def __post_init__(self) -> None:
        if self.hidden_size < TINY_HEAD_DIM or self.hidden_size % TINY_HEAD_DIM:
            raise ValueError(f"--hidden-size must be a positive multiple of the tiny kit's head size {TINY_HEAD_DIM}")
        if self.num_layers < 1:
            raise ValueError("--num-layers must be at least 1")


# What a tiny model of any kind and chat format holds: --overwrite replaces a directory of these files and nothing else.
TINY_MODEL_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", ARMO_CODE})


def main(config: TinyModelConfig) -> Path:
    from rlhf_pipeline.tiny import save_tiny_model

    path = Path(config.output).expanduser()
    clean_stale(path)
    if path.exists() and not path.is_dir():
        raise PipelineError(f"--output {path}: exists and is a file; choose a directory path")
    foreign = sorted({p.name for p in path.iterdir()} - TINY_MODEL_FILES) if path.exists() else []
    if foreign:  # not a tiny model's directory: left as it is
        raise PipelineError(f"--output {path}: holds files a tiny model does not ({', '.join(foreign[:3])}), "
                            "which --overwrite does not delete; choose another --output, or remove it yourself")
    build = dict(kind=config.kind, seed=config.seed, chat_format=config.chat_format, hidden_size=config.hidden_size,
                 num_layers=config.num_layers)
    if path.exists() and not config.overwrite:
        # The build is deterministic: the same options give the same files, so the same command again does nothing
        # (as every stage), and other options are refused rather than replacing a model someone may be using. The
        # build compared is named as atomic_directory names its own, so that one a kill leaves is removed next time.
        with tempfile.TemporaryDirectory(prefix=f".{path.name}.tmp-", dir=path.parent) as tmp:
            save_tiny_model(Path(tmp), **build)
            if _same_files(Path(tmp), path):
                print(f"[tiny-model] {path} already holds this tiny model; nothing to do")
                return path
        raise PipelineError(f"--output {path}: holds another model than these options build (or its files changed); "
                            "pass --overwrite to replace it, or choose another --output")
    with atomic_directory(path) as tmp:
        save_tiny_model(tmp, **build)
    print(f"[tiny-model] wrote a tiny {config.kind} model ({config.chat_format} chat format) to {path}")
    return path


def _same_files(built: Path, existing: Path) -> bool:
    """Whether two directories hold the same files, byte for byte but for the transformers version that config files
    record (an upgrade of transformers builds the same model)."""
    def content(path: Path) -> Any:
        if path.suffix != ".json":
            return path.read_bytes()
        try:
            data = json.loads(path.read_text())
        except ValueError:
            return path.read_bytes()
        if isinstance(data, dict):
            data.pop("transformers_version", None)
        return data

    names = sorted(p.name for p in built.iterdir())
    return names == sorted(p.name for p in existing.iterdir()) and all(
        content(built / name) == content(existing / name) for name in names)


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(TinyModelConfig, main, "rlhf tiny-model", argv)


if __name__ == "__main__":
    sys.exit(cli())
