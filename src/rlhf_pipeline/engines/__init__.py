"""Generation engines. Both take prompt token ids and return, per prompt, n samples as text, token ids and a
finish reason, so the generate stage writes the same columns whichever engine ran.

``hf``: Hugging Face ``generate`` (CPU, tests, small GPUs). ``vllm``: a thin adapter over ``vllm.LLM``.
``auto`` picks vLLM when it imports and a GPU is present.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from rlhf_pipeline.attention import DEFAULT_ATTENTION, check_engine
from rlhf_pipeline.engines.base import Completion, Engine, SamplingSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Completion", "Engine", "SamplingSettings", "load_engine", "resolve_engine_name", "vllm_available"]


def vllm_available() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def resolve_engine_name(name: str) -> str:
    if name == "auto":
        return "vllm" if vllm_available() else "hf"
    return name


def load_engine(
    name: str,
    model: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    batch_size: int = 16,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
    max_model_len: int | None = None,
    attn_implementation: str = DEFAULT_ATTENTION,
) -> Engine:
    name = resolve_engine_name(name)
    check_engine(attn_implementation, name)
    if name == "hf":
        from rlhf_pipeline.engines.hf import HFEngine

        return HFEngine(model, tokenizer, dtype=dtype, trust_remote_code=trust_remote_code, batch_size=batch_size,
                        attn_implementation=attn_implementation, max_model_len=max_model_len)
    if name == "vllm":
        from rlhf_pipeline.engines.vllm import VLLMEngine

        return VLLMEngine(
            model,
            tokenizer,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
        )
    raise ValueError(f"unknown engine {name!r}")
