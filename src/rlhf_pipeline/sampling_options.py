"""The sampling and engine options that ``rlhf generate`` and ``rlhf eval`` share, declared and checked once.

``GenerateConfig`` and ``EvalConfig`` inherit :class:`SamplingOptions`, so both take the same flags with the same
help, and a bad combination (``--temperature 0 --n 2``) fails when the flags are parsed, before anything is
written, with the same one-line error in both stages. Eval hands its values to generate with
``config.options_of(config, SamplingOptions)``; a stage that needs another default changes only that with
``config.override`` (eval samples one response per prompt unless told otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from rlhf_pipeline.attention import DEFAULT_ATTENTION, AttnImplementation, attn_help, check_engine
from rlhf_pipeline.config import DtypeName, option, trust_remote_code_option


# vLLM's memory defaults (engines.vllm.engine_memory_args): the fraction of a GPU it takes, and on its CPU backend a
# fixed KV cache in GiB instead (VLLM_CPU_KVCACHE_SPACE, when set, wins)
GPU_MEMORY_UTILIZATION = 0.9
CPU_KV_CACHE_GIB = 4


@dataclass(kw_only=True)
class SamplingOptions:
    """How responses are sampled (``engines.SamplingSettings``), from which prompts, and the engine that samples."""

    options_group: ClassVar[str] = "sampling and engine options"

    n: int = option(5, help="Responses sampled per prompt, in one request.")
    temperature: float = option(0.8, help="Sampling temperature (0 = greedy, needs --n 1).")
    top_p: float = option(0.9, help="Nucleus sampling: keep the smallest token set with this probability mass.")
    top_k: int = option(0, help="Keep the k most likely tokens; 0 turns top-k off (both engines).")
    max_new_tokens: int = option(2048, help="Maximum tokens per response; longer samples end with 'length'.")
    seed: int = option(0, help="Random seed; the same seed gives the same output.")
    engine: Literal["auto", "hf", "vllm"] = option(
        "auto", help="auto: vLLM when it imports and a GPU is present, else Hugging Face generate."
    )
    limit: Optional[int] = option(None, help="Use only the first LIMIT prompts.")
    prompt_column: Optional[str] = option(
        None, help="The prompts' column, when it is named otherwise (e.g. question): text, or a list of {role, "
        "content} turns (ShareGPT's {from, value} turns too); read as 'prompt' or 'messages' and written under that "
        "name. Default: prompt, else messages.")
    batch_size: int = option(16, help="hf engine: prompts per generate call (each expands to n sequences).")
    dtype: DtypeName = option(
        "auto", help="Model dtype; auto = bfloat16 on a GPU that supports it, float32 on a CPU."
    )
    attn_implementation: AttnImplementation = option(
        DEFAULT_ATTENTION, help=attn_help("hf engine: the model's", "vLLM picks its own."), semantic=False
    )
    tensor_parallel_size: int = option(1, help="vllm engine: GPUs per model (tensor parallelism).")
    gpu_memory_utilization: Optional[float] = option(
        None,
        help=f"vllm engine: fraction of GPU memory vLLM may use (default {GPU_MEMORY_UTILIZATION}). On vLLM's CPU "
        "backend it is the fraction of the machine's memory to reserve, so there the default is a fixed KV cache "
        f"instead (VLLM_CPU_KVCACHE_SPACE GiB, {CPU_KV_CACHE_GIB} if unset).",
        semantic=False,
    )
    max_model_len: Optional[int] = option(
        None, help="Context length, a prompt and its response (default: the model's): vLLM's max_model_len; the hf "
        "engine stops sampling there too.")
    trust_remote_code: bool = trust_remote_code_option()
    # Where the engines run (executors.py). None of these changes the output: N replicas on N shards write what the
    # --shard i/N runs merged would, which with per-prompt seeds (vLLM) is what one local engine writes.
    executor: Literal["local", "ray"] = option(
        "local",
        help="local: one engine in this process. ray: --replicas engines on a Ray cluster (pip install "
        "'rlhf-pipeline[ray]'), each on a contiguous shard of the prompts; one output, as --shard i/N + rlhf merge.",
        semantic=False,
    )
    replicas: int = option(1, help="--executor ray: engine replicas, one shard of the prompts each.", semantic=False)
    gpus_per_replica: int = option(
        0,
        help="--executor ray: GPUs each replica reserves (0: a CPU replica); with the vllm engine also its "
        "--tensor-parallel-size.",
        semantic=False,
    )
    ray_address: Optional[str] = option(
        None,
        help="--executor ray: the cluster to join (as `ray start --address` prints, e.g. HEAD:6379, or auto); "
        "default: start a local Ray for this run and stop it after.",
        semantic=False,
    )

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("--n must be at least 1")
        if self.temperature < 0:
            raise ValueError("--temperature must be >= 0")
        if self.temperature == 0 and self.n > 1:
            raise ValueError("--temperature 0 (greedy) gives n identical samples; use --n 1 or a temperature > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("--top-p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("--top-k must be >= 0 (0 turns top-k off)")
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be at least 1")
        if self.batch_size < 1:
            raise ValueError("--batch-size must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be at least 1")
        check_engine(self.attn_implementation, self.engine, error=ValueError)  # auto: checked once resolved
        if self.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if self.gpus_per_replica < 0:
            raise ValueError("--gpus-per-replica must be >= 0 (0: CPU replicas)")
        if self.executor != "ray":
            given = [flag for flag, value, default in (("--replicas", self.replicas, 1),
                                                       ("--gpus-per-replica", self.gpus_per_replica, 0),
                                                       ("--ray-address", self.ray_address, None)) if value != default]
            if given:
                raise ValueError(f"{', '.join(given)}: only with --executor ray (add it, or drop the flag)")
        elif self.gpus_per_replica > 1:
            if self.engine == "hf":
                raise ValueError(f"--gpus-per-replica {self.gpus_per_replica}: the hf engine runs on one GPU; use "
                                 "--engine vllm for tensor-parallel replicas, or --gpus-per-replica 1")
            # A replica's K GPUs are its vLLM engine's tensor-parallel group: one flag says it.
            if self.tensor_parallel_size == 1:
                self.tensor_parallel_size = self.gpus_per_replica
            elif self.tensor_parallel_size != self.gpus_per_replica:
                raise ValueError(
                    f"--gpus-per-replica {self.gpus_per_replica} is each replica's tensor-parallel size; "
                    f"--tensor-parallel-size {self.tensor_parallel_size} disagrees: drop it or make it equal"
                )
