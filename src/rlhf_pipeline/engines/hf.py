"""Hugging Face ``generate`` engine: batched, left-padded, prompts grouped by length, n samples per request.

Sampling matches vLLM's defaults for the same settings: ``model.generate`` fills every unset option from the
model's ``generation_config.json`` and then from transformers' global defaults (``top_k=50`` among them), so the
model's own config is replaced by one that keeps only its special tokens and cache settings, and each option that
shapes the distribution is set here explicitly (top-k off unless asked, no repetition penalty).

Same seeds, same prompts, same batch size: same output. Each batch draws from a generator seeded with the request
seed of its first prompt (``sampling.seed`` only reaches the engine through the request seeds, as with vLLM), so two
chunks of a run, two ``--shard``s or two Ray replicas never replay the same random numbers. Unlike vLLM's per-request
seeds, a sample here also depends on which prompts share its batch, except with ``batch_size=1``: then each prompt is
sampled alone, from its own request seed, so its samples do not depend on the other prompts either (a ``--shard
i/N`` run or a Ray replica samples each of its prompts as the whole run would).

Temperature, top-k and top-p are applied by our own logits processors (:func:`sampling_processors`), in transformers'
order, instead of ``generate``'s: :class:`TopPLogitsWarper` and :class:`TopKLogitsWarper` below give exactly
transformers' processed logits (so the same tokens for the same seed) without its per-step ``torch.sort`` of every
sampled row's whole vocabulary, which on a CPU costs more than a small model's decode step (docs/benchmarks.md has
the measurement).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from rlhf_pipeline.attention import DEFAULT_ATTENTION
from rlhf_pipeline.engines.base import Completion, SamplingSettings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Keep tokens up to and including the first stop token; ``stop`` if one was found, else ``length``."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1], "stop"
    return tokens, "length"


def generate_calls(lengths: list[int], batch_size: int) -> list[list[int]]:
    """The prompts (their indices), longest first, cut into ``generate`` calls of up to ``batch_size``: similar
    lengths share a call (little padding), and a memory problem shows up at once."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def sorted_values(scores):
    """Each row of ``scores`` sorted ascending, values only. The sorted values of a row do not depend on the sorting
    algorithm (only the order of equal values' indices would), so on a CPU numpy's much faster sort gives the same
    tensor as ``torch.sort(scores).values``."""
    import numpy as np
    import torch

    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(scores.detach().contiguous().numpy(), axis=-1))
    return torch.sort(scores, dim=-1).values


def keep_at_least(scores, threshold, filter_value: float):
    """``scores`` where ``scores >= threshold`` (per row), ``filter_value`` elsewhere: ``masked_fill``'s result. For
    ``-inf`` computed as ``minimum(scores, +-inf)``, which is branch-free: ``masked_fill`` with an irregular mask
    takes ~3x longer on a CPU (a mispredicted branch per element)."""
    import torch

    keep = scores >= threshold
    if filter_value != -float("inf"):
        return scores.masked_fill(~keep, filter_value)
    return torch.minimum(scores, keep.to(scores.dtype).mul_(2).sub_(1).mul_(float("inf")))


class TopPLogitsWarper:
    """transformers' ``TopPLogitsWarper``, the same processed logits, found from sorted values instead of a sort with
    indices and a scatter.

    transformers sorts each row ascending, takes ``softmax(sorted).cumsum()``, removes the sorted positions whose
    cumulative probability is ``<= 1 - top_p`` (keeping the last ``min_tokens_to_keep``) and scatters that back. Here
    the same ``softmax`` and ``cumsum`` run on the same sorted values (bit for bit the same inputs, so the same
    comparison results); when the removed positions are a prefix of the sorted row (the cumulative sum rises) and the
    first kept value is strictly above the last removed one, the removed tokens are exactly those below the first
    kept value, which needs no indices. A row where either fails (equal logits on both sides of the cut, whose fate
    depends on the order ``torch.sort`` happens to give them, or a NaN) goes through transformers' own warper.
    """

    def __init__(self, top_p: float, filter_value: float = -float("inf"), min_tokens_to_keep: int = 1):
        from transformers.generation.logits_process import TopPLogitsWarper as Reference

        self.reference = Reference(top_p, filter_value=filter_value, min_tokens_to_keep=min_tokens_to_keep)
        self.top_p = self.reference.top_p
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep
        self.fallback_rows = 0  # rows handed to transformers' warper so far (for tests and profiling)

    def __call__(self, input_ids, scores):
        import torch

        values = sorted_values(scores).to(scores.device)
        cumulative_probs = values.softmax(dim=-1).cumsum(dim=-1)  # as transformers computes it
        remove = cumulative_probs <= (1 - self.top_p)
        remove[..., -self.min_tokens_to_keep :] = False
        removed = remove.sum(dim=-1, keepdim=True)  # (B, 1) positions removed
        first_kept = values.gather(-1, removed.clamp(max=values.shape[-1] - 1))
        last_removed = values.gather(-1, (removed - 1).clamp(min=0))
        exact = (
            ~(remove[..., 1:] & ~remove[..., :-1]).any(dim=-1)  # the removed positions are a prefix
            & ((removed == 0) | (last_removed < first_kept))[:, 0]  # no tie across the cut
            & ~torch.isnan(values[:, -1])  # both sorts put NaN last
        )
        processed = keep_at_least(scores, first_kept, self.filter_value)
        if not bool(exact.all()):
            redo = (~exact).nonzero(as_tuple=True)[0]
            self.fallback_rows += int(redo.numel())
            processed[redo] = self.reference(input_ids, scores[redo])  # reads only the scores
        return processed


class TopKLogitsWarper:
    """transformers' ``TopKLogitsWarper`` (keep every token whose logit is at least the k-th largest), the k-th largest
    value found with numpy's partition on a CPU instead of ``torch.topk``; the value, hence the result, is the same."""

    def __init__(self, top_k: int, filter_value: float = -float("inf"), min_tokens_to_keep: int = 1):
        from transformers.generation.logits_process import TopKLogitsWarper as Reference

        self.reference = Reference(top_k, filter_value=filter_value, min_tokens_to_keep=min_tokens_to_keep)
        self.top_k = self.reference.top_k
        self.filter_value = filter_value

    def __call__(self, input_ids, scores):
        import numpy as np
        import torch

        if scores.device.type != "cpu" or scores.dtype not in (torch.float32, torch.float64):
            return self.reference(input_ids, scores)
        top_k = min(self.top_k, scores.shape[-1])
        array = scores.detach().contiguous().numpy()
        if np.isnan(array).any():  # numpy and torch order NaN differently: let transformers decide
            return self.reference(input_ids, scores)
        kth = torch.from_numpy(np.partition(array, array.shape[-1] - top_k, axis=-1)[:, -top_k])
        return keep_at_least(scores, kth[:, None], self.filter_value)


def sampling_processors(sampling: SamplingSettings):
    """Temperature, top-k, top-p as ``generate`` would apply them for a sampling request (same order, same
    ``min_tokens_to_keep=1``), with the two warpers above. Empty for greedy decoding."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import TemperatureLogitsWarper

    processors = LogitsProcessorList()
    if sampling.temperature == 0:
        return processors
    if sampling.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        processors.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        processors.append(TopPLogitsWarper(sampling.top_p))
    return processors


class SampledLogprobs:
    """A logits processor placed after the sampling ones that records, for every row, the log-prob of the token
    sampled at each step under the processed scores it was drawn from (``log_softmax`` of what the temperature,
    top-k and top-p warpers left). A processor sees the token sampled at step t only at step t + 1 (as the last
    column of ``input_ids``), so it keeps step t's scores until then; :meth:`finish` takes the last step's from the
    output. Memory: one step's scores, and a float per row per step."""

    def __init__(self):
        self.previous = None
        self.steps: list = []

    def __call__(self, input_ids, scores):
        if self.previous is not None:
            self.steps.append(self._take(self.previous, input_ids[:, -1]))
        self.previous = scores
        return scores

    def finish(self, last_tokens):
        """(rows, steps) log-probs of the whole generation, given the tokens sampled at its last step."""
        import torch

        if self.previous is not None:
            self.steps.append(self._take(self.previous, last_tokens))
            self.previous = None
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros((len(last_tokens), 0))

    @staticmethod
    def _take(scores, tokens):
        import torch

        return torch.log_softmax(scores.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def cache_keyword() -> str:
    """The name transformers gives a KV cache, in ``generate``'s keyword arguments and in model outputs: ``cache``
    where it has renamed ``past_key_values`` (it then warns with a FutureWarning on every ``generate`` given the old
    name, and logs on every read of ``output.past_key_values``), ``past_key_values`` in the releases before. Read
    from the causal-LM output class, which carries the name of the transformers installed."""
    import dataclasses

    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


# What generate may still take from a model's generation_config.json: its special tokens and how it caches. Every
# option that shapes the distribution (suppress_tokens, bad_words_ids, sequence_bias, min_length, epsilon_cutoff,
# forced_eos_token_id, ...) is left out, so that the samples and their recorded log-probs come from exactly the
# settings the run names, as vLLM's do.
KEPT_GENERATION_OPTIONS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                           "cache_implementation", "cache_config", "use_cache")


def _without_sampling_options(own):
    """A fresh ``GenerationConfig`` with only :data:`KEPT_GENERATION_OPTIONS` of the model's own ``own``."""
    from transformers import GenerationConfig

    clean = GenerationConfig()
    for key in KEPT_GENERATION_OPTIONS:
        value = getattr(own, key, None)
        if value is not None:
            setattr(clean, key, value)
    return clean


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
        attn_implementation: str = DEFAULT_ATTENTION,
        max_model_len: int | None = None,
    ):
        from rlhf_pipeline.chat import pad_id
        from rlhf_pipeline.modeling import context_length, load_causal_lm

        self.model = load_causal_lm(model, dtype=dtype, trust_remote_code=trust_remote_code,
                                    attn_implementation=attn_implementation)
        # a prompt and its response fit in it, as vLLM's max_model_len: sampling stops there (finish reason length)
        self.context = max_model_len or (context_length(self.model.config) or (None,))[0]
        self.model.generation_config = _without_sampling_options(self.model.generation_config)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.pad_id = pad_id(tokenizer)
        self.share_prefill: bool | None = None  # decided by a probe on the first request with n > 1

    def close(self) -> None:
        self.model = None  # the weights go with the last reference

    def _generation_config(self, sampling: SamplingSettings, num_return_sequences: int | None = None):
        from transformers import GenerationConfig

        greedy = sampling.temperature == 0
        # Temperature, top-k and top-p come from sampling_processors(); these values make generate add none of its
        # own (1.0 and 0 rather than None, which generate would fill from transformers' defaults: top_k=50).
        # Greedy decoding uses none of them (None: no "flag ignored" warnings).
        return GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else 1.0,
            top_p=None if greedy else 1.0,
            top_k=None if greedy else 0,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            num_return_sequences=sampling.n if num_return_sequences is None else num_return_sequences,
            num_beams=1,
            eos_token_id=list(sampling.stop_token_ids),
            pad_token_id=self.pad_id,
        )

    def _prefix_cache(self, input_ids, attention_mask, n: int):
        """The KV cache of every prompt but its last token, computed once and repeated ``n`` times per prompt, or
        None when the model's cache is not a plain full-attention ``DynamicCache`` (sliding-window, hybrid or
        recurrent layers keep their own state, which is not worth the risk)."""
        import inspect

        from transformers.cache_utils import DynamicCache, DynamicLayer

        # Positions as generate derives them from the attention mask (pads at 0), so the cached keys match.
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        extra = {}
        if "logits_to_keep" in inspect.signature(self.model.forward).parameters:
            extra["logits_to_keep"] = 1  # the prefix's logits are never used
        out = self.model(
            input_ids=input_ids[:, :-1],
            attention_mask=attention_mask[:, :-1],
            position_ids=position_ids[:, :-1],
            use_cache=True,
            **extra,
        )
        cache = getattr(out, cache_keyword(), None)  # a model's own output class may name it otherwise
        if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
            return None
        cache.batch_repeat_interleave(n)
        return cache

    def _sample(self, input_ids, attention_mask, sampling: SamplingSettings, processors, share: bool,
                record_logits: bool = False):
        """``model.generate`` for one left-padded batch; (B * n, width + new) ids, rows of one prompt adjacent.

        ``share``: the prompt's prefill runs once per prompt instead of once per sample (generate repeats every
        prompt n times before its prefill): every prompt token but the last goes into a KV cache that is then
        repeated n times, and generate starts from the last prompt token, as it does when continuing from a cache.
        """
        import torch

        n = sampling.n
        cache = None
        if share and n > 1 and input_ids.shape[1] > 1:
            cache = self._prefix_cache(input_ids, attention_mask, n)
        config = self._generation_config(sampling, num_return_sequences=None if cache is None else 1)
        if record_logits:
            config.return_dict_in_generate = config.output_logits = True
        if cache is None:
            return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                       logits_processor=processors)
        return self.model.generate(
            input_ids=torch.repeat_interleave(input_ids, n, dim=0),
            attention_mask=torch.repeat_interleave(attention_mask, n, dim=0),
            generation_config=config,
            logits_processor=processors,
            **{cache_keyword(): cache},  # the same cache under either name: only the name changed
        )

    def _check_shared_prefill(self, input_ids, attention_mask, sampling: SamplingSettings) -> bool:
        """Greedy logits for a few steps on (up to) two prompts of the batch, with and without the shared prefill;
        the shared one is used only if they agree (and it runs at all)."""
        import dataclasses

        import torch

        rows = [0, input_ids.shape[0] - 1] if input_ids.shape[0] > 1 else [0]  # the longest and the shortest
        ids, mask = input_ids[rows], attention_mask[rows]
        keep = int(mask.sum(0).nonzero()[0])  # drop the columns that are padding in every probe row
        ids, mask = ids[:, keep:], mask[:, keep:]
        # Greedy (no random numbers drawn), 2 samples per prompt shared, against generate's own prefill of 1.
        plain_settings = dataclasses.replace(sampling, n=1, temperature=0.0, max_new_tokens=3)
        shared_settings = dataclasses.replace(plain_settings, n=2)
        try:
            with torch.no_grad():
                if self._prefix_cache(ids, mask, 2) is None:
                    return False  # not a cache this engine shares (see _prefix_cache)
                plain = self._sample(ids, mask, plain_settings, [], share=False, record_logits=True)
                shared = self._sample(ids, mask, shared_settings, [], share=True, record_logits=True)
        except Exception as e:  # a model generate cannot continue from a cache this way: don't share
            log.warning("%s: sharing the prompt prefill across samples failed (%s); prefilling per sample",
                        type(self.model).__name__, e)
            return False
        a = torch.stack(plain.logits).float().repeat_interleave(2, dim=1)  # (steps, rows * 2, V)
        b = torch.stack(shared.logits).float()
        tolerance = 1e-4 if next(self.model.parameters()).dtype in (torch.float32, torch.float64) else 3e-2
        ok = a.shape == b.shape and bool(((a - b).abs().max() / a.abs().max().clamp(min=1e-6)) <= tolerance)
        if not ok:
            log.warning("%s: logits with a shared prompt prefill differ from generate's own; prefilling per sample",
                        type(self.model).__name__)
        return ok

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings,
                 logprobs: bool = False) -> list[Completion]:
        import dataclasses

        import torch
        from transformers import LogitsProcessorList

        processors = sampling_processors(sampling)
        stop_ids = set(sampling.stop_token_ids)
        device = self.model.device
        results: list[Completion | None] = [None] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        calls = generate_calls([len(p) for p in prompts], self.batch_size)
        cut_short: list[tuple[int, int]] = []  # (prompt, sample) the call's room ended before their own
        with tqdm(total=len(prompts), desc="generate (hf)", unit="prompt") as bar:
            for batch in calls:
                width = max(len(prompts[i]) for i in batch)
                input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
                attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, i in enumerate(batch):  # left padding: the last prompt token sits at the same position
                    ids = prompts[i]
                    input_ids[row, width - len(ids) :] = torch.tensor(ids)
                    attention_mask[row, width - len(ids) :] = 1
                input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
                if self.share_prefill is None and sampling.n > 1 and width > 1:
                    self.share_prefill = self._check_shared_prefill(input_ids, attention_mask, sampling)
                # The batch's own stream: from its first prompt's request seed (alone in its batch, a prompt is
                # sampled from its own seed, as vLLM's per-request seeds): no two batches of a run, across its chunks,
                # shards and replicas, start from the same seed.
                torch.manual_seed(seeds[batch[0]])
                recorder = SampledLogprobs() if logprobs else None
                used = LogitsProcessorList([*processors, recorder]) if recorder is not None else processors
                room = None if self.context is None else self.context - width  # the call's longest prompt's
                fitted = sampling if room is None or room >= sampling.max_new_tokens else dataclasses.replace(
                    sampling, max_new_tokens=max(room, 1))
                with torch.no_grad():
                    out = self._sample(input_ids, attention_mask, fitted, used, share=bool(self.share_prefill))
                new_tokens = out[:, width:].tolist()  # (B * n, T), rows of one prompt are adjacent
                sampled = recorder.finish(out[:, -1]).tolist() if recorder is not None else None
                for row, i in enumerate(batch):
                    rows = range(row * sampling.n, (row + 1) * sampling.n)
                    cut = [cut_at_stop(new_tokens[r], stop_ids) for r in rows]
                    token_ids = [c[0] for c in cut]
                    results[i] = Completion(
                        texts=self.tokenizer.batch_decode(token_ids, skip_special_tokens=True),
                        token_ids=token_ids,
                        finish_reasons=[c[1] for c in cut],
                        logprobs=None if sampled is None else [sampled[r][: len(t)] for r, t in zip(rows, token_ids)],
                    )
                    cut_short += [(i, k) for k, (ids, reason) in enumerate(cut) if reason == "length"
                                  and len(ids) < self._own_room(prompts[i], sampling)]
                bar.update(len(batch))
        if cut_short:
            self._continue(prompts, seeds, sampling, processors, stop_ids, results, cut_short, logprobs)
        return results  # type: ignore[return-value]

    def _own_room(self, prompt: list[int], sampling: SamplingSettings) -> int:
        """The most new tokens a response to ``prompt`` may have: --max-new-tokens, and the room to the context."""
        return sampling.max_new_tokens if self.context is None else min(sampling.max_new_tokens,
                                                                        self.context - len(prompt))

    def _continue(self, prompts, seeds, sampling: SamplingSettings, processors, stop_ids: set[int], results: list,
                  cut_short: list, logprobs: bool) -> None:
        """Continue the samples that a call stopped at its longest prompt's room to the context, short of their own
        (as vLLM gives each request its own room), from where they stopped: sampling is token by token, so the
        continuation is the same model's continuation of that prefix. Sequences of one length share a call, whose
        room is then every row's own; each is cut at its own --max-new-tokens."""
        import dataclasses

        import torch
        from transformers import LogitsProcessorList

        by_length: dict[int, list[tuple[int, int]]] = {}
        for i, k in cut_short:
            by_length.setdefault(len(prompts[i]) + len(results[i].token_ids[k]), []).append((i, k))
        for length in sorted(by_length, reverse=True):
            members = by_length[length]
            for start in range(0, len(members), self.batch_size * sampling.n):
                part = members[start : start + self.batch_size * sampling.n]
                left = [self._own_room(prompts[i], sampling) - len(results[i].token_ids[k]) for i, k in part]
                input_ids = torch.tensor([prompts[i] + results[i].token_ids[k] for i, k in part],
                                         device=self.model.device)
                i0, k0 = part[0]  # a stream of its own, from the first sample's request seed and index
                torch.manual_seed((seeds[i0] * 1_000_003 + k0 + 1) % 2**63)
                recorder = SampledLogprobs() if logprobs else None
                used = LogitsProcessorList([*processors, recorder]) if recorder is not None else processors
                more = dataclasses.replace(sampling, n=1, max_new_tokens=max(left))
                with torch.no_grad():
                    out = self._sample(input_ids, torch.ones_like(input_ids), more, used, share=False)
                new_tokens = out[:, length:].tolist()
                sampled = recorder.finish(out[:, -1]).tolist() if recorder is not None else None
                for row, ((i, k), room) in enumerate(zip(part, left)):
                    ids, reason = cut_at_stop(new_tokens[row][:room], stop_ids)
                    done = results[i]
                    done.token_ids[k] = done.token_ids[k] + ids
                    done.finish_reasons[k] = reason
                    done.texts[k] = self.tokenizer.decode(done.token_ids[k], skip_special_tokens=True)
                    if sampled is not None:
                        done.logprobs[k] = done.logprobs[k] + sampled[row][: len(ids)]
