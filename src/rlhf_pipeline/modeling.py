"""Loading models the same way in every stage: device, dtype, ``trust_remote_code`` off unless asked; and the one
check of a model or tokenizer reference (:func:`check_model_ref`) that every stage makes before it writes anything.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_pipeline.attention import DEFAULT_ATTENTION, from_pretrained_kwargs
from rlhf_pipeline.compat import allow_legacy_remote_code
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.files import MODEL_HINT, reading
from rlhf_pipeline.layout import MANIFEST, RUN_RECORD

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MODEL_CONFIG = "config.json"
# Any one of these makes a directory loadable with AutoTokenizer (fast, sentencepiece, BPE and WordPiece layouts).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_MODEL_HINT = "a model directory written by save_pretrained (rlhf tiny-model, sft, train) or a Hub model id"


def same_model(a: str, b: str) -> bool:
    """Whether two model references name the same model: local directories by their resolved paths, else (Hub ids)
    as written."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.is_dir() or pb.is_dir():
        return pa.resolve() == pb.resolve()
    return a == b


def offline_variable() -> str | None:
    """The environment variable that keeps the Hub offline (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE), or None. Read
    now, not at import (huggingface_hub reads it once, when first imported)."""
    for name in _OFFLINE_VARIABLES:
        if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE"):
            return name
    return None


def check_model_ref(
    flag: str, ref: str, *, model: bool = True, tokenizer: bool = True, hint: str = _MODEL_HINT
) -> None:
    """Check a model or tokenizer reference before a stage writes anything, so that a mistyped path is one line
    that names the flag, not transformers' traceback about connecting to huggingface.co.

    ``model`` asks for a model (``config.json``), ``tokenizer`` for tokenizer files; a stage that loads both from
    the same reference (a policy) asks for both. A local directory must hold them. Anything else is taken as a Hub
    id, as transformers takes it: one that cannot be (``./x``, ``a/b/c``) is a missing directory; with
    HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set it must be in the local Hub cache; online the Hub is asked
    whether it exists.
    """
    path = Path(ref).expanduser()
    needed = "a model" if model else "a tokenizer"
    if path.is_dir():
        if model and not (path / MODEL_CONFIG).is_file():
            raise PipelineError(f"{flag} {ref}: a directory without {MODEL_CONFIG}, so not a model; pass {hint}")
        if model and not any(path.glob("*.safetensors")) and any(path.glob("*.bin")):
            raise PipelineError(
                f"{flag} {ref}: holds its weights only as .bin files, pickles that can run code when loaded; rlhf "
                "loads safetensors only: convert them (from_pretrained, then save_pretrained, which writes "
                "safetensors) and pass that directory"
            )
        if (path / RUN_RECORD).is_file() and not (path / MANIFEST).is_file():
            raise PipelineError(
                f"{flag} {ref}: an unfinished training run (no {MANIFEST}): its model is not the finished one; "
                f"finish it with --resume, or pass one of its checkpoints ({ref}/checkpoints/step_N)"
            )
        if model and not any(path.glob("*.safetensors")):
            raise PipelineError(
                f"{flag} {ref}: holds {MODEL_CONFIG} but no weights (no *.safetensors file); pass a directory a "
                "model was saved into (save_pretrained), or a training stage's finished --output"
            )
        if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
            what = "a model but no tokenizer" if model else "no tokenizer"
            raise PipelineError(
                f"{flag} {ref}: holds {what} (none of {', '.join(TOKENIZER_FILES[:3])}, ...); save the tokenizer "
                f"into it (tokenizer.save_pretrained) or pass a directory that has one"
            )
        return
    if path.exists():
        raise PipelineError(f"{flag} {ref}: is a file, not a directory; pass {hint}")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(ref)
    except HFValidationError:
        raise PipelineError(f"{flag} {ref}: no such directory (and not a Hub id, ORG/NAME); check the path") from None
    offline = offline_variable()
    if offline is not None:
        if not _in_hub_cache(ref, model=model, tokenizer=tokenizer):
            raise PipelineError(
                f"{flag} {ref}: not found locally; with {offline} set, Hub ids are not fetched (it is neither a "
                f"directory nor in the local Hub cache); check the path, or unset {offline} to download it"
            )
        return
    _check_on_hub(flag, ref, needed)


def _in_hub_cache(repo_id: str, *, model: bool, tokenizer: bool) -> bool:
    """Whether the local Hub cache holds the files a stage needs of ``repo_id`` (what transformers reads offline)."""
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)

    return (not model or cached(MODEL_CONFIG)) and (not tokenizer or any(cached(f) for f in TOKENIZER_FILES))


def _check_on_hub(flag: str, ref: str, needed: str) -> None:
    """Online: a reference that is not a local directory must name a model repo on the Hub."""
    import huggingface_hub

    try:
        exists = huggingface_hub.repo_exists(ref, repo_type="model")
    except Exception as e:  # no network, a proxy, the Hub down: say so here, not in four chained tracebacks
        raise PipelineError(
            f"{flag} {ref}: not a local directory; tried as a Hub id and the Hub could not be reached "
            f"({type(e).__name__}); check the path, or the network (HF_HUB_OFFLINE=1 uses only local models)"
        ) from None
    if not exists:
        raise PipelineError(
            f"{flag} {ref}: not a local directory; tried as a Hub id and the Hub has no such model (or it is private: "
            f"set HF_TOKEN); check the path or the id of {needed}"
        )


# config.json's auto_map key for the class a reward model is loaded with (AutoModelForSequenceClassification).
REWARD_AUTO_CLASS = "AutoModelForSequenceClassification"
# How causal LMs' architecture names end (LlamaForCausalLM, GPT2LMHeadModel): a model whose every architecture is one.
_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_REWARD_MODEL_HINT = ("pass a sequence-classification reward model (AutoModelForSequenceClassification; rlhf train-rm "
                      "trains one from this model) or a python reward function with --reward-fn")


def check_reward_model(flag: str, ref: str, trust_remote_code: bool = False, *, judge: bool = False,
                       trust_option: str = "--trust-remote-code") -> None:
    """:func:`check_model_ref`, then what the model's ``config.json`` says it is, read as JSON (none of the model's
    code runs, nothing is written), so that two mistakes are one line each before a stage reads its data:

    * a model that ships its own code for its reward head (``auto_map``'s ``AutoModelForSequenceClassification``
      entry, as ArmoRM does) without ``--trust-remote-code``. transformers refuses such a model with a traceback
      when its ``model_type`` is its own, and when the type is a standard one (ArmoRM's is ``llama``) it loads that
      type's standard classifier instead, with a new, random score head, and scores with it;
    * a causal LM (every one of its ``architectures`` a causal LM's): loaded as a sequence classifier it gets a new,
      random score head too. ``judge``: the stage also takes a ``--judge`` model (``rlhf eval``), named in the fix.

    ``trust_option`` is how the fix names the option that allows the code (``rlhf iterate`` sets it in its score
    section).

    A Hub id's config.json is read from the local Hub cache, or downloaded (one small file) when online; where
    neither works the checks are left to the loader."""
    check_model_ref(flag, ref)
    config = _config_json(ref)
    if config is None:
        return
    problem = reward_model_problem(config, trust_remote_code, judge=judge, trust_option=trust_option)
    if problem is not None:
        raise PipelineError(f"{flag} {ref}: {problem}")


def reward_model_problem(config: dict, trust_remote_code: bool, *, judge: bool = False,
                         trust_option: str = "--trust-remote-code") -> str | None:
    """Why a model with this ``config.json`` cannot score as a reward model here, and the fix (see
    :func:`check_reward_model`), or None."""
    remote = remote_reward_head(config)
    if remote:
        if trust_remote_code:
            return None
        return _not_allowed(_ships(remote), trust_option)
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if architectures and all(a.endswith(_CAUSAL_LM_SUFFIXES) for a in architectures):
        fix = _REWARD_MODEL_HINT + (", or give it as --judge to compare answers pairwise" if judge else "")
        return (f"is a causal language model ({', '.join(architectures)}), not a reward model: loaded as one it "
                f"would score with a new, randomly initialised head; {fix}")
    return None


def remote_reward_head(config: dict) -> str | None:
    """The class a model's ``config.json`` names for its own reward-head code (``auto_map``'s
    ``AutoModelForSequenceClassification`` entry, as ArmoRM's does), or None."""
    return _remote_class(config, REWARD_AUTO_CLASS)


def _remote_class(config: dict, auto_class: str) -> str | None:
    """The class of its own code a model's ``config.json`` names for ``auto_class`` in its ``auto_map``, or None."""
    auto_map = config.get("auto_map")
    remote = auto_map.get(auto_class) if isinstance(auto_map, dict) else None
    return remote if isinstance(remote, str) and remote else None


def check_causal_lm_code(flag: str, ref: str, trust_remote_code: bool, trust_option: str) -> None:
    """Before a stage runs: a chat model ``ref`` that ships its own code for its causal LM (``auto_map``'s
    ``AutoModelForCausalLM``), given without ``trust_option``, is one line naming that option, not a refusal from
    transformers once the stage's other work is done. A Hub id's config.json is read as :func:`check_reward_model`
    reads it."""
    config = None if trust_remote_code else _config_json(ref)
    remote = _remote_class(config, "AutoModelForCausalLM") if config is not None else None
    if remote:
        raise PipelineError(f"{flag} {ref}: " + _not_allowed(_ships(remote, "AutoModelForCausalLM", "model code"),
                                                               trust_option))


def _ships(remote: str, auto_class: str = REWARD_AUTO_CLASS, what: str = "code for its reward head") -> str:
    return f"ships its own {what} (config.json's auto_map: {auto_class} -> {remote})"


def _not_allowed(ships: str, trust_option: str) -> str:
    return f"{ships}, which is not run unless allowed; read that code, then allow it with {trust_option}"


# PPO's critic reads a value at every response token through the classifier's one-label `score` head
# (logprobs.token_values, supports_fast_path); the fix when a model cannot be one.
CRITIC_FIX = ("pass --critic-model with a reward model rlhf train-rm wrote, or with the policy (the critic then starts "
              "from it with a new value head)")


def check_critic_model(flag: str, ref: str, trust_remote_code: bool = False) -> None:
    """:func:`check_model_ref` for a model given as PPO's critic start (``--critic-model``), then its ``config.json``
    (read as JSON, none of its code run): a model that ships its own reward-head code is refused unless
    ``--trust-remote-code`` allows it. Without that, transformers either refuses it with a traceback (a
    ``model_type`` of its own) or, for ArmoRM's standard ``llama`` type, loads a standard classifier with a new,
    random score head in place of the model's own. With it, the loaded model must still have a ``score`` head of one
    label (:func:`check_critic`). A causal LM is a fine start: the critic gets a new value head on its body."""
    check_model_ref(flag, ref, tokenizer=False)
    remote = own_reward_head(ref)
    if remote and not trust_remote_code:
        raise PipelineError(f"{flag} {ref}: {_ships(remote)}, which is not run unless allowed, and PPO's critic needs a "
                            f"`score` head of one label, which such code seldom has; {CRITIC_FIX}, or allow the "
                            "code with --trust-remote-code if its head is one")


def own_reward_head(ref: str) -> str | None:
    """:func:`remote_reward_head` of the model ``ref`` (its ``config.json`` read as JSON), or None where it names none
    or cannot be read."""
    config = _config_json(ref)
    return remote_reward_head(config) if config is not None else None


def check_critic(flag: str, ref: str, model: Any, *, from_policy: bool = False) -> None:
    """The loaded critic reads values as PPO needs them: a classifier with a ``score`` head of one label."""
    if not supports_fast_path(model):
        fix = ("pass --critic-model with a reward model rlhf train-rm wrote" if from_policy else CRITIC_FIX)
        raise PipelineError(f"{flag} {ref}: {type(model).__name__} is not a sequence classifier with a `score` head "
                            f"of one label, which PPO's critic reads at every token; {fix}")


def _config_json(ref: str) -> dict | None:
    """A model's ``config.json`` as a dict: from a local directory (:func:`check_model_ref` has checked it has one),
    else from the local Hub cache, else from the Hub unless offline; None where it cannot be read."""
    path = Path(ref).expanduser()
    try:
        if path.is_dir():
            config = json.loads((path / MODEL_CONFIG).read_text())
        else:
            from huggingface_hub import hf_hub_download, try_to_load_from_cache

            cached = try_to_load_from_cache(ref, MODEL_CONFIG)
            if not isinstance(cached, str):
                if offline_variable() is not None:
                    return None
                cached = hf_hub_download(ref, MODEL_CONFIG)
            config = json.loads(Path(cached).read_text())
    except Exception as e:  # a damaged file, no network: the loader reports it as it always has
        log.info("%s: config.json not read before loading (%s)", ref, e)
        return None
    return config if isinstance(config, dict) else None


def default_device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU that supports it and float32 elsewhere."""
    import torch

    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


# Every model this project loads: weights from safetensors, never from a pickle (pytorch_model.bin), which can run
# code when loaded (check_model_ref says so in one line for a local directory)
SAFE_WEIGHTS = {"use_safetensors": True}


def context_length(model_config: Any) -> tuple[int, str] | None:
    """The longest a sequence (a prompt and its response) may be in a model of this config, and where the number
    comes from: ``max_position_embeddings``, stretched by a RoPE scaling that reaches past it (YaRN, linear, dynamic:
    Qwen2.5's factor 4 over 32,768) as vLLM counts it; Llama-3's and LongRoPE's already count in the positions. None
    when the config names none."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    positions = getattr(text, "max_position_embeddings", None)
    if not positions:
        return None
    scaling = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    kind, factor = scaling.get("rope_type") or scaling.get("type"), scaling.get("factor")
    if factor and kind not in (None, "default", "llama3", "longrope", "su"):
        positions = int((scaling.get("original_max_position_embeddings") or positions) * factor)
        return positions, f"max_position_embeddings with its {kind} RoPE scaling"
    return positions, "max_position_embeddings in its config.json"


def load_causal_lm(path: str, dtype: str = "auto", trust_remote_code: bool = False,
                   device: torch.device | None = None, attn_implementation: str = DEFAULT_ATTENTION):
    """A causal LM for inference, on ``device``, in ``dtype``, with ``attn_implementation``
    (``rlhf_pipeline.attention``)."""
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    attention = from_pretrained_kwargs(attn_implementation)
    if trust_remote_code:
        allow_legacy_remote_code()
    with reading("model", path, MODEL_HINT, only_damaged=True):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code, **attention, **SAFE_WEIGHTS
        )
    return model.to(device).eval()


def load_reward_model(path: str, dtype: str = "auto", trust_remote_code: bool = False,
                      device: torch.device | None = None, attn_implementation: str = DEFAULT_ATTENTION):
    """A sequence classifier (a reward model) for inference, as :func:`load_causal_lm` loads a causal LM."""
    from transformers import AutoModelForSequenceClassification

    device = device or default_device()
    attention = from_pretrained_kwargs(attn_implementation)
    if trust_remote_code:
        allow_legacy_remote_code()
    with reading("model", path, MODEL_HINT, only_damaged=True):
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code, **attention, **SAFE_WEIGHTS
        )
    return model.to(device).eval()


def is_peft(model: Any) -> bool:
    """A peft model (without importing peft)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def peel(model: Any) -> Any:
    """The transformers model inside a peft wrapper (its layers carry the adapters), or the model as is."""
    return model.get_base_model() if is_peft(model) else model


def enable_activation_checkpointing(model: Any) -> None:
    """Activation (gradient) checkpointing of every decoder layer, non-reentrant. Transformers 5.2x renamed
    ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` (the old name warns, and goes in v6);
    a model with the new name gets it. Any other (older releases, a wrapper of two models) gets the old one, and so
    does a model with its own ``gradient_checkpointing_enable`` (remote code): the new name would call that with
    arguments an older override does not take."""
    from transformers import PreTrainedModel

    kwargs = {"use_reentrant": False}
    # as transformers tells an override: a subclass's method, or a wrapper set on the instance, is not its function
    own = getattr(getattr(model, "gradient_checkpointing_enable", None), "__func__", None) is not getattr(
        PreTrainedModel, "gradient_checkpointing_enable", None)
    if hasattr(model, "activation_checkpointing_enable") and not own:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def supports_fast_path(model) -> bool:
    """A one-label classifier whose reward is ``score(last hidden state)`` of a body named by ``base_model_prefix``."""
    import torch

    config = getattr(model, "config", None)
    prefix = getattr(model, "base_model_prefix", None)
    return (
        config is not None
        and getattr(config, "num_labels", None) == 1
        and isinstance(getattr(model, "score", None), torch.nn.Module)
        and isinstance(prefix, str)
        and isinstance(getattr(model, prefix, None), torch.nn.Module)
    )
