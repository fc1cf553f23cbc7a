"""A run of iterative RLHF (``rlhf iterate``, ``rlhf demo``): its layout, its plan of stage processes, launch and resume.

T rounds of generate -> score -> filter -> train, the policy of round t sampling round t+1.

    rlhf iterate --config run.yaml
    rlhf iterate --config run.yaml --iterations 5          # flags override the file

Layout of the run directory (``output``)::

    RUN/iterate.json                 the resolved config of the latest invocation
    RUN/steps.jsonl                  one line per launched stage: name, command, exit status, wall time
    RUN/iter_0/eval/                 the starting policy evaluated (when eval_prompts is set)
    RUN/iter_<t>/generate|score|filter|train|eval/    t = 1..T

Iteration t samples with policy t-1 (``model`` for t = 1, else ``RUN/iter_<t-1>/train``), scores the samples, builds
pairs (or, for the PPO family, groups; for KTO, unpaired responses) with policy t-1's tokenizer, trains policy t
from policy t-1 (the PPO family with its KL to ``model`` by default, PPO with the critic of iteration t-1) and, when
``eval_prompts`` is set, evaluates policy t against the starting policy (``rlhf eval --baseline RUN/iter_0/eval``).
Prompts: every iteration uses all of ``prompts``, or with ``prompts_per_iteration: k`` iteration t takes the k rows
starting at row ``(t-1)*k`` (modulo the number of rows; a chunk that runs past the last row goes on from the first,
``rlhf generate --wrap``, each row once at most). Generation seed of iteration
t: ``generate.seed + t - 1``, so iterations do not repeat each other's samples.

Each stage runs as its own process, ``LAUNCHER -m rlhf_pipeline.stages.<stage> ARGS``, where the launcher is a
command prefix that behaves like ``python``: the current interpreter by default, or per stage for example
``conda run --no-capture-output -n rlhf-vllm python`` for generate,
``accelerate launch --config_file accelerate_cfgs/zero3.yaml`` for train, and
``accelerate launch --multi_gpu --num_processes 8`` for score and eval (data parallel, each process the whole reward
model; no DeepSpeed config there).

Resuming: a stage whose output holds a finished run with the same config and inputs is not launched again (the
check is the stages' own manifest check), so after a crash or Ctrl-C the same command continues at the first
incomplete stage. Training stages are always launched with ``--resume``, so an interrupted training run
continues from its newest checkpoint (``train: {save_every: N}``). A changed config is refused unless
``--overwrite`` is given, in which case only the stages whose config changed are redone.

The Hub: ``push_to_hub: ORG/NAME`` gives the run one dataset repo and one model repo, both ``ORG/NAME``. Every
dataset stage of iteration t (generate, score, filter, eval's samples) goes to the dataset repo's configuration
``iter<t>-<stage>`` (``rlhf <stage> --push-to-hub ORG/NAME --hub-config iter<t>-<stage>``), its manifest to
``manifests/iter<t>-<stage>.json`` there; iteration t's policy goes to the model repo's branch ``iter<t>-train``, its
manifest beside it. ``private: true`` creates both repos private. With ``--resume`` a stage whose output is missing
here but whose manifest on the Hub records the same config and inputs counts as finished: the run goes on from the
Hub (on another machine, or after the run directory was lost), and pulls such an output into its place only when a
stage that is launched reads it (evaluations are not taken from the Hub: one whose output is missing runs again).

Every stage's options are checked before anything is launched, so a misspelt option fails in seconds, not after
the first hour of generation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import logging
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from rlhf_pipeline.algorithms import GROUPS, PAIRS, AlgoName, get, help_text
from rlhf_pipeline.attention import DEFAULT_ATTENTION, AttnImplementation
from rlhf_pipeline.config import DATASET_REF, ChatTemplateOptions, ControlTokenOptions, OutputOptions, option
from rlhf_pipeline.errors import PipelineError, one_line, redact, redact_env
from rlhf_pipeline.layout import (CRITIC, ITERATE_CONFIG, ITERATION_STAGES, MANIFEST, RUN_LOCK, STEPS_LOG,
                                  iteration_dir, step_name)
from rlhf_pipeline.machine import RUN_PID, adopt_orphans, die_with_parent, gpus_visible, run_identity
from rlhf_pipeline.sampling_options import SamplingOptions
from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.stages.score import SOURCE_KINDS, as_list, one_or_list
from rlhf_pipeline.training.checkpoints import remove_leftover_checkpoints

log = logging.getLogger(__name__)

STAGE_SECTIONS = ITERATION_STAGES
TRAINING_STAGES = ("train", "sft", "train-rm")
# The config fields that name each stage's input datasets, in the order the stage records them (their fingerprints are
# part of the reuse check): the first is the main input; eval's reference answers, when set, come after its prompts.
INPUT_FIELDS = {"generate": ("prompts",), "score": ("input",), "filter": ("input",), "train": ("data",),
                "eval": ("prompts", "reference"), "sft": ("data",), "train-rm": ("data",), "ref-logps": ("input",)}
# Options that iterate sets itself; a stage section may not set them.
RESERVED = {
    "generate": {"model", "prompts", "output", "offset", "limit", "wrap", "shard"},
    "score": {"input", "output", *SOURCE_KINDS},
    "filter": {"input", "output", "tokenizer"},
    "train": {"model", "data", "output", "algo", "resume"},
    "eval": {"model", "prompts", "output", "baseline"},
}
COMMON = {"overwrite", "push_to_hub", "hub_config", "private"}
# The stages whose outputs a run with --resume takes from the Hub (a model for the training stage).
HUB_STAGES = ("generate", "score", "filter", "train")
# An overlapped run's two sides: each runs one stage at a time, beside the other (see IterateConfig.overlap)
SAMPLE_LANE, TRAIN_LANE = "sample", "train"
LANES = (SAMPLE_LANE, TRAIN_LANE)


@dataclass(kw_only=True)
class IterateConfig(ChatTemplateOptions, ControlTokenOptions, OutputOptions):
    """T iterations of generate -> score -> filter -> train (and eval), each stage its own process, resumable."""

    output: str = option(help="The run directory: outputs go to RUN/iter_<t>/<stage>/.", semantic=False)
    push_to_hub: Optional[str] = option(
        None, help="The run's Hub repos, ORG/NAME: every stage's dataset goes to the dataset repo ORG/NAME as the "
        "configuration iter<t>-<stage> (its manifest as manifests/iter<t>-<stage>.json), every iteration's policy "
        "to the model repo ORG/NAME as the branch iter<t>-train.",
        semantic=False,
    )
    hub_config: Optional[str] = option(
        None, help="Not for rlhf iterate, which names each stage's place in push_to_hub's repos itself "
        "(iter<t>-<stage>).", semantic=False,
    )
    resume: bool = option(
        False, help="Also take finished stages from push_to_hub's repos: a stage whose output is missing here but "
        "whose manifest there records the same config and inputs counts as finished, and is pulled when a launched "
        "stage reads it. (A run resumes from its own finished outputs without it.)", semantic=False,
    )
    model: str = option(help="The policy of iteration 0 (it samples iteration 1): a local directory or a Hub id.")
    prompts: str = option(help=f"Training prompts: {DATASET_REF}.")
    iterations: int = option(3, help="Number of iterations T.")
    prompts_per_iteration: Optional[int] = option(
        None, help="Iteration t takes this many prompts starting at row (t-1)*k (wrapping); default: all of them."
    )
    algo: AlgoName = option(
        "rebel", help=f"The training algorithm (rlhf train --algo): {help_text()}. The filter mode is the "
        "algorithm's kind of data (plus the filter options it asks for, such as DAPO's); the PPO family's KL "
        "reference defaults to `model`; a critic (PPO's) starts from the reward model (without one, from `model` with "
        "a new value head) and carries over from one iteration to the next."
    )
    reward_model: Optional[str] = option(None, help="Reward model that scores the samples.")
    # One function is kept as a plain string, as before several existed (as rlhf score's --reward-fn).
    reward_fn: Optional[list[str]] = option(
        None, help="And/or a python reward function (module:function or file.py:function), or several; with two "
        "or more sources, rlhf score combines them (GDPO keeps each source's own rewards)."
    )
    eval_prompts: Optional[str] = option(
        None, help=f"Held-out prompts ({DATASET_REF}): when set, the starting policy and every iteration's policy are "
        "evaluated."
    )
    lm_eval: Optional[list[str]] = option(
        None, help="With eval_prompts: every evaluation also runs these lm-eval tasks (rlhf eval --lm-eval; names, "
        "YAML task files or directories, comma-separated or a list); rlhf report shows them per iteration."
    )
    attn_implementation: AttnImplementation = option(
        DEFAULT_ATTENTION, help="The attention implementation (--attn-implementation) of every stage that loads a model "
        "with transformers: train, score, and generate and eval where their section says engine: hf (vLLM picks its "
        "own, and engine auto may be vLLM); a section's own attn_implementation wins.", semantic=False,
    )
    overlap: int = option(
        0, help="1: overlapped iterations. While iteration t trains, iteration t+1 generates, scores and filters with "
        "the newest finished policy, one behind (pi_{t-1} where a sequential run samples with pi_t), on its own "
        "resources (lane_env); iteration t+1 then trains pi_t on those samples, each algorithm correcting as the "
        "registry declares (REBEL, the DPO family and KTO take the sampler as their reference; the PPO family weighs "
        "by the stored sampler log-probs). 0: sequential.",
    )
    lane_env: dict = option(
        default_factory=dict,
        help="With overlap 1: environment variables of each side's stage processes, {sample: {...}, train: {...}} "
        "(sample = generate, score, filter and eval; train = train), e.g. {sample: {CUDA_VISIBLE_DEVICES: '0,1,2,3'}, "
        "train: {CUDA_VISIBLE_DEVICES: '4,5,6,7'}}, or on a CPU {sample: {OMP_NUM_THREADS: 1}, train: "
        "{OMP_NUM_THREADS: 1}}.", semantic=False,
    )
    launchers: dict = option(
        default_factory=dict,
        help="Per-stage command prefix that behaves like python, e.g. {generate: conda run -n rlhf-vllm python, "
        "train: accelerate launch --config_file accelerate_cfgs/zero3.yaml, score: accelerate launch --multi_gpu "
        "--num_processes 8} (score and eval run data-parallel under accelerate launch, without a DeepSpeed config); "
        "default: this interpreter.",
    )
    generate: dict = option(default_factory=dict, help="Options of rlhf generate, e.g. {n: 5, temperature: 0.8, engine: vllm}.")
    score: dict = option(default_factory=dict, help="Options of rlhf score, e.g. {batch_size: 8, trust_remote_code: true}.")
    filter: dict = option(default_factory=dict, help="Options of rlhf filter, e.g. {max_response_tokens: 2048, test_size: 1000}.")
    train: dict = option(default_factory=dict, help="Options of rlhf train, e.g. {eta: 1e6, learning_rate: 3e-7, save_every: 100}.")
    eval: dict = option(
        default_factory=dict,
        help="Options of rlhf eval. Its scorers default to the training reward, read with the score section's "
        "trust_remote_code, max_length and reference_column; with several sources, reward_weights here reports "
        "their combination too.",
    )

    def __post_init__(self) -> None:
        if self.hub_config is not None:
            raise ValueError(f"hub_config {self.hub_config}: rlhf iterate names each stage's place in push_to_hub's "
                             "repos itself (iter<t>-<stage>); remove it")
        if self.push_to_hub:
            from rlhf_pipeline.datasets_io import repo_id_error

            error = repo_id_error(self.push_to_hub, "push_to_hub")
            if error:
                raise ValueError(error)
        if self.resume and not self.push_to_hub:
            raise ValueError("resume takes finished stages from push_to_hub's repos: set push_to_hub too (a run "
                             "resumes from its own finished outputs without resume)")
        if self.private and not self.push_to_hub:
            raise ValueError("private: set push_to_hub too (private creates push_to_hub's repos private)")
        self.reward_fn = one_or_list(self.reward_fn)
        if self.reward_model is None and self.reward_fn is None:
            raise ValueError("give reward_model, reward_fn, or both (rlhf score then combines the two; set their "
                             "weights with score: {reward_weights: [...]})")
        if self.iterations < 1:
            raise ValueError("iterations must be at least 1")
        if self.prompts_per_iteration is not None and self.prompts_per_iteration < 1:
            raise ValueError("prompts_per_iteration must be at least 1")
        if self.overlap not in (0, 1):
            raise ValueError(f"overlap {self.overlap}: 0 (sequential) or 1 (sampling one policy behind)")
        if self.lane_env and not self.overlap:
            raise ValueError("lane_env sets each side's environment of an overlapped run: set overlap 1 too")
        unknown = sorted(set(self.lane_env) - set(LANES))
        if unknown:
            raise ValueError(f"lane_env: unknown side(s) {', '.join(map(str, unknown))}; the sides are "
                             f"{', '.join(LANES)}")
        for lane, env in self.lane_env.items():
            if not isinstance(env, dict) or not all(isinstance(v, (str, int, float)) for v in env.values()):
                raise ValueError(f"lane_env: {lane} is {env!r}; give each side a mapping of variables to values, "
                                 f"e.g. {{{lane}: {{CUDA_VISIBLE_DEVICES: '0,1'}}}}")
        for stage, spec in self.launchers.items():
            if not (isinstance(spec, str) or isinstance(spec, list) and all(isinstance(w, str) for w in spec)):
                raise ValueError(f"launchers: {stage} is {spec!r}; give a command, as a string or a list of words, "
                                 "e.g. {train: accelerate launch --num_processes 8}")
        reason = get(self.algo).refuses_stale_sampler if self.overlap else ""
        if reason:
            raise ValueError(f"overlap 1: --algo {self.algo} needs samples of the policy it trains ({reason}); "
                             "run it with overlap 0")
        from rlhf_pipeline.harness import parse_tasks

        self.lm_eval = parse_tasks(self.lm_eval)
        if self.lm_eval and not self.eval_prompts:
            raise ValueError("lm_eval runs in every iteration's rlhf eval: set eval_prompts too")


# ----------------------------------------------------------------------------------------------------------------
# Steps


@dataclass
class Step:
    """One stage run: ``LAUNCHER -m MODULE ARGS`` writing ``output``, launched once the steps named in ``after`` have
    finished (None: every step listed before it, a sequential run), one step at a time per ``lane``, with ``env``
    added to its environment."""

    name: str  # e.g. "iter_2/train"
    stage: str  # a key of stage_configs()
    args: list[str]
    output: Path
    launcher: list[str] = field(default_factory=lambda: [sys.executable])
    after: Optional[list[str]] = None
    lane: str = "main"
    env: dict[str, str] = field(default_factory=dict)

    @property
    def command(self) -> list[str]:
        return [*self.launcher, "-m", stage_configs()[self.stage].__module__, *self.args]


def option_args(options: dict[str, Any]) -> list[str]:
    """``{max_new_tokens: 64, bf16: true, top_k: null}`` -> ``['--max-new-tokens', '64', '--bf16']``."""
    args: list[str] = []
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None:
            continue
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            args += [flag, *map(str, value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def _section(options: dict[str, Any], stage: str, allowed_extra: set[str] = frozenset()) -> dict[str, Any]:
    options = {str(k).replace("-", "_"): v for k, v in (options or {}).items()}
    clash = sorted(k for k in options if k in (RESERVED.get(stage, set()) | COMMON) and k not in allowed_extra)
    if clash:
        raise PipelineError(
            f"run config: the {stage} section sets {', '.join(clash)}, which iterate sets itself; remove "
            f"{'it' if len(clash) == 1 else 'them'} (use the top-level options: model, prompts, output, ...)"
        )
    return options


def _launcher(config: IterateConfig, stage: str) -> list[str]:
    spec = config.launchers.get(stage)
    if not spec:
        return [sys.executable]
    return list(spec) if isinstance(spec, list) else shlex.split(spec)


def hub_config_name(name: str) -> str:
    """A step's place in the run's Hub repos: ``iter_2/score`` -> ``iter2-score``."""
    return name.replace("/", "-").replace("_", "")


def _common(config: IterateConfig, name: str) -> list[str]:
    args = ["--overwrite"] if config.overwrite else []
    if config.push_to_hub:
        args += ["--push-to-hub", config.push_to_hub, "--hub-config", hub_config_name(name)]
        if config.private:
            args.append("--private")
    return args


def default_engine(stage: str) -> str:
    """The engine a stage uses when its section names none: its config's default (hf for a stage without one, which
    loads its models with transformers)."""
    engine = {f.name: f for f in dataclasses.fields(stage_configs()[stage])}.get("engine")
    return "hf" if engine is None else engine.default


def _attention(config: IterateConfig, stage: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the run's ``attn_implementation`` where it applies: a stage that loads its model with
    transformers (the hf engine), and whose section does not set its own."""
    if (config.attn_implementation == DEFAULT_ATTENTION or "attn_implementation" in options
            or options.get("engine", default_engine(stage)) != "hf"):
        return options
    return {**options, "attn_implementation": config.attn_implementation}


def count_prompts(config: IterateConfig) -> int | None:
    """Rows of the training prompts, when iterations take chunks of them (the chunk offsets wrap around it)."""
    if config.prompts_per_iteration is None:
        return None
    from rlhf_pipeline.datasets_io import load_dataset_ref, parse_ref

    return load_dataset_ref(parse_ref(config.prompts)).num_rows


def eval_step(config: IterateConfig, run: Path, t: int, model: str) -> Step:
    """``rlhf eval`` of policy t against the starting policy's evaluation (iteration 0: against itself)."""
    options = _section(config.eval, "eval", allowed_extra=set(SOURCE_KINDS))
    if "reward_model" not in options and "reward_fn" not in options:
        options.update(reward_model=config.reward_model, reward_fn=config.reward_fn)
        # the training reward, read as the score stage reads it (ArmoRM needs trust_remote_code; a verifiable
        # reward function its reference column)
        for key in ("trust_remote_code", "max_length", "reference_column"):
            if key in config.score and key not in options:
                options[key] = config.score[key]
    if config.allow_special_tokens_in_text:  # the run's opt-out, unless the eval section says otherwise
        options.setdefault("allow_special_tokens_in_text", True)
    if config.chat_template is not None:  # the run's template, unless the eval section names its own
        options.setdefault("chat_template", config.chat_template)
    if config.lm_eval and "lm_eval" not in options:  # the eval section's own lm_eval wins
        options["lm_eval"] = config.lm_eval
    options = _attention(config, "eval", options)
    baseline = model if t == 0 else str(iteration_dir(run, 0) / "eval")
    name = step_name(t, "eval")
    output = iteration_dir(run, t) / "eval"
    args = ["--model", model, "--prompts", config.eval_prompts, "--baseline", baseline, "--output", str(output),
            *option_args(options), *_common(config, name)]
    return Step(name, "eval", args, output, _launcher(config, "eval"))


def check_plan(config: IterateConfig, sections: dict[str, dict[str, Any]]) -> None:
    """The whole plan against what the algorithm's training will need, as the registry declares it (its kind of
    data, its reward sources, its reference), before any stage runs: one line per problem. (Options the algorithm
    does not read, ``critic_model`` included, are refused when :func:`check` parses train's options.)"""
    algorithm = get(config.algo)
    problems = []
    mode = sections["filter"].get("mode", algorithm.data)
    if mode != algorithm.data:
        problems.append(f"--algo {config.algo} trains on {algorithm.data}; remove filter mode {mode!r}")
    sources = (config.reward_model is not None) + len(as_list(config.reward_fn))
    if getattr(algorithm, "reward_sources", False) and sources < 2:
        problems.append(f"--algo {config.algo} normalises each reward source within its group, and this run scores "
                        "with one; give two or more (reward_model and reward_fn, or several reward_fn)")
    n = sections["generate"].get("n", SamplingOptions.n)
    if isinstance(n, int) and n < 2 and (algorithm.data != GROUPS or algorithm.compares_within_group):
        problems.append(f"--algo {config.algo} learns by comparing the responses to a prompt, and generate samples "
                        f"n={n}; give n 2 or more (4 or more for a group baseline)")
    if getattr(algorithm, "sampler_reference", False) and sections["train"].get("ref_model") is not None:
        problems.append(f"--algo {config.algo}'s reference is the policy that sampled each iteration's data, which "
                        "iterate passes itself (as train's --model, or with overlap 1 as its --ref-model); remove "
                        "ref_model from the train section")
    if problems:
        raise PipelineError("\n".join(f"run config: {p}" for p in problems))
    if config.overlap and gpus_visible() and sides_share_gpus(config.lane_env):
        log.warning("overlap 1: the sampling side (generate, score, eval) and the training side see the same GPUs; "
                    "vLLM reserves most of a GPU's memory and a training process beside it runs out. Give each side "
                    "its own with lane_env, e.g. {sample: {CUDA_VISIBLE_DEVICES: '0,1,2,3'}, train: "
                    "{CUDA_VISIBLE_DEVICES: '4,5,6,7'}}")


def sides_share_gpus(lane_env: dict) -> bool:
    """Whether the two sides of an overlapped run may use a GPU in common: a side without CUDA_VISIBLE_DEVICES in
    its ``lane_env`` sees every GPU."""
    def devices(lane: str) -> Optional[set[str]]:
        value = (lane_env.get(lane) or {}).get("CUDA_VISIBLE_DEVICES")
        return None if value is None else {d.strip() for d in str(value).split(",") if d.strip()}

    sample, train = devices(SAMPLE_LANE), devices(TRAIN_LANE)
    if sample is None or train is None:
        other = train if sample is None else sample
        return other is None or bool(other)
    return bool(sample & train)


def plan(config: IterateConfig, num_prompts: int | None = None) -> list[Step]:
    """Every stage run of the whole loop, in order (:func:`check_plan` first)."""
    run = Path(config.output).expanduser()
    sections = {s: _section(getattr(config, s), s) for s in ("generate", "score", "filter", "train")}
    check_plan(config, sections)
    _section(config.eval, "eval", allowed_extra=set(SOURCE_KINDS))
    if not config.eval_prompts and (config.eval or "eval" in config.launchers):  # a recipe's, for when it is set
        log.warning("the eval section and launchers.eval are not used: every iteration's rlhf eval runs only with "
                    "eval_prompts")
    unknown = sorted(set(config.launchers) - set(STAGE_SECTIONS))
    if unknown:
        raise PipelineError(f"run config: launchers for unknown stage(s) {', '.join(unknown)}; "
                            f"stages are {', '.join(STAGE_SECTIONS)}")
    steps: list[Step] = []
    if config.eval_prompts:
        steps.append(eval_step(config, run, 0, config.model))
    policies = [config.model]  # policies[t]: the policy iteration t trains (t = 0: the starting one)
    # the run's text options, for every stage that renders text, unless its section says otherwise
    for key in ("allow_special_tokens_in_text", "chat_template"):
        if getattr(config, key) not in (None, False):
            for stage in ("generate", "score", "filter"):
                sections[stage].setdefault(key, getattr(config, key))
    base_seed = sections["generate"].pop("seed", None) or 0  # iteration t samples with base_seed + t - 1
    if isinstance(base_seed, bool) or not isinstance(base_seed, int):
        raise PipelineError(f"run config: generate seed {base_seed!r}: give a whole number (iteration t samples with "
                            "seed + t - 1)")
    if config.prompts_per_iteration is not None and num_prompts is not None and \
            config.prompts_per_iteration > num_prompts:
        raise PipelineError(f"prompts_per_iteration {config.prompts_per_iteration} is more than the {num_prompts} "
                            f"prompts of {config.prompts}; give at most {num_prompts}, or leave it out to take all of "
                            "them every iteration")
    algorithm = get(config.algo)
    if algorithm.data != PAIRS:  # groups, unpaired (KTO): the filter mode is the algorithm's kind of data
        sections["filter"]["mode"] = algorithm.data
    if algorithm.data == GROUPS:
        sections["train"].setdefault("ref_model", config.model)
    for key, value in algorithm.filter.items():  # the algorithm's filter options (DAPO's), unless set in the config
        sections["filter"].setdefault(key, value)
    # PPO's critic starts from the reward model, else (a python reward) from the policy, and then carries over (given
    # to an algorithm without a critic, the option stays in train's options, which refuse it)
    critic = ((sections["train"].pop("critic_model", None) if algorithm.uses_critic else None) or config.reward_model
              or config.model)
    evals: list[Step] = []
    for t in range(1, config.iterations + 1):
        it = iteration_dir(run, t)
        policy = policies[t - 1]  # what iteration t trains from
        sampler = policies[max(t - 1 - config.overlap, 0)]  # what samples it: overlapped, one policy behind
        gen_opts = dict(sections["generate"], seed=base_seed + t - 1)
        if config.prompts_per_iteration is not None:
            k = config.prompts_per_iteration
            offset = ((t - 1) * k) % num_prompts
            gen_opts.update(offset=offset, limit=k)
            if offset + k > num_prompts:  # only a chunk that runs past the last row: the others' configs as before
                gen_opts["wrap"] = True
        reward = {"reward_model": config.reward_model, "reward_fn": config.reward_fn}
        train_opts = dict(sections["train"])
        if algorithm.uses_critic:
            train_opts["critic_model"] = critic
        if sampler != policy and algorithm.data != GROUPS and algorithm.needs_reference:
            # REBEL, the DPO family, KTO: the policy that sampled the data is the reference (the PPO family keeps
            # its KL reference and weighs by the sampler's stored log-probs instead)
            train_opts.setdefault("ref_model", sampler)
        specs = [
            ("generate", ["--model", sampler, "--prompts", config.prompts], _attention(config, "generate", gen_opts)),
            ("score", ["--input", str(it / "generate"), *option_args(reward)],
             _attention(config, "score", sections["score"])),
            ("filter", ["--input", str(it / "score"), "--tokenizer", sampler], sections["filter"]),
            ("train", ["--model", policy, "--data", str(it / "filter"), "--algo", config.algo, "--resume"],
             _attention(config, "train", train_opts)),
        ]
        for stage, fixed, options in specs:
            name = step_name(t, stage)
            args = [*fixed, "--output", str(it / stage), *option_args(options), *_common(config, name)]
            steps.append(Step(name, stage, args, it / stage, _launcher(config, stage)))
        policies.append(str(it / "train"))
        critic = str(it / "train" / CRITIC)  # PPO: the next iteration's critic is this one's
        if config.eval_prompts:
            evals.append(eval_step(config, run, t, policies[t]))
            if not config.overlap:
                steps.append(evals.pop())
            elif t > 1:  # overlapped: policy t-1 is evaluated once iteration t has its samples, before t+1 samples
                steps.append(evals.pop(0))
    steps += evals
    return with_dependencies(steps, config.lane_env) if config.overlap else steps


def with_dependencies(steps: Sequence[Step], lane_env: Optional[dict] = None) -> list[Step]:
    """The steps of an overlapped run: each waits for the earlier steps whose output it reads (an output directory
    named in its arguments, or a path inside one) and for the step before it on its side, training stages on one
    side and the others on the other (``lane_env`` gives each side its environment)."""
    out: list[Step] = []
    last_on: dict[str, str] = {}
    for step in steps:
        lane = TRAIN_LANE if step.stage in TRAINING_STAGES else SAMPLE_LANE
        paths = [Path(a) for a in step.args if a.startswith(("/", ".")) or "/" in a]
        reads = [s.name for s in out
                 if any(p == s.output or s.output in p.parents for p in paths) and s.output != step.output]
        after = list(dict.fromkeys(reads + ([last_on[lane]] if lane in last_on else [])))
        env = {str(k): str(v) for k, v in ((lane_env or {}).get(lane) or {}).items()}
        out.append(dataclasses.replace(step, after=after, lane=lane, env=env))
        last_on[lane] = step.name
    return out


# ----------------------------------------------------------------------------------------------------------------
# Running


def stage_configs() -> dict[str, type]:
    """The stages a run launches, by ``rlhf`` name: their config classes, whose modules are what ``-m`` runs."""
    from rlhf_pipeline.stages.eval import EvalConfig
    from rlhf_pipeline.stages.filter import FilterConfig
    from rlhf_pipeline.stages.generate import GenerateConfig
    from rlhf_pipeline.stages.score import ScoreConfig
    from rlhf_pipeline.stages.sft import SFTConfig
    from rlhf_pipeline.stages.train import TrainConfig
    from rlhf_pipeline.stages.train_rm import TrainRMConfig

    return {"generate": GenerateConfig, "score": ScoreConfig, "filter": FilterConfig, "train": TrainConfig,
            "eval": EvalConfig, "sft": SFTConfig, "train-rm": TrainRMConfig}


def _stage_config(step: Step):
    """The stage's parsed config (argparse errors become a PipelineError that names the step)."""
    import io

    from rlhf_pipeline.config import parse_config

    cls = stage_configs()[step.stage]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_config(cls, step.args, f"rlhf {step.stage}")
    except SystemExit:
        message = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "invalid options"
        message = message.removeprefix("error: ")
        raise PipelineError(f"{step.name}: {message} (options: {shlex.join(step.args)})") from None
    except PipelineError as e:  # a --config file that cannot be read
        raise PipelineError(f"{step.name}: {e}") from None


def check(steps: Sequence[Step]) -> None:
    """Parse every step's options now, before anything runs."""
    for step in steps:
        _stage_config(step)


@dataclass
class OnHub:
    """A step's output that is finished on the Hub and not here (yet): where it is and its manifest there."""

    hub: Any  # datasets_io.HubTarget
    manifest: dict[str, Any]
    model: bool


def _stage_output(step: Step, config, on_hub: dict[Path, OnHub]):
    """The stage's own output record (``datasets_io.StageOutput``) for ``step``, as the stage would make it. An input
    that is only on the Hub is fingerprinted by its manifest there, as it will be once pulled."""
    from rlhf_pipeline.datasets_io import StageOutput, parse_ref

    texts = [t for t in (getattr(config, f) for f in INPUT_FIELDS[step.stage]) if t is not None]
    text = texts[0]
    remote = on_hub.get(Path(text).expanduser())
    if remote is None:
        return StageOutput(step.stage, config, inputs=[parse_ref(t) for t in texts])
    out = StageOutput(step.stage, config, inputs=[])
    # the fingerprint the pulled output will have: its manifest's output_id
    out.input_records = [{"ref": str(Path(text).expanduser()), "kind": "dir",
                          "fingerprint": remote.manifest["output_id"], "split": None}]
    return out


def is_complete(step: Step, on_hub: dict[Path, OnHub] | None = None) -> bool:
    """Whether ``step.output`` holds this exact run (the stage's own reuse check, made without launching it), its
    ``--push-to-hub`` upload included. Raises when it holds a run with another config (and --overwrite was not
    given)."""
    if not (step.output / MANIFEST).exists():
        return False
    out = _stage_output(step, _stage_config(step), on_hub or {})
    resume = True if step.stage in TRAINING_STAGES or step.stage == "eval" else None
    complete = out.done(resume=resume, push=False) and not out.push_pending()  # a pending upload: the stage does it
    if complete and step.stage in TRAINING_STAGES:
        remove_leftover_checkpoints(step.output)
    return complete


def on_the_hub(step: Step, on_hub: dict[Path, OnHub]) -> OnHub | None:
    """Where the Hub holds ``step``'s finished output, when its output is missing here and the manifest that its
    ``--push-to-hub`` upload left records the same config and inputs as this run's; else None."""
    from rlhf_pipeline.datasets_io import HubTarget, hub_manifest

    if step.stage not in HUB_STAGES or step.output.exists():
        return None
    config = _stage_config(step)
    hub = HubTarget.of(config)
    if hub is None:
        return None
    model = step.stage in TRAINING_STAGES
    manifest = hub_manifest(hub, model=model)
    if manifest is None:
        return None
    manifest = relocated(manifest, step.output)
    diffs = _stage_output(step, config, on_hub).differences(manifest)
    if diffs:
        print(f"[iterate] {step.name}: {hub} holds a run with another config or inputs ({'; '.join(diffs)}); "
              "running it here", flush=True)
        return None
    return OnHub(hub, manifest, model)


def relocated(manifest: dict[str, Any], output: Path) -> dict[str, Any]:
    """``manifest``, of a stage output that another run directory wrote and pushed (another machine's, or this one's
    before it moved), as if this run had written it into ``output``: the paths into that run in its config (the
    policy of the iteration before, the output itself) point into this one."""
    old = manifest.get("config", {}).get("output")
    if not old or Path(old).parent.parent == output.parent.parent:
        return manifest
    old, new = str(Path(old).parent.parent), str(output.parent.parent)

    def move(value: Any) -> Any:
        if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
            return new + value[len(old):]
        return [move(v) for v in value] if isinstance(value, list) else value

    return {**manifest, "config": {key: move(value) for key, value in manifest["config"].items()}}


def pull_inputs(step: Step, on_hub: dict[Path, OnHub]) -> None:
    """Pull the outputs that ``step`` reads (its arguments name them, or a path inside one) and that are only on the
    Hub into their places in the run."""
    from rlhf_pipeline.datasets_io import pull_output

    for path in list(on_hub):
        if any(arg == str(path) or arg.startswith(str(path) + os.sep) for arg in step.args):
            remote = on_hub.pop(path)
            pull_output(remote.hub, path, remote.manifest, model=remote.model)


def _log(run: Path, record: dict[str, Any]) -> None:
    with (run / STEPS_LOG).open("a") as f:
        f.write(json.dumps(record) + "\n")


class Stopped(BaseException):
    """SIGTERM or SIGHUP reached ``rlhf iterate`` while its steps ran (a scheduler, ``kill``, a closed terminal). A
    BaseException, as KeyboardInterrupt is: no ``except Exception`` on its way (around a step's launch) may take it
    for that step's failure."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunStopped(PipelineError):
    """The run was stopped (Ctrl-C, SIGTERM, SIGHUP), its running stages with it: one line, and the exit status of
    a process ended by that signal (130, 143, 129), so that a scheduler tells a stop from a failure."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


def _wait_then_stop(procs: Sequence[subprocess.Popen], label: str, names: str, others: frozenset[int]) -> None:
    """After Ctrl-C: wait up to STOP_GRACE_SECONDS for every process of the running steps to exit, then stop what is
    left (:func:`stop_processes`). From a terminal they all got the same SIGINT; a launcher that exits first leaves
    its stage cleaning up, adopted by this process (:func:`adopting_orphans`), which is waited for too. SIGINT sent
    to this process alone (``kill -INT``, a notebook's interrupt) reached none of them, and they are stopped once the
    grace is over. A second Ctrl-C stops the wait (a KeyboardInterrupt out of here): iterate exits, and its stages,
    which die with it, are stopped where they are."""
    import psutil

    grace = STOP_GRACE_SECONDS
    deadline = time.monotonic() + grace
    print(f"[{label}] interrupted: waiting up to {grace:g} s for {names} to stop (Ctrl-C again to stop at once)",
          flush=True)
    while True:  # listed again after each wait: a stage adopted meanwhile is waited for too
        tree = _descendants(others)
        left = deadline - time.monotonic()
        if not tree or left <= 0:
            break
        psutil.wait_procs(tree, timeout=left)
    if tree:
        print(f"[{label}] {names} still running {grace:g} s after the interrupt: stopping it", flush=True)
        stop_processes(procs, known=tree)


def _descendants(others: frozenset[int]) -> list[Any]:
    """The processes under this one that have not ended, but for ``others`` (children it had before the steps) and
    theirs: the running steps' processes, and those it adopted. One listing of the process table, so a stage whose
    launcher is exiting is found under the launcher or under this process, whichever it is under by then."""
    import psutil

    excluded = set(others)
    tree = psutil.Process().children(recursive=True)
    parents = {}
    for process in tree:
        with contextlib.suppress(psutil.Error):
            parents[process.pid] = process.ppid()
    for process in tree:  # a descendant of a child from before the steps (a Ray the process had started) is not ours
        pid, seen = process.pid, set()
        while pid in parents and pid not in seen:
            seen.add(pid)
            if pid in excluded:
                excluded.add(process.pid)
                break
            pid = parents[pid]
    found = []
    for process in tree:
        with contextlib.suppress(psutil.Error):
            if process.pid not in excluded and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


# Seconds a step's processes get to exit after the SIGTERM rlhf iterate passes on, before they are killed.
STOP_GRACE_SECONDS = 20.0


class StopSignals:
    """SIGTERM and SIGHUP to this process, while it runs steps: each raises :class:`Stopped` (in the main thread), so
    that the running steps can be stopped with it, except inside :meth:`held`, which raises it on leaving. A signal the
    process ignores (``nohup``) stays ignored."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self.holding = False
        self.previous: dict[int, Any] = {}
        self.main = threading.current_thread() is threading.main_thread()  # only it may set handlers

    def install(self) -> StopSignals:
        if self.main:
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGHUP)
                             if signal.getsignal(sig) is not signal.SIG_IGN}
        return self

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum
        if not self.holding:
            raise Stopped(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within, a stop signal waits: between starting a step's process and recording it as running, say."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.received is not None:
            raise Stopped(self.received)

    @contextlib.contextmanager
    def stopping(self, ignore_interrupts: bool) -> Iterator[None]:
        """Within, the run is being stopped: a further stop signal, or with ``ignore_interrupts`` Ctrl-C, does not cut
        that short (the stop of a run stopped by a signal is bounded by its grace; one stopped by Ctrl-C waits for
        its stages, and a second Ctrl-C ends the wait)."""
        self.holding = True
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN) if self.main and ignore_interrupts else None
        try:
            yield
        finally:
            if interrupt is not None:
                signal.signal(signal.SIGINT, interrupt)


def process_tree(procs: Sequence[subprocess.Popen], known: Sequence[Any] = ()) -> list[Any]:
    """``procs`` and every process under them, as ``psutil`` processes, with ``known`` ones (and theirs) still
    running: a tree listed earlier, whose launcher may have exited since and left its stage without a parent."""
    import psutil

    found: dict[int, psutil.Process] = {}
    tops = [*known]
    for proc in procs:
        if proc.poll() is None:  # an exited child may have been reaped already, and its pid given to another process
            with contextlib.suppress(psutil.Error):
                tops.append(psutil.Process(proc.pid))
    for top in tops:
        with contextlib.suppress(psutil.Error):
            if top.is_running():
                for process in (top, *top.children(recursive=True)):
                    found.setdefault(process.pid, process)
    return list(found.values())


def stop_processes(procs: Sequence[subprocess.Popen], grace: Optional[float] = None,
                   known: Sequence[Any] = ()) -> None:
    """SIGTERM to each of ``procs`` and every process under it (and to ``known`` ones, as :func:`process_tree`), then
    SIGKILL to those still there after ``grace`` seconds (default STOP_GRACE_SECONDS). The whole tree: a launcher
    (``accelerate launch`` of one process, ``conda run``) exits on SIGTERM without passing it on, and the stage under it
    would go on writing beside the rerun (vLLM holding its GPUs). The tree is frozen (SIGSTOP) and listed again before
    it is signalled, so that a process it starts meanwhile is in it too."""
    import psutil

    grace = STOP_GRACE_SECONDS if grace is None else grace

    frozen: dict[int, psutil.Process] = {}
    for _ in range(3):  # a process forking as it was frozen shows up in the next listing
        new = [p for p in process_tree(procs, known) if p.pid not in frozen]
        if not new:
            break
        for process in new:
            with contextlib.suppress(psutil.Error):
                process.suspend()
            frozen[process.pid] = process
    processes = list(frozen.values())
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
            process.resume()  # a stopped process acts on SIGTERM once continued
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=grace)
    for proc in procs:
        proc.wait()


_LOCKED: set[Path] = set()  # the run locks this process holds


@contextlib.contextmanager
def run_lock(run: Path, label: str) -> Iterator[None]:
    """Hold ``RUN/.lock`` while this process runs the run's stages: a second ``rlhf iterate`` on the same run (a
    scheduler's requeue beside the first, a command run twice) would launch the same stages beside them, two writers
    in one output. The lock goes with the process, however it ends (an advisory ``flock``, Linux and macOS); taken
    again by the process that holds it, it is the same lock. ``run`` must exist."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        yield
        return
    path = run / RUN_LOCK
    if path in _LOCKED:  # this process holds it already (rlhf iterate or demo, around run_steps)
        yield
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise PipelineError(f"{label}: another process is running the stages of {run} (pid {holder}); wait for "
                                "it to finish, or stop it, then run this command again") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        _LOCKED.add(path)
        try:
            yield
        finally:
            _LOCKED.discard(path)
            fcntl.flock(f, fcntl.LOCK_UN)


def run_steps(steps: Sequence[Step], run: Path, label: str = "iterate", hub: bool = False,
              on_hub: dict[Path, OnHub] | None = None) -> list[str]:
    """:func:`_run_steps` holding the run's lock (:func:`run_lock`)."""
    run.mkdir(parents=True, exist_ok=True)
    with run_lock(run, label), adopting_orphans() as others:
        return _run_steps(steps, run, label, hub, on_hub, others)


@contextlib.contextmanager
def adopting_orphans() -> Iterator[frozenset[int]]:
    """While the steps run, the stage processes whose launcher exits before them (``accelerate launch`` on Ctrl-C)
    become this process's children (:func:`machine.adopt_orphans`), so that :func:`_wait_then_stop` finds them;
    those that have ended are reaped on the way out. Yields the pids of the children this process had before (not
    the steps')."""
    import psutil

    me = psutil.Process()
    before = {child.pid for child in me.children()}
    adopt_orphans(True)
    try:
        yield frozenset(before)
    finally:
        adopt_orphans(False)
        _reap_adopted(frozenset(before), set())


def _reap_adopted(others: frozenset[int], launched: set[int]) -> None:
    """Collect the adopted processes that have ended (a stage's helper, its ``multiprocessing`` resource tracker,
    outliving it), which would stay zombies until the run ends: not ``others`` (children from before the steps)
    nor ``launched`` (the running steps' own, which their ``Popen`` waits for)."""
    import psutil

    for child in psutil.Process().children():
        if child.pid not in others and child.pid not in launched:
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)


def _run_steps(steps: Sequence[Step], run: Path, label: str, hub: bool, on_hub: dict[Path, OnHub] | None,
               others: frozenset[int]) -> list[str]:
    """Run the steps, skipping finished ones, here or with ``hub`` on the Hub (those are recorded in ``on_hub`` and
    pulled when a launched step reads them): each once the steps it comes ``after`` have finished, at most one at a
    time per lane (a sequential plan: one after the other). Returns the names of the steps that were launched.

    A failed step stops new launches; a step still running on the other lane is let finish (its work is kept), then
    the failure is raised. Ctrl-C reaches the running stages too (one process group), whose processes are waited for
    (:func:`_wait_then_stop`). SIGTERM or SIGHUP to this process alone (``kill``, a container's stop) is passed on to
    every process of the running steps (:func:`stop_processes`), which are waited for, then the run stops; the same
    command resumes it, and the stopped run's exit status is the signal's (130 for Ctrl-C)."""
    on_hub = {} if on_hub is None else on_hub
    steps = list(steps)
    index = {step.name: i for i, step in enumerate(steps, 1)}
    finished: set[str] = set()
    pending = list(steps)
    running: dict[str, tuple[Step, subprocess.Popen, float]] = {}  # lane -> its running step
    launched: list[str] = []
    failure: Optional[str] = None

    def ready(step: Step) -> bool:
        before = step.after if step.after is not None else [s.name for s in steps[:index[step.name] - 1]]
        return step.lane not in running and all(name in finished for name in before)

    def launch(step: Step) -> Optional[subprocess.Popen]:
        """Start ``step``'s process and record it as running, or None where it is finished (here, or on the Hub
        with ``hub``)."""
        if is_complete(step, on_hub):
            return None
        remote = on_the_hub(step, on_hub) if hub else None
        if remote is not None:
            on_hub[step.output] = remote
            print(f"[{label}] ({index[step.name]}/{len(steps)}) {step.name}: finished on the Hub "
                  f"({remote.hub}); pulled when a stage reads it", flush=True)
            return None
        pull_inputs(step, on_hub)
        print(f"[{label}] ({index[step.name]}/{len(steps)}) {step.name}: {shlex.join(step.command)}", flush=True)
        # the stage's processes die with this one, a SIGKILL included (machine.die_with_the_run), launchers between
        # them too: a killed run leaves no stage writing beside the rerun that resumes it
        env = {**os.environ, **step.env, RUN_PID: run_identity()}
        with stops.held():  # a stop signal now would miss the process: it waits until it is recorded as running
            proc = subprocess.Popen(step.command, env=env,
                                    preexec_fn=die_with_parent if sys.platform == "linux" else None)
            running[step.lane] = (step, proc, time.time())
        return proc

    def finish(step: Step, rc: Any, started: float) -> None:
        ended = time.time()
        _log(run, {"step": step.name, "command": step.command, "rc": rc, "seconds": round(ended - started, 2),
                   "started": round(started, 3), "ended": round(ended, 3), "lane": step.lane})

    stops = StopSignals().install()
    try:
        while pending or running:
            progressed = True
            while progressed and failure is None:  # until no pending step can start: a skip may free the next
                progressed = False
                for step in list(pending):
                    if not ready(step):
                        continue
                    pending.remove(step)
                    progressed = True
                    try:
                        proc = launch(step)
                    except Exception as e:  # noqa: BLE001 - with the other side running, its stage is let finish
                        if not running:
                            raise
                        failure = redact(one_line(e))
                        print(f"[{label}] {step.name} could not start ({failure}); waiting for "
                              f"{', '.join(s.name for s, _, _ in running.values())} to finish", flush=True)
                        break
                    if proc is None:
                        finished.add(step.name)
                        continue
                    launched.append(step.name)
            if not running:
                if pending and failure is None:  # nothing runs and nothing can start: a plan that names no step
                    raise PipelineError(f"{label}: {pending[0].name} waits for a step that is not in the plan")
                break
            done = _wait_any(running)
            _reap_adopted(others, {proc.pid for _, proc, _ in running.values()})
            for lane, (step, proc, started) in list(running.items()):
                if lane not in done:
                    continue
                del running[lane]
                rc = proc.returncode
                finish(step, rc, started)
                if rc != 0:
                    failure = failure or (f"{step.name} failed ({_exit_reason(rc)}). Fix the cause and run the same "
                                          "command again: finished stages are kept")
                    if running:
                        print(f"[{label}] {step.name} failed; waiting for "
                              f"{', '.join(s.name for s, _, _ in running.values())} to finish", flush=True)
                elif not (step.output / MANIFEST).exists():
                    failure = failure or f"{step.name} exited without writing {step.output / MANIFEST}"
                else:
                    finished.add(step.name)
    except (KeyboardInterrupt, Stopped) as e:
        names = ", ".join(step.name for step, _, _ in running.values()) or "the run"
        procs = [proc for _, proc, _ in running.values()]
        with stops.stopping(ignore_interrupts=isinstance(e, Stopped)):
            if isinstance(e, Stopped):  # sent to this process alone: pass it on to the steps' processes
                with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) cannot be written to
                    print(f"[{label}] {e}: stopping {names}", flush=True)
                stop_processes(procs, known=_descendants(others))
            else:
                try:
                    _wait_then_stop(procs, label, names, others)
                except KeyboardInterrupt:  # a second Ctrl-C: iterate exits now, its stages dying with it
                    procs = []
            for step, proc, started in running.values():
                if proc in procs:
                    proc.wait()
                finish(step, "interrupted", started)
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"stopped by {e}"
        raise RunStopped(
            f"{what} during {names}; run the same command again to resume there (finished stages are kept)",
            exit_status=130 if isinstance(e, KeyboardInterrupt) else 128 + e.signum,
        ) from None
    finally:
        stops.restore()
    if failure:
        raise PipelineError(failure)
    return launched


def _exit_reason(rc: int) -> str:
    """Why a step's process ended with ``rc``: a stage that failed says why above; one killed by a signal cannot."""
    if rc >= 0:
        return f"exit status {rc}; its error is above"
    name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
    oom = ", often the kernel's out-of-memory killer (see dmesg)" if -rc == signal.SIGKILL else ""
    return f"killed by {name}, so nothing above says why{oom}"


def _wait_any(running: dict[str, tuple[Step, subprocess.Popen, float]]) -> set[str]:
    """Block until at least one running step's process has exited; the lanes of those that have. Polled, never
    ``Popen.wait()``: on Ctrl-C that waits 0.25 s more for the child before it raises, and a second Ctrl-C inside
    that window replaced the first, so iterate took it for the first and waited out the whole grace."""
    delay = 0.01
    while True:
        done = {lane for lane, (_, proc, _) in running.items() if proc.poll() is not None}
        if done:
            return done
        time.sleep(delay)
        delay = min(2 * delay, 0.2)


def main(config: IterateConfig) -> Path:
    """Check what exists before the run does (the starting policy, the reward, the prompts), so a mistyped path
    fails in seconds and leaves no run directory; then run (:func:`run_iterations`). The later iterations' policies
    do not exist yet: each stage checks its own when it starts."""
    from rlhf_pipeline.datasets_io import parse_ref
    from rlhf_pipeline.modeling import check_model_ref, check_reward_model
    from rlhf_pipeline.rewards import check_reward_fn_spec

    check_model_ref("--model", config.model)
    if config.reward_model is not None:
        check_reward_model("--reward-model", config.reward_model, bool(config.score.get("trust_remote_code")),
                           trust_option="--score '{trust_remote_code: true}'")
    for spec in as_list(config.reward_fn):
        check_reward_fn_spec(spec, read_file=True)
    for flag, text, section in (("prompts", config.prompts, config.generate),
                                ("eval_prompts", config.eval_prompts, config.eval)):
        if text is not None:
            check_prompt_source(flag, parse_ref(text), section.get("prompt_column"))
    return run_iterations(config)


def check_prompt_source(flag: str, ref, column: str | None) -> None:
    """A local prompt dataset has the column its stage reads (``prompt`` or ``messages``, or the section's
    ``prompt_column``), checked before the first stage starts rather than when the first generate or eval of the
    run reads it (each row is checked there). A Hub dataset is read by its stage."""
    from rlhf_pipeline.chat import prompt_column, use_prompt_column
    from rlhf_pipeline.datasets_io import load_dataset_ref

    if ref.kind != "hub":
        ds, source = load_dataset_ref(ref), f"{flag} {ref.name}"
        prompt_column(ds if column is None else use_prompt_column(ds, column, source), source)


def run_iterations(config: IterateConfig) -> Path:
    """Plan the run, check every stage's options, and launch the stages that are not finished."""
    from rlhf_pipeline.config import to_dict
    from rlhf_pipeline.datasets_io import write_text_atomic

    run = Path(config.output).expanduser()
    steps = plan(config, count_prompts(config))
    check(steps)
    run.mkdir(parents=True, exist_ok=True)
    on_hub: dict[Path, OnHub] = {}
    with run_lock(run, "iterate"):  # before iterate.json: a refused second run does not rewrite the first's
        record = {**to_dict(config), "lane_env": {lane: redact_env(env) for lane, env in config.lane_env.items()}}
        write_text_atomic(run / ITERATE_CONFIG, json.dumps(record, indent=2, default=str) + "\n")
        run_steps(steps, run, hub=config.resume, on_hub=on_hub)
    last = last_policy(config)
    where = f"on the Hub: {on_hub[last].hub.repo_id}, branch {on_hub[last].hub.config}" if last in on_hub else last
    print(f"[iterate] {config.iterations} iteration(s) complete; the last policy is {where}")
    return run


def last_policy(config: IterateConfig) -> Path:
    return iteration_dir(Path(config.output).expanduser(), config.iterations) / "train"


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(IterateConfig, main, "rlhf iterate", argv)


if __name__ == "__main__":
    sys.exit(cli())
