"""LoRA (and QLoRA) for every training stage, through ``peft``: the options, wrapping a model in adapters, and saving
what the next stage loads without knowing about LoRA.

With ``--lora-rank R`` the trainer freezes the model and trains rank-R adapters on its linear layers (every one of the
decoder's but the LM head by default, peft's ``all-linear``, for any architecture); a reward model's (or PPO
critic's) score head is new or task-specific, so it is trained whole (peft's ``modules_to_save`` for sequence
classification). Nothing else changes: the reference log-probs are still the once-per-dataset pass (the adapters
start at zero, so the wrapped model is the starting model), and resume, batch x accumulation invariance and
ZeRO-3 work as without LoRA.

What a run saves (the final model and every checkpoint's)::

    OUTPUT/                  the merged model, W + (alpha / rank) B A, as a plain save_pretrained directory:
                             from_pretrained, vLLM and every stage load it as they load any model
    OUTPUT/adapter/          the adapter alone (peft's save_pretrained: adapter_config.json + safetensors)
    OUTPUT/critic/adapter/   PPO: the critic's

The merge works on the full state dict that ``accelerator.get_state_dict`` gathers (also under ZeRO-3), so it needs
no second copy of the model. With ``--load-in-4bit`` (QLoRA, bitsandbytes) the frozen weights are 4-bit NF4; the
merged model is then made by loading the starting model again at its own precision and merging the saved adapter
into it (:func:`merge_by_reloading`): merging into the 4-bit weights would round the update away.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from rlhf_pipeline.config import option
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.modeling import SAFE_WEIGHTS, is_peft, peel

ADAPTER_DIR = "adapter"
ALL_LINEAR = "all-linear"  # peft resolves it per architecture: every nn.Linear but the output layer
_ADAPTER = "default"  # peft's name for the one adapter
_INSTALL = "pip install 'rlhf-pipeline[lora]' (peft)"


@dataclass(kw_only=True)
class LoraOptions:
    """LoRA options, shared by every training stage."""

    options_group: ClassVar[str] = "LoRA options"

    lora_rank: int = option(
        0, help="Train rank-R LoRA adapters (peft) instead of every weight; 0 = full fine-tuning. The output is the "
        "merged model (what the next stage loads), with the adapter alone in OUTPUT/adapter."
    )
    lora_alpha: Optional[float] = option(
        None, help="LoRA scale alpha: the update is (alpha / rank) B A (default: 2 x --lora-rank)."
    )
    lora_dropout: float = option(
        0.0, help="Dropout on the adapters' input. 0 by default: the old and reference log-probs are computed without "
        "dropout, so with it the policy's would not match them at the first step."
    )
    lora_target_modules: Optional[list[str]] = option(
        None, help="Names of the linear layers to adapt (e.g. q_proj v_proj); default: all of them but the LM head "
        f"(peft's {ALL_LINEAR}, whatever the architecture)."
    )
    load_in_4bit: bool = option(
        False, help="QLoRA: keep the frozen weights in 4-bit NF4 (bitsandbytes; with --lora-rank)."
    )

    def check_lora(self) -> None:
        if self.lora_rank < 0:
            raise ValueError("--lora-rank must be >= 0 (0 = full fine-tuning)")
        if not self.lora_rank:
            given = [f"--{name.replace('_', '-')}" for name in ("lora_alpha", "lora_target_modules", "load_in_4bit")
                     if getattr(self, name)] + (["--lora-dropout"] if self.lora_dropout else [])
            if given:
                raise ValueError(f"{', '.join(given)} configure LoRA adapters; pass --lora-rank R (e.g. 16) too")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ValueError("--lora-alpha must be > 0")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError("--lora-dropout must be in [0, 1)")
        if self.lora_target_modules is not None and not self.lora_target_modules:
            raise ValueError("--lora-target-modules needs at least one module name")

    @property
    def lora_scale(self) -> float:
        return (self.lora_alpha or 2.0 * self.lora_rank) / self.lora_rank


# ----------------------------------------------------------------------------------------------------------------
# Wrapping


def parts(model: Any) -> dict[str, Any]:
    """The peft-wrapped parts of a model, by state-dict prefix: ``{"": model}`` for a wrapped model,
    ``{"policy.": ..., "critic.": ...}`` for PPO's policy and critic, ``{}`` without adapters."""
    if is_peft(model):
        return {"": model}
    return {f"{name}.": getattr(model, name) for name in ("policy", "critic") if is_peft(getattr(model, name, None))}


def _is_classifier(model: Any) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def load_kwargs(options: LoraOptions) -> dict[str, Any]:
    """What ``from_pretrained`` needs for QLoRA's 4-bit weights ({} otherwise): NF4 with double quantization, computed
    in bfloat16 on a GPU that has it (float16 on one that does not) and in float32 on a CPU."""
    if not options.load_in_4bit:
        return {}
    import torch

    try:
        from transformers import BitsAndBytesConfig
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise PipelineError("--load-in-4bit needs bitsandbytes: pip install 'rlhf-pipeline[qlora]'") from None
    if torch.cuda.is_available():
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtype = torch.float32
    # ZeRO-3 shards parameters of one float dtype, so there the 4-bit codes are stored packed in it; elsewhere bytes
    # (float storage on one process changes what a state_dict() call leaves behind: checked on a CPU, the forward after
    # one differed by 5e-4)
    sharded = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype if sharded else torch.uint8,
    )}


def add_adapters(model: Any, options: LoraOptions) -> Any:
    """``model`` with LoRA adapters (its own weights frozen), or unchanged without ``--lora-rank``. PPO's policy and
    critic (``.policy``/``.critic``) each get their own."""
    if not options.lora_rank:
        return model
    if hasattr(model, "policy") and hasattr(model, "critic"):
        model.policy = add_adapters(model.policy, options)
        model.critic = add_adapters(model.critic, options)
        return model
    try:
        import peft
    except ImportError:
        raise PipelineError(f"--lora-rank needs peft: {_INSTALL}") from None
    if options.load_in_4bit:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        for module in model.modules():
            # bitsandbytes' CPU fast path (with AVX512-BF16) repacks a frozen 4-bit weight at its first forward, and
            # state_dict() unpacks it again with different scales (checked with 0.50.2: the forward after a
            # state_dict() call moved by up to 2e-3), so every checkpoint would change the run. The plain path
            # dequantizes at each call instead. GPUs are not affected.
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    if not _is_classifier(model) and not hasattr(model, "prepare_inputs_for_generation"):
        # peft adapts a causal LM or a standard sequence classifier (its `score` head trained whole); a model with
        # a head of its own code (ArmoRM's regression and gating layers) would fail inside peft with a traceback
        raise PipelineError(f"--lora-rank: {type(model).__name__} is neither a causal LM nor a standard sequence "
                            "classifier (a reward head of its own code, as ArmoRM's): LoRA cannot adapt it here; "
                            "train it whole (drop --lora-rank), or start from a standard model")
    targets = options.lora_target_modules or ALL_LINEAR
    config = peft.LoraConfig(
        r=options.lora_rank, lora_alpha=options.lora_rank * options.lora_scale, lora_dropout=options.lora_dropout,
        target_modules=targets, bias="none",
        task_type=peft.TaskType.SEQ_CLS if _is_classifier(model) else peft.TaskType.CAUSAL_LM,
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # no module matched, or one peft cannot adapt
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"})
        raise PipelineError(f"--lora-target-modules {' '.join(targets) if isinstance(targets, list) else targets}: "
                            f"{e}; the model's linear layers are named {', '.join(names)}") from None
    others = sorted({type(m).__name__ for n, m in wrapped.named_modules()
                     if hasattr(m, "lora_A") and not isinstance(m, peft.tuners.lora.Linear)
                     and not type(m).__name__.startswith("Linear4bit")})
    if others:  # the merge below handles W + s B A of linear layers only
        raise PipelineError(f"--lora-target-modules: adapters on {', '.join(others)} layers are not supported; name "
                            "linear layers only (q_proj, v_proj, ...)")
    head = peel(wrapped).get_output_embeddings() if hasattr(peel(wrapped), "get_output_embeddings") else None
    if head is not None and hasattr(head, "lora_A"):
        # often tied to the input embeddings (a merged update would be lost to the tie when the model is loaded), and
        # the log-prob pass handles its weight as trained whole or frozen (ZeRO-3), not as a frozen base with adapters
        raise PipelineError("--lora-target-modules: adapters on the LM head are not supported; adapt the decoder's "
                            "layers (the default, every linear layer but the LM head)")
    return wrapped


# ----------------------------------------------------------------------------------------------------------------
# Saving


def merge_state_dict(state_dict: dict[str, Any], scale: float, transposed: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A peft model's full state dict (``accelerator.get_state_dict``) as the plain model's, each adapted linear
    weight merged: ``W + scale * B @ A`` (computed in float32, stored in W's dtype; ``(B @ A)^T`` for the modules
    named in ``transposed``, GPT-2's ``Conv1D`` layers, which store W as (in, out)). Keys of PPO's
    ``policy.``/``critic.`` parts keep their prefix; a score head trained whole (``modules_to_save``) replaces the
    original."""
    import torch

    out: dict[str, Any] = {}
    adapters: dict[str, dict[str, Any]] = {}
    for key, value in state_dict.items():
        for part in ("lora_A", "lora_B"):
            tag = f".{part}.{_ADAPTER}.weight"
            if key.endswith(tag):
                adapters.setdefault(_plain_name(key[: -len(tag)]), {})[part] = value
                break
        else:
            if ".original_module." not in key:
                out[_plain_name(key)] = value
    for module, ab in adapters.items():
        weight = out[f"{module}.weight"]
        delta = ab["lora_B"].to(torch.float32) @ ab["lora_A"].to(torch.float32)
        if module in transposed:
            delta = delta.T
        out[f"{module}.weight"] = (weight.to(torch.float32) + scale * delta).to(weight.dtype)
    return out


def _plain_name(key: str) -> str:
    """A peft state-dict key as the plain model's: ``[policy.]base_model.model.X.base_layer.weight`` -> ``X.weight``,
    ``X.modules_to_save.default.weight`` -> ``X.weight``."""
    return (key.replace("base_model.model.", "", 1).replace(".base_layer.", ".")
            .replace(f".modules_to_save.{_ADAPTER}.", "."))


def save_adapters(model: Any, path: Path, state_dict: dict[str, Any]) -> None:
    """Each adapter alone, in peft's layout: OUTPUT/adapter (and PPO's critic's in OUTPUT/critic/adapter)."""
    from rlhf_pipeline.layout import CRITIC

    for prefix, part in parts(model).items():
        where = path / (CRITIC if prefix == "critic." else "") / ADAPTER_DIR
        own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        part.save_pretrained(str(where), state_dict=own, safe_serialization=True)


def save_merged(model: Any, path: Path, state_dict: dict[str, Any]) -> None:
    """The merged model as a plain ``save_pretrained`` directory, the adapters beside it (main process)."""
    save_adapters(model, path, state_dict)
    if any(type(m).__name__.startswith("Linear4bit") for m in model.modules()):
        return merge_by_reloading(model, path)
    scales = {cfg.lora_alpha / cfg.r for part in parts(model).values() for cfg in part.peft_config.values()}
    if len(scales) != 1:
        raise ValueError(f"adapters with different scales {sorted(scales)}: merge_state_dict takes one")
    transposed = frozenset(_plain_name(prefix + name) for prefix, part in parts(model).items()
                           for name, m in part.named_modules() if hasattr(m, "lora_A") and getattr(m, "fan_in_fan_out", False))
    merged = merge_state_dict(state_dict, scales.pop(), transposed)
    plain = model if parts(model) and not is_peft(model) else peel(model)  # PPO's container saves its parts itself
    plain.save_pretrained(path, state_dict=merged, safe_serialization=True)


def merge_by_reloading(model: Any, path: Path) -> None:
    """QLoRA: load each part's starting model again at its own precision, merge its saved adapter into it (peft's
    ``merge_and_unload``) and save it; the 4-bit weights themselves are never written."""
    from peft import PeftModel
    from rlhf_pipeline.layout import CRITIC

    for prefix, part in parts(model).items():
        base = peel(part)
        where = path / (CRITIC if prefix == "critic." else "")
        labels = {"num_labels": base.config.num_labels} if _is_classifier(base) else {}
        fresh = type(base).from_pretrained(part.peft_config[_ADAPTER].base_model_name_or_path, dtype="auto", **labels,
                                           **SAFE_WEIGHTS)
        merged = PeftModel.from_pretrained(fresh, str(where / ADAPTER_DIR)).merge_and_unload()
        # the pad id the trained model read its rewards at (prepare_reward_model set it on its config; a base such
        # as Llama-3 has none, and a classifier without one refuses batches of more than one)
        merged.config.pad_token_id = base.config.pad_token_id
        merged.save_pretrained(str(where), safe_serialization=True)
