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
    # with ``logprobs``: each sampled token's log-prob as the sampler drew it (after temperature, top-k and top-p)
    logprobs: list[list[float]] | None = None


class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings,
                 logprobs: bool = False) -> list[Completion]:
        """Sample ``sampling.n`` responses for each prompt (token ids); ``seeds`` has one seed per prompt. With
        ``logprobs`` each completion carries its tokens' log-probs under the distribution they were sampled from:
        the model's, divided by the temperature, renormalised over what top-k and top-p kept."""
        ...

    def close(self) -> None:
        """Free the engine now (vLLM's engine core and its memory), not at interpreter exit."""
        ...
