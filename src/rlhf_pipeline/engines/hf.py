"""Hugging Face ``generate`` engine: batched, left-padded, prompts grouped by length, n samples per request.

Sampling matches vLLM's defaults for the same settings: ``model.generate`` fills every unset option from the
model's ``generation_config.json`` and then from transformers' global defaults (``top_k=50`` among them), so each
option that shapes the distribution is set here explicitly (top-k off unless asked, no repetition penalty).

Same seed, same prompts, same batch size: same output. Unlike vLLM's per-request seeds, a sample here also depends
on which prompts share its batch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from rlhf_pipeline.engines import Completion, SamplingSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Keep tokens up to and including the first stop token; ``stop`` if one was found, else ``length``."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1], "stop"
    return tokens, "length"


class HFEngine:
    name = "hf"

    def __init__(
        self,
        model: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        batch_size: int = 16,
    ):
        from rlhf_pipeline.chat import pad_id
        from rlhf_pipeline.modeling import load_causal_lm

        self.model = load_causal_lm(model, dtype=dtype, trust_remote_code=trust_remote_code)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.pad_id = pad_id(tokenizer)

    def _generation_config(self, sampling: SamplingSettings):
        from transformers import GenerationConfig

        greedy = sampling.temperature == 0
        return GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy else sampling.top_k,
            min_p=0.0,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            num_return_sequences=sampling.n,
            num_beams=1,
            eos_token_id=list(sampling.stop_token_ids),
            pad_token_id=self.pad_id,
        )

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings) -> list[Completion]:
        import torch

        gen_config = self._generation_config(sampling)
        stop_ids = set(sampling.stop_token_ids)
        device = self.model.device
        # Longest first: similar lengths share a batch (little padding), and a memory problem shows up at once.
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: list[Completion | None] = [None] * len(prompts)
        torch.manual_seed(sampling.seed)
        with tqdm(total=len(prompts), desc="generate (hf)", unit="prompt") as bar:
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                width = max(len(prompts[i]) for i in batch)
                input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
                attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, i in enumerate(batch):  # left padding: the last prompt token sits at the same position
                    ids = prompts[i]
                    input_ids[row, width - len(ids) :] = torch.tensor(ids)
                    attention_mask[row, width - len(ids) :] = 1
                with torch.no_grad():
                    out = self.model.generate(
                        input_ids=input_ids.to(device),
                        attention_mask=attention_mask.to(device),
                        generation_config=gen_config,
                    )
                new_tokens = out[:, width:].tolist()  # (B * n, T), rows of one prompt are adjacent
                for row, i in enumerate(batch):
                    cut = [cut_at_stop(t, stop_ids) for t in new_tokens[row * sampling.n : (row + 1) * sampling.n]]
                    token_ids = [c[0] for c in cut]
                    results[i] = Completion(
                        texts=self.tokenizer.batch_decode(token_ids, skip_special_tokens=True),
                        token_ids=token_ids,
                        finish_reasons=[c[1] for c in cut],
                    )
                bar.update(len(batch))
        return results  # type: ignore[return-value]
