"""The training loop shared by every training stage: accelerate (+ DeepSpeed), AdamW, warmup + cosine, clipping,
length-grouped dynamic batches, evaluation, metrics, Hugging Face checkpoints and resume.

A stage supplies a :class:`TrainTask` (how to collate rows and compute the loss) and calls :func:`train`. The same
code runs single-process on a CPU and under ``accelerate launch --config_file accelerate_cfgs/zero3.yaml`` on many
GPUs.

Batches. An optimizer step sees a *global batch* of ``batch_size x gradient_accumulation_steps x num_processes``
examples, drawn from a seeded permutation of the data, so the examples of each step do not depend on how they are
split. The global batch is sorted by length and cut into micro-batches of ``batch_size``: micro-batch ``a * world
+ rank`` goes to process ``rank`` at accumulation step ``a``. Each micro-batch is padded to its own longest
sequence. The loss is a per-example mean, so batch 8 x accumulation 1, batch 1 x accumulation 8 and 2 processes x
batch 4 all compute the same update.

Output directory::

    OUTPUT/                  the final model (save_pretrained, safetensors) + tokenizer: vLLM and from_pretrained load it
    OUTPUT/manifest.json     written last: the run completed
    OUTPUT/metrics.jsonl     one JSON object per logged step ({"step", "loss/train", ...}); TensorBoard in OUTPUT/runs
    OUTPUT/checkpoints/step_N/   a save_pretrained model + state/ (optimizer, scheduler, RNG) + trainer_state.json

``--resume`` continues from the newest complete checkpoint; checkpoints are written to a temporary name and
renamed, so a crash while saving leaves the previous one intact.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Protocol, Sequence

from rlhf_pipeline.config import OutputOptions, option
from rlhf_pipeline.errors import PipelineError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"


@dataclass(kw_only=True)
class TrainOptions(OutputOptions):
    """Options every training stage shares."""

    model: str = option(help="Model to start from: a local directory or a Hub model id.")
    data: str = option(help="Training data with train and test splits (directory or Hub id).", semantic=False)
    epochs: int = option(1, help="Passes over the training data (ignored when --max-steps is set).")
    max_steps: Optional[int] = option(None, help="Stop after this many optimizer steps.")
    batch_size: int = option(4, help="Examples per process per forward pass (micro-batch).")
    gradient_accumulation_steps: int = option(1, help="Micro-batches per optimizer step.")
    learning_rate: float = option(1e-6, help="Peak learning rate of AdamW.")
    weight_decay: float = option(0.0, help="AdamW weight decay.")
    adam_beta1: float = option(0.9, help="AdamW beta1.")
    adam_beta2: float = option(0.999, help="AdamW beta2 (REBEL's and OpenRLHF's runs use 0.95).")
    adam_epsilon: float = option(1e-8, help="AdamW epsilon.")
    warmup_ratio: float = option(0.1, help="Fraction of the steps spent warming the learning rate up (then cosine).")
    max_grad_norm: float = option(1.0, help="Clip the global gradient norm to this value (0 = no clipping).")
    bf16: bool = option(False, help="bfloat16 mixed precision.")
    gradient_checkpointing: bool = option(False, help="Recompute activations in the backward pass to save memory.")
    pack_ratio: float = option(
        2.0,
        help="Pack each micro-batch's sequences into rows of up to this many times its longest sequence, kept apart "
        "by position ids (block-diagonal attention), instead of padding each to the longest; 0 = pad. With "
        "flash-attention a larger value (e.g. 8) only helps; see rlhf_pipeline.logprobs.",
        semantic=False,
    )
    eval_every: int = option(0, help="Evaluate on the test split every N steps (0 = at the end only).")
    eval_batch_size: int = option(8, help="Examples per process per evaluation forward.", semantic=False)
    save_every: int = option(0, help="Save a resumable checkpoint every N steps (0 = final model only).")
    logging_steps: int = option(1, help="Log metrics every N steps.", semantic=False)
    resume: bool = option(False, help="Continue an interrupted run from its newest checkpoint.", semantic=False)
    seed: int = option(0, help="Seed of the data order and of anything random in training.")
    report_to: Literal["tensorboard", "wandb", "none"] = option(
        "tensorboard", help="Where metrics go besides metrics.jsonl.", semantic=False
    )
    trust_remote_code: bool = option(False, help="Allow custom model code from the model repo (off by default).")

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "gradient_accumulation_steps", "eval_batch_size", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("--max-steps must be at least 1")
        if self.pack_ratio and self.pack_ratio < 1:
            raise ValueError("--pack-ratio must be 0 (pad) or at least 1")


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


def sharded_batches(lengths: Sequence[int], batch_size: int, world: int, rank: int) -> list[list[int] | None]:
    """Length-sorted inference batches for this process. Every process gets the same number of entries (``None``
    where it has nothing left) because under ZeRO-3 all processes must run each forward together."""
    ordered = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches = [ordered[k : k + batch_size] for k in range(0, len(ordered), batch_size)]
    mine: list[list[int] | None] = batches[rank::world]
    rounds = math.ceil(len(batches) / world)
    return mine + [None] * (rounds - len(mine))


def sharded_inference(accelerator, model, lengths: Sequence[int], batch_size: int,
                      compute: Callable[[list[int]], list[Any]], desc: str) -> list[Any]:
    """``compute(ids)`` (one result per row id) over every row, without gradients, in length-sorted batches shared
    over the processes, gathered so that every process returns ``results[row]`` for all rows. A process with no
    batch left runs a stand-in on row 0 (discarded), so ZeRO-3's collective forwards stay in step."""
    import torch
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    batches = sharded_batches(lengths, batch_size, accelerator.num_processes, accelerator.process_index)
    results: list[tuple[int, Any]] = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for idx in tqdm(batches, desc=desc, unit="batch", disable=quiet(accelerator)):
            with accelerator.autocast():
                values = compute(idx if idx is not None else [0])
            if idx is not None:
                results += zip(idx, values)
    model.train(was_training)
    if accelerator.num_processes > 1:
        results = gather_object(results)
    out: list[Any] = [None] * len(lengths)
    for i, value in results:
        out[i] = value
    return out


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------------------------------------------
# Accelerate and models


def _cpu_deepspeed_backend() -> None:
    """Let DeepSpeed run distributed on CPUs (``DS_ACCELERATOR=cpu``, gloo), as the tests here do.

    accelerate only initialises a process group for DeepSpeed when it finds a GPU; without one it would treat each
    process as a lone worker while DeepSpeed itself sees them all. Telling accelerate the backend is gloo makes both
    agree. Does nothing on GPU machines or outside ``accelerate launch``.
    """
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if (
        os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true"
        or torch.cuda.is_available()
        or int(os.environ.get("LOCAL_RANK", -1)) == -1
    ):
        return

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", DistributedType.MULTI_CPU

    PartialState._prepare_backend = prepare_backend


def make_accelerator(config: TrainOptions):
    from accelerate import Accelerator

    _cpu_deepspeed_backend()
    accelerator = Accelerator(
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        mixed_precision="bf16" if config.bf16 else "no",
        log_with=None if config.report_to == "none" else config.report_to,
        project_dir=str(Path(config.output).expanduser()),
    )
    if accelerator.num_processes > 1 and accelerator.state.deepspeed_plugin is None:
        # logprobs.token_logps calls the decoder and LM head directly, which DDP's gradient sync would miss.
        raise PipelineError(
            f"{accelerator.num_processes} processes without DeepSpeed: the trainer runs multi-process only under "
            "DeepSpeed; launch with --config_file accelerate_cfgs/zero2.yaml (or zero3.yaml)"
        )
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        # We build batches ourselves (no DataLoader for accelerate to read sizes from), so tell DeepSpeed.
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = config.batch_size
        ds["gradient_accumulation_steps"] = config.gradient_accumulation_steps
        ds["train_batch_size"] = config.batch_size * config.gradient_accumulation_steps * accelerator.num_processes
        ds["gradient_clipping"] = config.max_grad_norm
    return accelerator


def load_trainable(config: TrainOptions, loader: Callable[..., Any]):
    """A model in float32 master weights (mixed precision and DeepSpeed cast as configured). Seeded first: weights
    the checkpoint does not have (a reward model's new score head) are initialised from the seed."""
    import torch

    torch.manual_seed(config.seed)
    model = loader(config.model, trust_remote_code=config.trust_remote_code)
    model.config.use_cache = False
    disable_dropout(model)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def disable_dropout(model: Any) -> None:
    """Dropout off: the reference log-probs are computed without it, so the policy's must be too (as TRL does)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # applied functionally (Llama, Qwen)
            module.attention_dropout = 0.0


def on_main_process(accelerator, fn: Callable[[], Any]) -> None:
    """Run ``fn`` on the main process only; if it fails, every process raises instead of waiting forever."""
    from accelerate.utils import broadcast_object_list

    error = None
    if accelerator.is_main_process:
        try:
            fn()
        except Exception as e:  # reported to every process below, then re-raised here
            error = e
    if accelerator.num_processes > 1:
        flag = [None if error is None else f"{type(error).__name__}: {error}"]
        broadcast_object_list(flag)
        if flag[0] is not None and error is None:
            raise RuntimeError(f"the main process failed: {flag[0]}")
    if error is not None:
        raise error


def quiet(accelerator) -> bool:
    """Progress bars off on all but the main process, and everywhere when TQDM_DISABLE is set (an explicit
    ``disable=`` would otherwise override tqdm's own reading of it)."""
    from rlhf_pipeline.progress import bars_disabled

    return not accelerator.is_main_process or bars_disabled()


def unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints


def save_model(accelerator, model, tokenizer, path: Path) -> None:
    """A full save_pretrained directory (safetensors); under ZeRO-3 the shards are gathered first."""
    state_dict = accelerator.get_state_dict(model)  # collective under ZeRO-3: every process calls it

    def write() -> None:
        unwrap(model).save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(path)

    on_main_process(accelerator, write)


def save_checkpoint(accelerator, model, tokenizer, output: Path, state: dict[str, Any]) -> Path:
    """Model + resumable state at ``output/checkpoints/step_N``, renamed into place once complete."""
    final = output / CHECKPOINTS / f"step_{state['step']:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_model(accelerator, model, tokenizer, tmp)
    accelerator.save_state(str(tmp / "state"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    accelerator.wait_for_everyone()
    return final


def latest_checkpoint(output: Path) -> Path | None:
    root = output / CHECKPOINTS
    done = sorted(p for p in root.glob("step_*") if (p / TRAINER_STATE).exists()) if root.exists() else []
    return done[-1] if done else None


# ----------------------------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    """Per-step metrics to OUTPUT/metrics.jsonl (main process) and to the configured tracker."""

    def __init__(self, accelerator, output: Path, resume_step: int):
        self.accelerator = accelerator
        self.path = output / "metrics.jsonl"
        if accelerator.is_main_process and self.path.exists():
            # A resumed run rewrites the steps after its checkpoint.
            kept = [
                l for l in self.path.read_text().splitlines()
                if l and resume_step > 0 and json.loads(l)["step"] <= resume_step
            ]
            self.path.write_text("".join(l + "\n" for l in kept))

    def log(self, step: int, values: dict[str, float]) -> None:
        record = {"step": step, **{k: round(float(v), 8) for k, v in values.items()}}
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        self.accelerator.log(values, step=step)


def reduce_sums(accelerator, sums: dict[str, float]) -> dict[str, float]:
    """Sum each value over all processes."""
    import torch

    if accelerator.num_processes == 1:
        return dict(sums)
    keys = sorted(sums)
    t = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=accelerator.device)
    t = accelerator.reduce(t, reduction="sum")
    return dict(zip(keys, t.tolist()))


def add_to_sums(sums: dict[str, float], loss, metrics: dict[str, Any], n: int, weight: float = 1.0) -> None:
    """Accumulate a micro-batch's mean loss and per-example metrics as sums over examples (``_n`` counts them)."""
    sums["loss"] = sums.get("loss", 0.0) + weight * float(loss.detach()) * n
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + weight * float(v.float().sum())
    sums["_n"] = sums.get("_n", 0.0) + weight * n


def evaluate(accelerator, model, task: TrainTask, ds, batch_size: int) -> dict[str, float]:
    """Mean loss and metrics over a split, every example counted once across processes."""
    import torch

    if ds is None or ds.num_rows == 0:
        return {}
    model.eval()
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
    totals = reduce_sums(accelerator, sums)
    n = totals.pop("_n")
    return {k: v / n for k, v in totals.items()} if n else {}


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
    seconds: float


@dataclass
class Setup:
    """A prepared model, optimizer and schedule (``prepare``), ready for ``train``."""

    model: Any
    optimizer: Any
    scheduler: Any
    steps_per_epoch: int
    total_steps: int
    global_size: int


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
    steps_per_epoch = num_train_rows // global_size
    total_steps = config.max_steps or steps_per_epoch * config.epochs
    warmup = int(config.warmup_ratio * total_steps)
    torch.manual_seed(config.seed)
    groups: dict[tuple[float, float], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            shape = getattr(p, "ds_shape", p.shape)  # under zero.Init a parameter is an empty 1-D shard
            decay = 0.0 if len(shape) < 2 or "norm" in name.lower() else config.weight_decay
            lr = learning_rate(name) if learning_rate is not None else config.learning_rate
            groups.setdefault((decay, lr), []).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": ps, "weight_decay": decay, "lr": lr} for (decay, lr), ps in groups.items()],
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    # Built on the prepared optimizer (DeepSpeed regroups the parameters) and stepped by hand once per optimizer
    # step: a scheduler given to accelerate.prepare would be stepped once per process.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, total_steps))
    accelerator.register_for_checkpointing(scheduler)
    return Setup(model, optimizer, scheduler, steps_per_epoch, total_steps, global_size)


def train(
    config: TrainOptions,
    accelerator,
    setup: Setup,
    tokenizer,
    task: TrainTask,
    train_ds,
    eval_ds,
    *,
    train_names: Callable[[dict[str, float]], dict[str, float]] = lambda m: m,
    eval_names: Callable[[dict[str, float]], dict[str, float]] = lambda m: m,
) -> TrainResult:
    """Run the optimisation; save checkpoints and the final model into ``config.output``.

    ``train_names`` / ``eval_names`` map the task's metric names (``loss``, ``accuracy``, ...) to logged names.
    """
    from tqdm.auto import tqdm

    model, optimizer, scheduler = setup.model, setup.optimizer, setup.scheduler
    output = Path(config.output).expanduser()
    world, rank = accelerator.num_processes, accelerator.process_index
    lengths = task.lengths(train_ds)
    output.mkdir(parents=True, exist_ok=True)
    model.train()

    step = 0
    checkpoint = latest_checkpoint(output) if config.resume else None
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint / "state"))
        step = json.loads((checkpoint / TRAINER_STATE).read_text())["step"]
        accelerator.print(f"resuming from {checkpoint} (step {step})")
    if config.report_to != "none":
        accelerator.init_trackers("runs", config={k: v for k, v in vars(config).items() if v is not None})
    metrics = Metrics(accelerator, output, step)
    baseline = evaluate(accelerator, model, task, eval_ds, config.eval_batch_size) if step == 0 else {}
    if baseline:  # the test split before any update
        metrics.log(0, eval_names(baseline))

    totals_so_far = json.loads((checkpoint / TRAINER_STATE).read_text()) if checkpoint is not None else {}
    first_loss = last_loss = totals_so_far.get("first_loss")
    real_tokens = totals_so_far.get("real_tokens", 0)
    all_tokens = totals_so_far.get("all_tokens", 0)
    started = time.time() - totals_so_far.get("seconds", 0.0)
    total_steps = setup.total_steps
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=quiet(accelerator))
    while step < total_steps:
        epoch, position = divmod(step, setup.steps_per_epoch)
        batch_ids = global_batches(train_ds.num_rows, setup.global_size, config.seed, epoch)[position]
        t0 = time.time()
        sums: dict[str, float] = {}
        for ids in micro_batches(batch_ids, lengths, config.batch_size, world, config.gradient_accumulation_steps, rank):
            batch = task.collate(train_ds.select(ids).to_list())
            with accelerator.accumulate(model), accelerator.autocast():
                # autocast by hand: logprobs calls the decoder and LM head directly, not model.forward
                loss, per_example, (real, total) = task.loss(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                    if grad_norm is not None:
                        sums["grad_norm"] = float(grad_norm) / world  # the same value on every process
                optimizer.step()
                optimizer.zero_grad()
            add_to_sums(sums, loss, per_example, len(ids))
            sums["_real"] = sums.get("_real", 0.0) + real
            sums["_total"] = sums.get("_total", 0.0) + total
        scheduler.step()
        step += 1
        bar.update(1)
        totals = reduce_sums(accelerator, sums)
        n, real, total = totals.pop("_n"), totals.pop("_real"), totals.pop("_total")
        real_tokens += int(real)
        all_tokens += int(total)
        step_loss = totals["loss"] / n
        first_loss = step_loss if first_loss is None else first_loss
        last_loss = step_loss
        if step % config.logging_steps == 0 or step == total_steps:
            values = train_names({k: v / n for k, v in totals.items() if k != "grad_norm"})
            if "grad_norm" in totals:
                values["grad_norm"] = totals["grad_norm"]
            values["lr"] = scheduler.get_last_lr()[0]
            values["epoch"] = step / setup.steps_per_epoch
            values["throughput/tokens_per_s"] = real / max(time.time() - t0, 1e-9)
            values["throughput/real_token_fraction"] = real / max(total, 1)
            metrics.log(step, values)
            bar.set_postfix(loss=f"{step_loss:.4f}")
        if config.eval_every and step % config.eval_every == 0 and step < total_steps:
            metrics.log(step, eval_names(evaluate(accelerator, model, task, eval_ds, config.eval_batch_size)))
        if config.save_every and step % config.save_every == 0 and step < total_steps:
            state = {"step": step, "epoch": epoch, "first_loss": first_loss, "real_tokens": real_tokens,
                     "all_tokens": all_tokens, "seconds": time.time() - started}
            save_checkpoint(accelerator, model, tokenizer, output, state)
    bar.close()

    final_eval = evaluate(accelerator, model, task, eval_ds, config.eval_batch_size)
    if final_eval:
        metrics.log(step, eval_names(final_eval))
    accelerator.wait_for_everyone()
    save_model(accelerator, model, tokenizer, output)
    accelerator.wait_for_everyone()
    if config.report_to != "none":
        accelerator.end_training()
    return TrainResult(step, first_loss, last_loss, final_eval, real_tokens, all_tokens, time.time() - started)


SOURCE_ROW = "_source_row"  # a row's index in the data as given, kept through the train/test split for error messages


def train_test_splits(ref, test_size: float, seed: int):
    """The ``train`` and ``test`` splits of a training dataset. A source without a ``test`` split (a JSONL file, say)
    has one split off with a seeded ``test_size`` (a row count, or a fraction below 1); 0 means no evaluation."""
    import datasets

    from rlhf_pipeline.datasets_io import load_dataset_dict
    from rlhf_pipeline.selection import split_indices

    dd = load_dataset_dict(ref)
    if "test" in dd and "train" in dd:
        return datasets.DatasetDict({"train": dd["train"], "test": dd["test"]})
    if len(dd) != 1 and "train" not in dd:
        raise PipelineError(f"{ref}: has splits {', '.join(dd)} but no 'train'; choose one as {ref}:SPLIT")
    ds = dd["train"] if "train" in dd else next(iter(dd.values()))
    if not test_size:
        return datasets.DatasetDict({"train": ds})
    try:
        train_rows, test_rows = split_indices(ds.num_rows, test_size, seed)
    except ValueError as e:
        raise PipelineError(f"{ref}: {e}; pass another --test-size") from None
    ds = ds.add_column(SOURCE_ROW, list(range(ds.num_rows)))
    return datasets.DatasetDict({"train": ds.select(train_rows), "test": ds.select(test_rows)})


def encode_splits(dd, encode: Callable[[dict, list], dict], max_length: int):
    """Tokenize every split with the batched ``encode(batch, row_indices)``, which must add a ``num_tokens`` column,
    and drop the rows over ``max_length``. Returns the splits and the dropped counts (``{"train:too_long": n}``)."""
    def encode_rows(batch: dict, indices: list) -> dict:  # errors name the row of the file, not of the split
        return encode(batch, batch[SOURCE_ROW] if SOURCE_ROW in batch else indices)

    out, dropped = {}, {}
    for split, ds in dd.items():
        encoded = ds.map(encode_rows, batched=True, with_indices=True, remove_columns=ds.column_names,
                         desc=f"tokenize {split}")
        kept = encoded.filter(lambda n: n <= max_length, input_columns="num_tokens")
        if encoded.num_rows - kept.num_rows:
            dropped[f"{split}:too_long"] = encoded.num_rows - kept.num_rows
        out[split] = kept
    return out, dropped


@dataclass
class StageRun:
    """What a training stage's body hands back to :func:`run_training_stage` for the manifest."""

    result: TrainResult
    rows_in: int
    extra: dict[str, Any]
    summary: str  # one line for the console
    dropped: Optional[dict[str, int]] = None


def run_training_stage(stage: str, config: TrainOptions, inputs: list, body: Callable[[Any, Any], StageRun]) -> Path:
    """The frame every training stage shares: skip a finished run, refuse or resume an unfinished one, build the
    accelerator, run ``body(accelerator, stage_output)``, then (main process) push and write the manifest that
    marks the run complete. The process group is destroyed on the way out, whatever happens."""
    from rlhf_pipeline.datasets_io import StageOutput

    try:
        out = StageOutput(stage, config, inputs=inputs)
        accelerator = make_accelerator(config)
        finished = out.done(resume=config.resume)
        accelerator.wait_for_everyone()  # every process has looked before the main process changes anything
        if finished:
            return out.path
        if accelerator.is_main_process:
            if out.replace:  # --overwrite of another run
                shutil.rmtree(out.path)
            out.record_start()
        accelerator.wait_for_everyone()
        run = body(accelerator, out)

        def finish() -> None:
            manifest = out.manifest(rows_in=run.rows_in, rows_out=run.result.steps, dropped=run.dropped,
                                    extra=run.extra)
            if config.push_to_hub:  # before the manifest: a failed upload leaves the run unfinished, to be rerun
                push_model_to_hub(out.path, config.push_to_hub)
            out.write_manifest(manifest)
            print(f"[{stage}] {run.summary}; model in {out.path}")

        on_main_process(accelerator, finish)
        return out.path
    finally:
        finish_distributed()


def training_summary(result: TrainResult) -> dict[str, Any]:
    """The manifest's record of a training run."""
    return {
        "steps": result.steps,
        "loss_first_step": result.first_loss,
        "loss_last_step": result.last_loss,
        "eval": result.final_eval,
        "real_token_fraction": result.real_tokens / max(result.all_tokens, 1),
        "seconds": round(result.seconds, 2),
    }


def push_model_to_hub(output: Path, repo_id: str) -> None:
    """Upload the final model (not the checkpoints, logs, cached reference log-probs or PPO rollout). The token comes from the
    environment (HF_TOKEN), read by huggingface_hub."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(
        folder_path=str(output),
        repo_id=repo_id,
        repo_type="model",
        ignore_patterns=[f"{CHECKPOINTS}/*", "runs/*", "ref_logps/*", "rollout/*"],
    )
    print(f"pushed to https://huggingface.co/{repo_id}")


def finish_distributed() -> None:
    """Destroy the process group before exit (a CPU gloo group otherwise aborts the process at teardown)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
