"""What every generation engine shares: the sampling settings, a prompt's completions, and the engine protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingSettings:
    """What the sampling distribution depends on. It travels in the manifest so trainers read it back."""

    n: int
    temperature: float
    top_p: float
    top_k: int  # 0 = off (both engines)
    max_new_tokens: int
    seed: int
    stop_token_ids: tuple[int, ...]


@dataclass
class Completion:
    """The n samples of one prompt. ``token_ids`` are as sampled, the stop token included when one ended it."""

    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]  # "stop" or "length"


class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings) -> list[Completion]:
        """Sample ``sampling.n`` responses for each prompt (token ids); ``seeds`` has one seed per prompt."""
        ...

    def close(self) -> None:
        """Free the engine now (vLLM's engine core and its memory), not at interpreter exit."""
        ...
