"""Loading models the same way in every stage: device, dtype, ``trust_remote_code`` off unless asked."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")


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


def load_causal_lm(path: str, dtype: str = "auto", trust_remote_code: bool = False, device: torch.device | None = None):
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code
    )
    return model.to(device).eval()


def load_reward_model(path: str, dtype: str = "auto", trust_remote_code: bool = False, device: torch.device | None = None):
    from transformers import AutoModelForSequenceClassification

    device = device or default_device()
    model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code
    )
    return model.to(device).eval()
