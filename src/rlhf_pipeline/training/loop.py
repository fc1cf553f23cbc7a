"""The training loop shared by every training stage: AdamW, warmup + cosine, clipping, length-grouped dynamic
batches, evaluation and metrics, with checkpoints and resume (``rlhf_pipeline.training.checkpoints``) on one process or many
(``rlhf_pipeline.distributed``).

A stage supplies a :class:`TrainTask` (how to collate rows and compute the loss), wraps its model with
:func:`prepare` and calls :func:`train`, inside the frame of ``rlhf_pipeline.training.stage``. The same code runs
single-process on a CPU and under ``accelerate launch --config_file accelerate_cfgs/zero3.yaml`` on many GPUs.

Batches. An optimizer step sees a *global batch* of ``batch_size x gradient_accumulation_steps x num_processes``
examples, drawn from a seeded permutation of the data, so the examples of each step do not depend on how they are
split. The global batch is sorted by length and cut into micro-batches of ``batch_size``: micro-batch ``a * world
+ rank`` goes to process ``rank`` at accumulation step ``a``. Each micro-batch is padded (or packed) to its own
longest sequence. The loss is a per-example mean, so batch 8 x accumulation 1, batch 1 x accumulation 8 and 2
processes x batch 4 all compute the same update.

With ``--max-tokens-per-micro-batch`` the same global batch is cut by tokens instead (:func:`token_budget_plan`):
micro-batches of as many examples as fit the budget, so every forward is about as large whatever the lengths. They
hold different numbers of examples, so each one's loss is weighted by its examples (``n / batch_size``, see
:func:`micro_batch_weight`) and the update is still the per-example mean over the global batch, the same as by
count to float rounding. Every process runs the same number of forwards (ZeRO-3's are collective): one with fewer
micro-batches runs stand-ins of weight 0. The optimizer steps after the last one, whatever their number.

Host syncs. A micro-batch's loss, metrics and non-finite flag are summed as tensors where they live; the host reads
them once per step, at its boundary (with the gradient norm, outside DeepSpeed), so it does not wait for the device
after every forward.

Non-finite steps. A step whose loss (any micro-batch, any process) or gradients are not finite applies no update:
every process reaches the same verdict (a flag over the step's micro-batches, all-reduced at the boundary with the
step's sums; the global gradient norm on one process; under DeepSpeed ZeRO's own all-reduced overflow check of the
gradient partitions, before the engine's step, which this loop takes itself instead of through
``accelerator.backward`` so that it can leave it out: see :func:`skip_deepspeed_step`). ``--max-nonfinite-steps`` in
a row stop the run with one error line; weights that are not finite are never saved.

What a run writes (the final model, metrics.jsonl, checkpoints/) is described in ``rlhf_pipeline.training.checkpoints``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import secrets
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Optional, Protocol, Sequence

from rlhf_pipeline.attention import DEFAULT_ATTENTION, AttnImplementation, attn_help, from_pretrained_kwargs
from rlhf_pipeline.training.checkpoints import resume_checkpoint, save_checkpoint, save_model
from rlhf_pipeline.config import DATASET_REF, OutputOptions, option, trust_remote_code_option
from rlhf_pipeline.datasets_io import write_text_atomic
from rlhf_pipeline.distributed import anywhere, quiet, reduce_sums, sharded_batches, stop_everywhere, zero_stage
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.files import MODEL_HINT, reading
from rlhf_pipeline.layout import METRIC_WEIGHT, METRICS, TRACKER_DIR
from rlhf_pipeline.modeling import enable_activation_checkpointing
from rlhf_pipeline.training.compilation import compile_decoder_layers
from rlhf_pipeline.training.lora import LoraOptions, add_adapters, load_kwargs
from rlhf_pipeline.training.master_weights import MasterWeights

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainOptions(OutputOptions, LoraOptions):
    """Options every training stage shares."""

    writes: ClassVar[str] = "model"

    model: str = option(help="Model to start from: a local directory or a Hub model id.")
    data: str = option(help=f"Training data with train and test splits: {DATASET_REF}.", semantic=False)
    epochs: int = option(1, help="Passes over the training data (ignored when --max-steps is set).")
    max_steps: Optional[int] = option(None, help="Stop after this many optimizer steps.")
    batch_size: int = option(4, help="Examples per process per forward pass (micro-batch); with "
                             "--max-tokens-per-micro-batch, only a factor of the global batch.")
    gradient_accumulation_steps: int = option(1, help="Micro-batches per optimizer step; with "
                                              "--max-tokens-per-micro-batch, only a factor of the global batch.")
    max_tokens_per_micro_batch: Optional[int] = option(
        None,
        help="Cut each step's global batch (still --batch-size x --gradient-accumulation-steps x processes examples) "
        "into micro-batches of up to this many tokens instead of --batch-size examples, so that every forward is "
        "about as large whatever the lengths; the loss and the update stay the same (to float rounding). On a GPU, "
        "as many as fill its memory (e.g. 16384-65536 for a 1-8B model); an example longer runs alone. Default: "
        "by --batch-size.",
        semantic=False,
    )
    learning_rate: float = option(1e-6, help="Peak learning rate of AdamW.")
    weight_decay: float = option(0.0, help="AdamW weight decay.")
    adam_beta1: float = option(0.9, help="AdamW beta1.")
    adam_beta2: float = option(0.999, help="AdamW beta2 (REBEL's and OpenRLHF's runs use 0.95).")
    adam_epsilon: float = option(1e-8, help="AdamW epsilon.")
    warmup_ratio: float = option(0.1, help="Fraction of the steps spent warming the learning rate up (then cosine).")
    max_grad_norm: float = option(1.0, help="Clip the global gradient norm to this value (0 = no clipping).")
    max_nonfinite_steps: int = option(
        5, help="A step whose loss or gradients are not finite is skipped (no update, counted in the metrics); this "
        "many in a row stop the run with the step and the last finite loss, nothing saved as finished.",
        semantic=False,
    )
    bf16: bool = option(False, help="bfloat16 mixed precision.")
    bf16_weights: bool = option(
        False,
        help="With --bf16: keep the model's weights in bfloat16 and float32 master copies in the optimizer, instead "
        "of float32 weights cast for every forward (no per-micro-batch casts, bfloat16 activations; "
        "rlhf_pipeline.training.master_weights). What DeepSpeed's bf16 mode does already; the model is saved from "
        "the float32 masters. Not with LoRA.",
    )
    compile: bool = option(
        False,
        help="Compile each decoder layer with torch.compile (dynamic shapes), so that the norms, the rotary "
        "embedding, the activation and the casts between the matmuls run as a few fused kernels instead of dozens "
        "per layer; the first steps pay the compilation (rlhf_pipeline.training.compilation). Results change by "
        "float rounding only. Not under DeepSpeed.",
        semantic=False,
    )
    # How a run gets to its result, not the result: a run may resume with these changed (checkpointing turned on
    # after running out of memory, checkpoints or evaluations added), as with pack_ratio and the attention kernel.
    gradient_checkpointing: bool = option(False, help="Recompute activations in the backward pass to save memory.",
                                          semantic=False)
    pack_ratio: float = option(
        2.0,
        help="Pack each micro-batch's sequences into rows of up to this many times its longest sequence, kept apart "
        "by position ids (block-diagonal attention), instead of padding each to the longest; 0 = pad. With "
        "--attn-implementation flash_attention_2 or varlen every micro-batch is one unpadded row whatever this is; "
        "see rlhf_pipeline.logprobs.",
        semantic=False,
    )
    attn_implementation: AttnImplementation = option(DEFAULT_ATTENTION, help=attn_help(), semantic=False)
    eval_every: int = option(0, help="Evaluate on the test split every N steps (0 = at the end only).",
                             semantic=False)
    eval_batch_size: int = option(8, help="Examples per process per evaluation forward.", semantic=False)
    save_every: int = option(0, help="Save a resumable checkpoint every N steps (0 = final model only).",
                             semantic=False)
    save_total_limit: int = option(
        2, help="Keep only the newest N checkpoints, 0 = keep all: an older one is deleted once a newer one is "
        "complete, so the one a run resumed from goes only after its successor is safely written. The default 2 keeps "
        "the newest, to resume from, and the one before it, which --resume goes on from when the newest is damaged.",
        semantic=False,
    )
    keep_checkpoints: bool = option(
        False, help="Keep checkpoints/ once the run has finished; by default a finished run deletes its checkpoints "
        "after its final model and manifest are written (they only serve to resume an unfinished run).",
        semantic=False,
    )
    logging_steps: int = option(
        1, help="Log metrics every N steps: each line holds the mean over the steps since the last one (the last "
        "step's learning rate).", semantic=False)
    resume: bool = option(False, help="Continue an interrupted run from its newest checkpoint.", semantic=False)
    seed: int = option(0, help="Seed of the data order and of anything random in training.")
    report_to: Literal["tensorboard", "wandb", "none"] = option(
        "tensorboard", help="Where metrics go besides OUTPUT/metrics.jsonl: TensorBoard (OUTPUT/runs) or wandb (the "
        "project $WANDB_PROJECT, default rlhf-pipeline); a resumed run continues its tracker's run.", semantic=False
    )
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self) -> None:
        self.check_lora()
        # accelerate drops a tracker whose package is missing with a warning, and the run logs nowhere but
        # metrics.jsonl: wandb, asked for by name, is refused before the run starts; TensorBoard, the default, is
        # only said to be missing (tensorboardX serves accelerate too), as a plain install has neither
        packages = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}.get(self.report_to, ())
        if packages and not any(importlib.util.find_spec(p) for p in packages):
            missing = (f"--report-to {self.report_to}: {self.report_to} is not installed here (pip install "
                       f"{self.report_to}); or pass --report-to none: OUTPUT/metrics.jsonl is written either way")
            if self.report_to == "wandb":
                raise ValueError(missing)
            log.warning(missing)
        for name in ("epochs", "batch_size", "gradient_accumulation_steps", "eval_batch_size", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.bf16_weights and not self.bf16:
            raise ValueError("--bf16-weights needs --bf16 (bfloat16 weights run under bfloat16 autocast)")
        if self.compile and self.load_in_4bit:
            raise ValueError("--compile does not take --load-in-4bit (bitsandbytes' 4-bit layers are not compiled "
                             "here); drop one of them")
        if self.bf16_weights and self.lora_rank:
            raise ValueError("--bf16-weights is for full fine-tuning: with --lora-rank the frozen weights are not "
                             "trained and the adapters are small; drop --bf16-weights (or load the model in bf16)")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("--max-steps must be at least 1")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError("--max-tokens-per-micro-batch must be at least 1 (leave it unset to cut micro-batches by "
                             "--batch-size)")
        if self.save_total_limit < 0:
            raise ValueError(f"--save-total-limit {self.save_total_limit}: must be >= 0 (0 = keep every checkpoint)")
        if self.pack_ratio and self.pack_ratio < 1:
            raise ValueError("--pack-ratio must be 0 (pad) or at least 1")
        if self.learning_rate <= 0:
            raise ValueError("--learning-rate must be > 0")
        if self.weight_decay < 0:
            raise ValueError("--weight-decay must be >= 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError("--adam-beta1 and --adam-beta2 must be in [0, 1)")
        if self.adam_epsilon <= 0:
            raise ValueError("--adam-epsilon must be > 0")
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError("--warmup-ratio must be in [0, 1]")
        for name in ("max_grad_norm", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 = off)")


class TrainTask(Protocol):
    """What a training stage gives the shared loop."""

    def lengths(self, rows: Any) -> list[int]:
        """Tokens per example (what a forward pass costs), for grouping examples of similar length."""
        ...

    def collate(self, rows: list[dict[str, Any]]) -> Any:
        """A micro-batch of tensors from dataset rows."""
        ...

    def loss(self, model: Any, batch: Any) -> tuple[Any, dict[str, Any], tuple[int, int]]:
        """(scalar mean loss, detached per-example metrics (B,), (real tokens, all token positions processed))."""
        ...


# A task may also define ``begin_step(accelerator, model, rows)``, which the loop calls on every process before each
# optimizer step with the step's whole global batch (``rows``, a Dataset; every process gets all of it): what a loss
# normalised over the global batch needs (a token mean over all the step's tokens, say). The step's gradient is the
# example-weighted mean of its micro-batches' losses over all processes, however the batch is cut (by count, or by
# --max-tokens-per-micro-batch into micro-batches of different sizes), so a micro-batch of n of the step's N rows
# whose loss is ``N / n * (its part of the sum) / (global normaliser)`` adds up to the global mean
# (``GroupTask.token_scale``). Any forward pass in it must run on every process together (ZeRO-3). Evaluation calls
# it with ``rows=None`` (normalise within each batch), then, where the task defines it, ``begin_eval(ds)`` with the
# split evaluated (a token mean over the whole split, say): evaluation batches differ in size and are weighted by
# their examples.


# ----------------------------------------------------------------------------------------------------------------
# Batching


def global_batches(num_rows: int, global_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The global batches of one epoch: a seeded permutation cut into full batches (the last partial one dropped)."""
    import numpy as np

    perm = np.random.default_rng([seed, epoch]).permutation(num_rows).tolist()
    return [perm[i : i + global_size] for i in range(0, num_rows - global_size + 1, global_size)]


def micro_batches(
    batch: Sequence[int], lengths: Sequence[int], batch_size: int, world: int, accumulation: int, rank: int
) -> list[list[int]]:
    """This process's micro-batches of one global batch, in accumulation order (see the module docstring)."""
    ordered = sorted(batch, key=lambda i: (-lengths[i], i))
    chunks = [ordered[k : k + batch_size] for k in range(0, len(ordered), batch_size)]
    return [chunks[a * world + rank] for a in range(accumulation)]


def token_budget_plan(
    batch: Sequence[int], lengths: Sequence[int], max_tokens: int, world: int
) -> list[list[list[int]]]:
    """Every process's micro-batches of one global batch under a budget of ``max_tokens`` tokens per micro-batch
    (``--max-tokens-per-micro-batch``), the same plan on every process.

    The batch, sorted longest first as :func:`micro_batches` sorts it, is cut greedily into runs whose ``lengths``
    add up to at most ``max_tokens`` (an example longer than that is a micro-batch of its own). The micro-batches go
    out longest first (by tokens), each to the process with the fewest tokens so far among those holding fewer than
    ``ceil(count / world)`` (ties: the lowest rank), so the processes' loads are even and none runs more forwards
    than it must: under ZeRO-3 every forward is collective, and a process with fewer micro-batches than the
    busiest runs stand-ins to keep in step. ``plan[rank]`` is process ``rank``'s list, longest first; some may be
    empty when there are fewer micro-batches than processes."""
    ordered = sorted(batch, key=lambda i: (-lengths[i], i))
    chunks: list[list[int]] = []
    tokens = 0
    for i in ordered:
        if chunks and tokens + lengths[i] <= max_tokens:
            chunks[-1].append(i)
            tokens += lengths[i]
        else:
            chunks.append([i])
            tokens = lengths[i]
    rounds = math.ceil(len(chunks) / world)
    plan: list[list[list[int]]] = [[] for _ in range(world)]
    load = [0] * world
    sized = sorted(((sum(lengths[i] for i in c), c) for c in chunks), key=lambda t: -t[0])  # stable on ties
    for size, chunk in sized:
        rank = min((r for r in range(world) if len(plan[r]) < rounds), key=lambda r: (load[r], r))
        plan[rank].append(chunk)
        load[rank] += size
    return plan


def step_micro_batches(
    batch: Sequence[int], lengths: Sequence[int], config: TrainOptions, world: int, rank: int
) -> list[list[int] | None]:
    """This process's micro-batches of one global batch, by ``--batch-size`` or by ``--max-tokens-per-micro-batch``
    (:func:`token_budget_plan`); ``None`` is a stand-in, so that every process gets as many entries as the busiest."""
    if config.max_tokens_per_micro_batch is None:
        return micro_batches(batch, lengths, config.batch_size, world, config.gradient_accumulation_steps, rank)
    plan = token_budget_plan(batch, lengths, config.max_tokens_per_micro_batch, world)
    return plan[rank] + [None] * (max(len(p) for p in plan) - len(plan[rank]))


def micro_batch_weight(examples: int, batch_size: int) -> float:
    """What a micro-batch's mean loss is multiplied by before its backward: its examples over ``batch_size``. The
    backward divides by the accumulation steps (accelerate's, DeepSpeed's) and the gradients are averaged over the
    processes, which weighs each of the global batch's ``batch_size x accumulation x processes`` examples alike
    only when every micro-batch holds ``batch_size`` of them; a micro-batch cut by tokens holds ``examples``, and
    this weight restores the per-example mean. 1 when cut by count."""
    return examples / batch_size


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------------------------------------------
# Models


def load_trainable(config: TrainOptions, loader: Callable[..., Any]):
    """A model in float32 master weights (mixed precision and DeepSpeed cast as configured), with LoRA adapters when
    ``--lora-rank`` asks (``rlhf_pipeline.training.lora``). Seeded first: weights the checkpoint does not have (a reward
    model's new score head, the adapters) are initialised from the seed. ``loader(path, trust_remote_code=...,
    **kwargs)`` loads the model (``kwargs``: QLoRA's quantization config, when asked, and the attention
    implementation ``--attn-implementation`` names, ``rlhf_pipeline.attention``)."""
    import torch

    torch.manual_seed(config.seed)
    kwargs = {**load_kwargs(config), **from_pretrained_kwargs(config.attn_implementation)}
    if "quantization_config" not in kwargs:  # float32 whatever the checkpoint holds (transformers 5 loads "auto")
        kwargs["dtype"] = torch.float32
    with reading("model", config.model, MODEL_HINT, only_damaged=True):
        model = loader(config.model, trust_remote_code=config.trust_remote_code, **kwargs)
    model.config.use_cache = False
    disable_dropout(model)  # before the adapters: --lora-dropout is theirs
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return add_adapters(model, config)


def disable_dropout(model: Any) -> None:
    """Dropout off: the reference log-probs are computed without it, so the policy's must be too (as TRL does)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # applied functionally (Llama, Qwen)
            module.attention_dropout = 0.0


# ----------------------------------------------------------------------------------------------------------------
# Metrics


def _step(line: str) -> float:
    """The step a metrics.jsonl line records; infinity for a line that is not a whole record."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


class Metrics:
    """Per-step metrics to OUTPUT/metrics.jsonl (main process) and to the configured tracker."""

    def __init__(self, accelerator, output: Path, resume_step: int):
        self.accelerator = accelerator
        self.path = output / METRICS
        if accelerator.is_main_process and self.path.exists():
            # A resumed run rewrites the steps after its checkpoint; a line a kill or a full disk cut short is not
            # one of the steps to keep
            kept = [l for l in self.path.read_text().splitlines() if resume_step > 0 and _step(l) <= resume_step]
            # atomically: a kill between truncating and writing would lose the steps before the checkpoint
            write_text_atomic(self.path, "".join(l + "\n" for l in kept))

    def log(self, step: int, values: dict[str, float]) -> None:
        record = {"step": step, **{k: float(f"{float(v):.10g}") for k, v in values.items()}}  # 1e-9 rates kept
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        self.accelerator.log(values, step=step)


# Without progress bars (TQDM_DISABLE: batch jobs, CI logs) the trainer prints a line at most this often
STATUS_EVERY_S = 60.0


class StatusLines:
    """Without a progress bar (``TQDM_DISABLE`` set), a line on the main process at most every
    :data:`STATUS_EVERY_S` seconds: the step, its loss and learning rate, the rate and the time left, so that a
    batch job's log says how its run goes."""

    def __init__(self, accelerator, total_steps: int, first_step: int):
        from rlhf_pipeline.progress import bars_disabled

        self.on = accelerator.is_main_process and bars_disabled()
        self.total, self.first = total_steps, first_step
        self.started = self.last = time.monotonic()

    def step(self, step: int, loss: float | None, lr: float) -> None:
        now = time.monotonic()
        if not self.on or loss is None or now - self.last < STATUS_EVERY_S:
            return
        self.last = now
        per_s = (step - self.first) / max(now - self.started, 1e-9)
        left = (self.total - step) / per_s if per_s > 0 else None
        print(f"[train] step {step}/{self.total}: loss {loss:.4g}, lr {lr:.3g}, {per_s * 60:.3g} steps/min"
              + (f", about {_minutes(left)} left" if left is not None else ""), flush=True)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


@dataclass
class DivergenceWatch:
    """Says once when a run looks like it is diverging: the step's gradient norm (before clipping) has grown
    ``factor``-fold over the first step's while the loss has not fallen below the first step's (a reward model whose
    margins grow has growing gradients and a falling loss: that is learning), or the loss's magnitude has grown
    ``factor``-fold over the first step's (taken as at least ``loss_floor``, so that a loss that starts near 0, as the
    PPO family's does, is not flagged for ordinary moves), or the loss is not finite. The usual causes: a learning rate too high for the model, and for REBEL an
    ``--eta`` too small for the scale of the reward gaps (``--reward-gap-scale rms`` removes that scale)."""

    factor: float = 30.0
    loss_floor: float = 0.1
    first_loss: float | None = None
    first_grad_norm: float | None = None
    warned: bool = False

    def check(self, step: int, loss: float, grad_norm: float | None) -> str | None:
        if self.first_loss is None:
            self.first_loss = loss
        if grad_norm is not None and self.first_grad_norm is None:
            self.first_grad_norm = grad_norm
        if self.warned:
            return None
        grew = []
        if not math.isfinite(loss):
            grew.append(f"the loss is {loss}")
        elif abs(loss) > self.factor * max(abs(self.first_loss), self.loss_floor):
            grew.append(f"the loss went from {self.first_loss:.4g} at the first step to {loss:.4g}")
        if (grad_norm is not None and self.first_grad_norm and grad_norm > self.factor * self.first_grad_norm
                and loss >= self.first_loss):
            grew.append(f"the gradient norm went from {self.first_grad_norm:.4g} to {grad_norm:.4g} "
                        f"({grad_norm / self.first_grad_norm:.0f}-fold)")
        if not grew:
            return None
        self.warned = True
        return (f"step {step}: {'; '.join(grew)}: the run may be diverging; lower --learning-rate (for REBEL, raise "
                "--eta or pass --reward-gap-scale rms)")


def weights_finite(accelerator, model) -> bool:
    """Whether every trained weight of the model is finite, on every process (under ZeRO-3 each checks its
    partitions). Frozen weights never change, and QLoRA's under DeepSpeed are 4-bit codes packed into float storage,
    where some byte patterns read as NaN: only those that train are checked."""
    import torch

    ok = True
    for p in model.parameters():
        if not p.requires_grad:
            continue
        local = getattr(p, "ds_tensor", None)
        data = local if local is not None else p.data
        if data.numel() and not bool(torch.isfinite(data).all()):
            ok = False
            break
    return not anywhere(accelerator, not ok)


def tracker_config(config) -> dict[str, Any]:
    """The run's options as the trackers take them: TensorBoard's hparams take numbers, text and booleans only, so a
    list (--lora-target-modules) or a mapping is given as its JSON text."""
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v, default=str)
            for k, v in vars(config).items() if v is not None}


def start_trackers(accelerator, config, output: Path, step: int) -> None:
    """Start ``--report-to``'s tracker, continuing the run's own under ``--resume`` (from ``step``; 0 without a
    checkpoint): TensorBoard (in OUTPUT/runs) drops the events an interrupted attempt logged after that step, so no
    step is plotted twice; wandb goes on with the run of the same id (kept in OUTPUT/runs/wandb_run_id; or
    ``$WANDB_RUN_ID``) in ``$WANDB_PROJECT`` (default rlhf-pipeline) rather than starting a second one."""
    if config.report_to == "none":
        return
    if config.report_to == "wandb":
        project = os.environ.get("WANDB_PROJECT") or "rlhf-pipeline"
        init = {"id": _wandb_run_id(accelerator, output, config.resume),
                "resume": os.environ.get("WANDB_RESUME") or "allow"}
    else:
        project, init = TRACKER_DIR, ({"purge_step": step + 1 if step else 0} if config.resume else {})
    accelerator.init_trackers(project, config=tracker_config(config), init_kwargs={config.report_to: init})


def _wandb_run_id(accelerator, output: Path, resume: bool) -> str:
    """``$WANDB_RUN_ID``, else under ``--resume`` the id the run started with, else a new one; kept in
    OUTPUT/runs/wandb_run_id for a resume."""
    path = output / TRACKER_DIR / "wandb_run_id"
    if os.environ.get("WANDB_RUN_ID"):
        run_id = os.environ["WANDB_RUN_ID"]
    elif resume and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    else:
        run_id = secrets.token_hex(8)
    if accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, run_id + "\n")
    return run_id


def nonfinite_stop(accelerator, step: int, skipped_in_a_row: int, last_loss: float | None) -> PipelineError:
    last = f"the last finite loss was {last_loss:.6g}" if last_loss is not None else "no step had a finite loss"
    return stop_everywhere(
        accelerator,
        f"step {step}: the loss or the gradients were not finite for {skipped_in_a_row} "
        f"step{'s' if skipped_in_a_row != 1 else ''} in a row (each skipped, no update applied); {last}. Lower "
        "--learning-rate, keep --max-grad-norm on, try without --bf16, and check the data for extreme or non-finite "
        "rewards; nothing was saved as a finished model (--max-nonfinite-steps sets how many in a row stop the run)",
    )


def nonfinite_weights(accelerator, step: int, what: str) -> PipelineError:
    return stop_everywhere(
        accelerator,
        f"step {step}: the weights hold non-finite values, so {what} was written; lower --learning-rate and start "
        "over (--overwrite), or resume from an earlier checkpoint with the same options",
    )


def add_to_sums(sums: dict[str, Any], loss, metrics: dict[str, Any], n: int, weight: float = 1.0) -> None:
    """Accumulate a micro-batch's mean loss and per-example metrics as sums over examples (``_n`` counts them), in
    float64 tensors where they are (on the device), which ``reduce_sums`` reads once: a ``float()`` here would make
    the host wait for every forward. A stand-in (``weight`` 0) adds zeros under the same keys, even where its values
    are not finite. :func:`means` turns the sums into the metrics."""
    def add(key: str, value) -> None:
        value = value.detach().double()
        sums[key] = sums.get(key, 0.0) + (value * weight if weight else value.new_zeros(()))

    add("loss", loss.double() * n)
    for k, v in metrics.items():
        add(k, v.float().sum())
    sums["_n"] = sums.get("_n", 0.0) + weight * n


def evaluate(accelerator, model, task: TrainTask, ds, batch_size: int) -> dict[str, float]:
    """Mean loss and metrics over a split, every example counted once across processes."""
    import torch

    if ds is None or ds.num_rows == 0:
        return {}
    model.eval()
    if hasattr(task, "begin_step"):
        task.begin_step(accelerator, model, None)
    if hasattr(task, "begin_eval"):
        task.begin_eval(ds)
    sums: dict[str, float] = {}
    lengths = task.lengths(ds)
    with torch.no_grad():
        for batch in sharded_batches(lengths, batch_size, accelerator.num_processes, accelerator.process_index):
            idx = batch if batch is not None else [0]  # a stand-in forward keeps ZeRO-3 in step
            with accelerator.autocast():
                loss, metrics, _ = task.loss(model, task.collate(ds.select(idx).to_list()))
            # The stand-in adds zeros, but the same keys on every process.
            add_to_sums(sums, loss, metrics, len(idx), weight=0.0 if batch is None else 1.0)
    model.train()
    return means(reduce_sums(accelerator, sums))


def means(totals: dict[str, float]) -> dict[str, float]:
    """The loss and metrics of sums (``add_to_sums``, over a step, a split or a logging window): each sum over the
    examples' count ``_n``, or over its ``@weight`` sum (``layout.METRIC_WEIGHT``; left out where that is 0: a
    mean over no tokens, or KTO's over a label no response of the window had). Keys that start with ``_``, and
    ``grad_norm``, are the caller's."""
    n = totals.get("_n", 0.0)
    if not n:
        return {}
    out = {}
    for key, value in totals.items():
        if key.startswith("_") or key.endswith(METRIC_WEIGHT) or key == "grad_norm":
            continue
        weight = totals.get(key + METRIC_WEIGHT)
        if weight is None:
            out[key] = value / n
        elif weight:
            out[key] = value / weight
    return out


# ----------------------------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainResult:
    steps: int
    first_loss: float | None
    last_loss: float | None
    final_eval: dict[str, float]
    real_tokens: int
    all_tokens: int  # token positions processed, padding included
    seconds: float  # the training loop's, over every attempt of a resumed run (to its checkpoints)
    skipped_steps: int = 0  # steps whose loss or gradients were not finite: no update applied
    resumed_from_step: int = 0  # the checkpoint's step this attempt went on from; 0: trained from the start
    rows_left_per_epoch: int = 0  # training examples past the epoch's last full global batch (others each epoch)


@dataclass
class Setup:
    """A prepared model, optimizer and schedule (``prepare``), ready for ``train``."""

    model: Any
    optimizer: Any
    scheduler: Any
    steps_per_epoch: int
    total_steps: int
    global_size: int
    masters: MasterWeights | None = None  # --bf16-weights outside DeepSpeed: the float32 copies the optimizer steps
    rows_left_per_epoch: int = 0  # what global_batches leaves out of each epoch

    def trained_parameters(self) -> list:
        """What the optimizer steps and the gradient norm is taken over: the masters, or the model's parameters."""
        if self.masters is not None:
            return self.masters.masters
        return [p for p in self.model.parameters() if p.requires_grad]


def prepare(
    config: TrainOptions, accelerator, model, num_train_rows: int, learning_rate: Callable[[str], float] | None = None
) -> Setup:
    """Wrap the model and an AdamW + warmup/cosine schedule for (distributed) training. ``learning_rate(name)``
    gives a parameter its own peak rate (a critic trained beside a policy); by default all share
    ``config.learning_rate``."""
    import torch

    world = accelerator.num_processes
    global_size = config.batch_size * config.gradient_accumulation_steps * world
    if num_train_rows < global_size:
        raise PipelineError(
            f"{config.data}: {num_train_rows} training examples, fewer than one global batch of {global_size} "
            f"(batch size {config.batch_size} x accumulation {config.gradient_accumulation_steps} x {world} "
            "processes); lower --batch-size or --gradient-accumulation-steps"
        )
    steps_per_epoch, left = divmod(num_train_rows, global_size)
    total_steps = config.max_steps or steps_per_epoch * config.epochs
    if left and accelerator.is_main_process:
        log.warning("%s: %d of the %d training examples do not fill a last global batch of %d and are left out of "
                    "each epoch (others each epoch: the order is shuffled anew); a batch size x accumulation x "
                    "processes that divides %d trains on every one", config.data, left, num_train_rows, global_size,
                    num_train_rows)
    warmup = int(config.warmup_ratio * total_steps)
    torch.manual_seed(config.seed)
    deepspeed = accelerator.state.deepspeed_plugin is not None
    masters = None
    if not deepspeed:  # on its device before the optimizer is built (the masters are made there; fused AdamW)
        model = accelerator.prepare(model)
        if config.bf16_weights:  # (DeepSpeed's bf16 mode keeps masters of its own)
            masters = MasterWeights(model)
        if config.compile:  # after the cast: the layers are traced with the weights they train with (refused under
            compile_decoder_layers(model, config.model)  # DeepSpeed before any work: training.stage.run_training)
    if masters is not None:
        trained = masters.named_masters()
    else:
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups: dict[tuple[float, float], list] = {}
    for name, p in trained:
        shape = getattr(p, "ds_shape", p.shape)  # under zero.Init a parameter is an empty 1-D shard
        decay = 0.0 if len(shape) < 2 or "norm" in name.lower() else config.weight_decay
        lr = learning_rate(name) if learning_rate is not None else config.learning_rate
        groups.setdefault((decay, lr), []).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": ps, "weight_decay": decay, "lr": lr} for (decay, lr), ps in groups.items()],
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        # one kernel for all the weights on a GPU (DeepSpeed replaces the optimizer's step with its own)
        fused=accelerator.device.type == "cuda" and not deepspeed,
    )
    if deepspeed:
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        optimizer = accelerator.prepare(optimizer)
    # Built on the prepared optimizer (DeepSpeed regroups the parameters) and stepped by hand once per optimizer
    # step: a scheduler given to accelerate.prepare would be stepped once per process. Not in the checkpoints
    # (accelerate would pickle it, and loading a pickle can run code): a resumed run sets it to its step
    # (scheduler_at), of which it is a function.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, total_steps))
    return Setup(model, optimizer, scheduler, steps_per_epoch, total_steps, global_size, masters, left)


def scheduler_at(scheduler, step: int) -> None:
    """``scheduler`` (a ``LambdaLR`` of the step) and its optimizer's rates as they were after ``step`` updates."""
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():  # its own step, not the optimizer's: torch would warn that none came before it
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()


def train(
    config: TrainOptions,
    accelerator,
    setup: Setup,
    tokenizer,
    task: TrainTask,
    train_ds,
    eval_ds,
) -> TrainResult:
    """Run the optimisation; save checkpoints and the final model into ``config.output``.

    The task's metrics (``loss``, ``accuracy``, ...) are logged under the names ``layout.metric_names`` gives them.
    """
    import torch
    from tqdm.auto import tqdm

    from rlhf_pipeline.layout import metric_names

    model, optimizer, scheduler = setup.model, setup.optimizer, setup.scheduler
    output = Path(config.output).expanduser()
    world, rank = accelerator.num_processes, accelerator.process_index
    lengths = task.lengths(train_ds)
    budget = config.max_tokens_per_micro_batch
    over = [n for n in lengths if budget is not None and n > budget]
    if over and accelerator.is_main_process:
        log.warning("%d training example(s) hold more than --max-tokens-per-micro-batch %d tokens (the longest %d); "
                    "each runs as a micro-batch of its own", len(over), budget, max(over))
    output.mkdir(parents=True, exist_ok=True)
    model.train()

    checkpoint, totals_so_far = (resume_checkpoint(accelerator, model, output, setup.masters) if config.resume
                                 else (None, {}))
    step = resumed_from = totals_so_far.get("step", 0)
    if checkpoint is not None:
        accelerator.print(f"resuming from {checkpoint} (step {step})")
        scheduler_at(scheduler, step)
    start_trackers(accelerator, config, output, step)
    metrics = Metrics(accelerator, output, step)
    baseline = evaluate(accelerator, model, task, eval_ds, config.eval_batch_size) if step == 0 else {}
    if baseline:  # the test split before any update
        metrics.log(0, metric_names(baseline, "eval"))

    first_loss = last_loss = totals_so_far.get("first_loss")
    last_loss = totals_so_far.get("last_loss", last_loss)
    skipped = totals_so_far.get("skipped_steps", 0)
    skipped_in_a_row = totals_so_far.get("skipped_in_a_row", 0)
    engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    real_tokens = totals_so_far.get("real_tokens", 0)
    all_tokens = totals_so_far.get("all_tokens", 0)
    started = time.time() - totals_so_far.get("seconds", 0.0)
    total_steps = setup.total_steps
    watch = DivergenceWatch(first_loss=first_loss, first_grad_norm=totals_so_far.get("first_grad_norm"),
                            warned=totals_so_far.get("divergence_warned", False))
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=quiet(accelerator))
    first_step = step  # of this process: its scheduler has not stepped yet
    status = StatusLines(accelerator, total_steps, step)
    window: dict[str, float] = dict(totals_so_far.get("log_window") or {})  # the steps not logged yet, summed
    while step < total_steps:
        epoch, position = divmod(step, setup.steps_per_epoch)
        batch_ids = global_batches(train_ds.num_rows, setup.global_size, config.seed, epoch)[position]
        t0 = time.time()
        # The step's sums over its examples and its non-finite flag, accumulated as tensors where the losses live
        # and read once, at the boundary (add_to_sums, reduce_sums): no wait for the device per micro-batch.
        sums: dict[str, Any] = {}
        nonfinite: Any = 0.0  # > 0: a micro-batch's loss was not finite
        if hasattr(task, "begin_step"):
            task.begin_step(accelerator, model, train_ds.select(batch_ids))
        mine = step_micro_batches(batch_ids, lengths, config, world, rank)
        stand_in = [min(batch_ids, key=lambda i: (lengths[i], i))]  # the cheapest forward of the step
        for k, ids in enumerate(mine):
            last = k == len(mine) - 1
            stand = ids is None  # a stand-in: a forward and backward of weight 0, keeping ZeRO-3's collectives in step
            rows = stand_in if stand else ids
            batch = task.collate(train_ds.select(rows).to_list())
            if engine is not None:
                begin_deepspeed_micro_batch(engine)
            # The boundary, taken here rather than counted by accelerator.accumulate (which expects exactly
            # --gradient-accumulation-steps micro-batches): the prepared optimizer steps and zeroes only under it.
            accelerator.sync_gradients = last
            weight = 0.0 if stand else micro_batch_weight(len(rows), config.batch_size)
            with accelerator.autocast():
                # autocast by hand: logprobs calls the decoder and LM head directly, not model.forward
                loss, per_example, (real, total) = task.loss(model, batch)
                scaled = loss if weight == 1.0 else loss * weight
                if engine is not None:  # DeepSpeed: its step is taken below, or skipped (see skip_deepspeed_step)
                    engine.set_gradient_accumulation_boundary(is_boundary=last)
                    engine.backward(scaled)
                else:
                    accelerator.backward(scaled)
            if not stand:
                nonfinite = nonfinite + (~torch.isfinite(loss.detach())).any()
            # a stand-in adds zeros, under the same keys as on every process (reduce_sums stacks them)
            add_to_sums(sums, loss, per_example, len(rows), 0.0 if stand else 1.0)
            sums["_real"] = sums.get("_real", 0.0) + (0 if stand else real)
            sums["_total"] = sums.get("_total", 0.0) + total  # a stand-in's positions are processed too
        # The boundary: the sums and the flag (with the gradient norm, outside DeepSpeed) come to the host in one
        # read, reduced over the processes, so every process reaches the same verdict before the update.
        sums["_nonfinite"] = nonfinite
        if engine is not None:
            totals = reduce_sums(accelerator, sums)
            bad = totals.pop("_nonfinite") > 0 or deepspeed_grads_nonfinite(engine)
            if bad:
                skip_deepspeed_step(engine)
            else:
                engine.step()
                # DeepSpeed skips a step itself when the norm it computes is not finite (every process alike):
                # counted as skipped too
                bad = not engine.was_step_applied()
                # before clipping, as DeepSpeed computed it (clipping or not): the run's first divergence signal
                grad_norm = engine.get_global_grad_norm()
                if grad_norm is not None and not bad:
                    totals["grad_norm"] = float(grad_norm)
        else:
            grad_norm = accelerator.clip_grad_norm_(setup.trained_parameters(), config.max_grad_norm or math.inf)
            if grad_norm is not None:
                sums["grad_norm"] = grad_norm / world  # the same value on every process (all-reduced grads)
            totals = reduce_sums(accelerator, sums)
            bad = totals.pop("_nonfinite") > 0 or not math.isfinite(totals.get("grad_norm", 0.0))
            if not bad:
                optimizer.step()
                if setup.masters is not None:
                    setup.masters.write_back()
            optimizer.zero_grad()
        # The rate this step's update used: after scheduler.step() get_last_lr() is already the next step's.
        step_lr = scheduler.get_last_lr()[0]
        if engine is not None and step == first_step:
            # torch's scheduler warns at its first step when it saw no optimizer.step() before it: DeepSpeed's engine
            # steps the optimizer itself, and the rates are the single-process run's all the same (tested). Only
            # around that one call: leaving catch_warnings resets which warnings were shown, so doing it every step
            # would repeat every once-only warning of the run every step.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                scheduler.step()
        else:
            scheduler.step()
        step += 1
        bar.update(1)
        if bad:
            skipped += 1
            skipped_in_a_row += 1
            if accelerator.is_main_process:
                log.warning("step %d: the loss or the gradients were not finite; the step was skipped (no update), "
                            "%d in a row", step, skipped_in_a_row)
            if skipped_in_a_row >= config.max_nonfinite_steps:
                metrics.log(step, {"train/skipped_steps": skipped, "lr": step_lr})
                raise nonfinite_stop(accelerator, step, skipped_in_a_row, last_loss)
        else:
            skipped_in_a_row = 0
            real_tokens += int(totals["_real"])
            all_tokens += int(totals["_total"])
            step_loss = totals["loss"] / totals["_n"]
            first_loss = step_loss if first_loss is None else first_loss
            last_loss = step_loss
            warning = watch.check(step, step_loss, totals.get("grad_norm"))
            if warning is not None and accelerator.is_main_process:
                log.warning(warning)
            # The logged line is the mean over the applied steps since the last one (--logging-steps): their sums
            # added up, with the steps' seconds for the throughput and a count of the steps with a gradient norm
            totals.update(_seconds=time.time() - t0, _norms=1.0 if "grad_norm" in totals else 0.0)
            for key, value in totals.items():
                window[key] = window.get(key, 0.0) + value
            bar.set_postfix(loss=f"{step_loss:.4f}")
        if window and (step % config.logging_steps == 0 or step == total_steps):  # a skipped last step too
            values = metric_names(means(window), "train")
            if window["_norms"]:
                values["grad_norm"] = window["grad_norm"] / window["_norms"]
            values["lr"] = step_lr
            values["epoch"] = step / setup.steps_per_epoch
            values["throughput/tokens_per_s"] = window["_real"] / max(window["_seconds"], 1e-9)
            values["throughput/real_token_fraction"] = window["_real"] / max(window["_total"], 1)
            values["train/skipped_steps"] = skipped
            metrics.log(step, values)
            window = {}
        elif bad:  # a skipped step logs the running count and its rate (no loss)
            metrics.log(step, {"train/skipped_steps": skipped, "lr": step_lr})
        status.step(step, None if bad else last_loss, step_lr)
        if config.eval_every and step % config.eval_every == 0 and step < total_steps:
            metrics.log(step, metric_names(evaluate(accelerator, model, task, eval_ds, config.eval_batch_size), "eval"))
        if config.save_every and step % config.save_every == 0 and step < total_steps:
            if not weights_finite(accelerator, model):
                raise nonfinite_weights(accelerator, step, "no checkpoint")
            state = {"step": step, "epoch": epoch, "processes": accelerator.num_processes,
                     "zero_stage": zero_stage(accelerator),
                     "first_loss": first_loss, "first_grad_norm": watch.first_grad_norm,
                     "divergence_warned": watch.warned,
                     "real_tokens": real_tokens, "last_loss": last_loss, "skipped_steps": skipped,
                     "skipped_in_a_row": skipped_in_a_row,
                     "all_tokens": all_tokens, "seconds": time.time() - started, "log_window": window}
            save_checkpoint(accelerator, model, tokenizer, output, state, keep=config.save_total_limit or None,
                            masters=setup.masters)
    bar.close()
    if first_loss is None and skipped:  # fewer steps than --max-nonfinite-steps, every one skipped: nothing trained
        raise nonfinite_stop(accelerator, step, skipped_in_a_row, last_loss)

    final_eval = evaluate(accelerator, model, task, eval_ds, config.eval_batch_size)
    if final_eval:
        metrics.log(step, metric_names(final_eval, "eval"))
    accelerator.wait_for_everyone()
    if not weights_finite(accelerator, model):  # every non-finite step was skipped: a safety net, before any write
        raise nonfinite_weights(accelerator, step, "no finished model")
    save_model(accelerator, model, tokenizer, output, setup.masters)
    accelerator.wait_for_everyone()
    for tracker in accelerator.trackers:
        # not accelerator.end_training(), which also destroys the process group that the stage's last steps (its
        # manifest, the upload) still synchronise over: a multi-process run with a tracker failed at its end
        tracker.finish()
    return TrainResult(step, first_loss, last_loss, final_eval, real_tokens, all_tokens, time.time() - started,
                       skipped_steps=skipped, resumed_from_step=resumed_from,
                       rows_left_per_epoch=setup.rows_left_per_epoch)


def deepspeed_grads_nonfinite(engine) -> bool:
    """After the boundary backward: whether this step's reduced gradients hold inf or NaN on any process. ZeRO's
    optimizers check their own partitions and all-reduce the verdict (``has_overflow``, what DeepSpeed's fp16 loss
    scaler uses); otherwise every process checks the gradients it holds."""
    import torch

    optimizer = engine.optimizer
    if hasattr(optimizer, "has_overflow"):
        try:
            return bool(optimizer.has_overflow(partition_gradients=True))
        except TypeError:
            return bool(optimizer.has_overflow())
    local = any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in engine.module.parameters())
    flag = torch.tensor([1.0 if local else 0.0], device=engine.device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag)
    return bool(flag.item() > 0)


def skip_deepspeed_step(engine) -> None:
    """Leave out the update that DeepSpeed's ``engine.step()`` would apply at this boundary, and do instead what that
    step does when it finds an overflow (the skip DeepSpeed's fp16 loss scaling relies on, here taken for any
    reason): the optimizer drops the window's gradients and restarts its micro-batch count, so the next window's
    first micro-batch overwrites the gradient partitions instead of adding to them (ZeRO-3: ``_pre_step`` and
    ``_overflow_clean_up`` of ``zero/stage3.py``'s step; ZeRO-1/2: the overflow branch of ``zero/stage_1_and_2.py``'s
    step), and the engine counts a skipped step as its ``_take_model_step`` and ``step`` do. The master weights,
    the Adam moments and their step counts are not touched: no optimizer step runs. The learning-rate schedule is
    the loop's own and advances for every step, skipped or not, on every path."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "_overflow_clean_up"):  # ZeRO-3
        if hasattr(optimizer, "_pre_step"):
            optimizer._pre_step()
        optimizer._overflow_clean_up(getattr(optimizer, "loss_scale", None))
    elif hasattr(optimizer, "averaged_gradients") and hasattr(optimizer, "micro_step_id"):  # ZeRO-1/2
        optimizer.micro_step_id = -1  # its INITIAL_MICRO_STEP_ID, as its step() sets first
        if hasattr(optimizer, "_wait_for_offload_copies"):
            optimizer._wait_for_offload_copies()
        optimizer.zero_grad(set_to_none=True)
        if hasattr(optimizer, "_release_preflattened_grad_buffers"):
            optimizer._release_preflattened_grad_buffers()
        if getattr(optimizer, "cpu_offload", False):
            if hasattr(optimizer, "_offload_accumulated_param_ids"):
                optimizer._offload_accumulated_param_ids = set()
            optimizer.reset_cpu_buffers()
        else:
            all_grad_tensors = getattr(optimizer, "all_grad_tensors", {})
            for k in list(optimizer.averaged_gradients):
                optimizer.averaged_gradients[k] = None
                all_grad_tensors[k] = None
    elif hasattr(optimizer, "zero_grad"):  # no ZeRO: BF16_Optimizer clears its low- and high-precision gradients
        optimizer.zero_grad()
    engine.zero_grad()
    engine.skipped_steps += 1
    engine.global_steps += 1
    if hasattr(engine, "global_samples") and hasattr(engine, "train_batch_size"):
        engine.global_samples += engine.train_batch_size()
    if hasattr(engine, "micro_steps"):
        engine.micro_steps += 1  # engine.step() counts itself, once per optimizer step in this loop


def begin_deepspeed_micro_batch(engine) -> None:
    """What ``engine.forward`` does first, for a loss that calls the model's parts directly (``logprobs`` runs the
    decoder and the LM head, never ``engine.forward``): ZeRO's optimizers count the micro-batches of an accumulation
    window there (``clear_backward_seen_flag``; ZeRO-3 adds a micro-batch's reduced gradient partition to the
    window's only from its second micro-batch on, and without the count copies it over them, so all but the last
    micro-batch's gradients were lost)."""
    clear = getattr(engine.optimizer, "clear_backward_seen_flag", None)
    if clear is not None:
        clear()
