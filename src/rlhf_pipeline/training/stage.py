"""The frame every training stage (``rlhf sft``, ``rlhf train-rm``, ``rlhf train``) shares around the loop of
``rlhf_pipeline.training.loop``: the run's output directory, the accelerator, the manifest and the Hub upload; and the
data preparation the stages share (train/test splits, tokenizing with a length limit).

A stage's ``main`` (or an algorithm family's recipe) reads top to bottom::

    check_model_ref("--model", config.model)
    ref = parse_ref(config.data)

    def read(run) -> TrainingJob:  # load and check the data (nothing is written yet)
        ...
        return TrainingJob(tokenizer, num_examples, task=..., record=...)

    return run_training("sft", config, [ref], read)

:func:`run_training` is the one skeleton: inside :func:`training_run` it reads, loads the model, calls
``run.start()``, prepares, asks the job for its task (after a reference pass, say), trains, and ends with
``run.finish(job.record(run, result))``.

On entry :func:`training_run` checks the output (a finished run with the same config and inputs is not redone; an
unfinished one is refused, or continued with ``--resume``, or replaced with ``--overwrite``) and builds the
accelerator; it writes nothing. :meth:`TrainingRun.start` makes the output directory and records the run's config
and inputs (what ``--resume`` compares), once the stage has read and checked its data and loaded its model, so a
mistake in the inputs leaves no output behind; :meth:`TrainingRun.finish` pushes the model to the Hub when asked and
writes the manifest that marks the run complete. Whatever happens, the process group is destroyed on the way out.
An error or Ctrl-C between ``start`` and ``finish`` leaves no manifest: the output stays unfinished, to be resumed
or redone.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from rlhf_pipeline.training.checkpoints import list_checkpoints, remove_checkpoints, remove_leftover_checkpoints
from rlhf_pipeline.distributed import (
    anywhere, cpu_deepspeed_backend, finish_distributed, on_main_process, training_collective_timeout,
)
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.layout import CHECKPOINTS, MANIFEST, REF_LOGPS_CACHE, ROLLOUT_CACHE, TRACKER_DIR
from rlhf_pipeline.modeling import SAFE_WEIGHTS, same_model

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from rlhf_pipeline.datasets_io import HubTarget, StageOutput
    from rlhf_pipeline.training.loop import TrainOptions, TrainResult

SOURCE_ROW = "_source_row"  # a row's index in the data as given, kept through the train/test split for error messages


# ----------------------------------------------------------------------------------------------------------------
# The run


@dataclass
class StageRun:
    """What a training stage hands to :meth:`TrainingRun.finish` for the manifest."""

    result: TrainResult
    rows_in: int
    extra: dict[str, Any]
    summary: str  # one line for the console
    dropped: Optional[dict[str, int]] = None


@dataclass
class TrainingRun:
    """One run of a training stage, as :func:`training_run` yields it."""

    output: StageOutput
    accelerator: Any
    finished: bool  # the output already holds this run (same config and inputs): nothing to do
    started: bool = False  # :meth:`start` made the output directory
    completed: bool = False  # :meth:`finish` wrote the manifest

    @property
    def path(self) -> Path:
        return self.output.path

    def start(self) -> None:
        """The inputs are read and checked: make the output directory (the main process; ``--overwrite`` of another
        run removes that first) and record this run's config and inputs in it, which ``--resume`` compares."""
        out, accelerator = self.output, self.accelerator
        if accelerator.is_main_process:
            if out.replace:  # --overwrite of another run
                shutil.rmtree(out.path)
            out.record_start()
        accelerator.wait_for_everyone()
        self.started = True

    def finish(self, run: StageRun) -> None:
        """Mark the run complete (main process): write the manifest, delete the checkpoints unless
        ``--keep-checkpoints`` and say so on the console; the model is pushed when ``--push-to-hub`` asks, by
        :func:`training_run` once the process group is gone."""
        if not self.started:
            raise RuntimeError(f"{self.output.stage}: run.finish(...) before run.start(); the run has no output")
        out = self.output

        def write() -> None:
            keep = out.config.keep_checkpoints
            checkpoints = [str(p.relative_to(out.path)) for p in list_checkpoints(out.path)] if keep else []
            manifest = out.manifest(rows_in=run.rows_in, rows_out=run.result.steps, dropped=run.dropped,
                                    extra={**run.extra, "checkpoints": checkpoints})
            out.write_manifest(manifest)  # the run is complete: its checkpoints are no longer needed to resume it
            if not keep:
                remove_checkpoints(out.path)
            print(f"[{out.stage}] {run.summary}; model in {out.path}")
            if out.push_pending(manifest):  # uploaded once the other processes are gone (training_run)
                out.pending_push = manifest

        on_main_process(self.accelerator, write)
        self.completed = True


def make_accelerator(config: TrainOptions):
    """The Accelerator of a training run, with DeepSpeed's batch sizes and clipping set from ``config``. A collective
    waits ``training_collective_timeout()`` (30 minutes) for the other processes, so that a hung one stops the run
    within it rather than holding every GPU for hours; the long work of the main process alone (the Hub upload) runs
    after the process group is gone.

    Precision is ``--bf16``'s, recorded in the manifest: the Accelerator is given it, which overrides what the
    launcher's config asks for. A launcher asking for mixed precision (``mixed_precision: bf16`` in
    accelerate_cfgs/zero3.yaml) of a run without ``--bf16`` is refused rather than trained in float32 unannounced."""
    import os

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()  # set by accelerate launch
    if launcher != "no" and not config.bf16:
        fix = ("add --bf16 to the stage's options" if launcher == "bf16"
               else "the trainers run bfloat16 (--bf16) or float32: add --bf16")
        raise PipelineError(
            f"accelerate launch asks for {launcher} mixed precision (its config's mixed_precision, or "
            f"--mixed_precision), but this run has no --bf16 and would train in float32: {fix}, or launch with "
            "mixed_precision 'no' to train in float32"
        )
    cpu_deepspeed_backend()
    accelerator = Accelerator(
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        mixed_precision="bf16" if config.bf16 else "no",
        log_with=None if config.report_to == "none" else config.report_to,
        project_dir=str(Path(config.output).expanduser()),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=training_collective_timeout())],
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


@contextlib.contextmanager
def training_run(stage: str, config: TrainOptions, inputs: list) -> Iterator[TrainingRun]:
    """Enter a training stage's run: skip a finished output (``run.finished``), refuse or resume an unfinished one,
    build the accelerator; nothing is written until the body calls ``run.start()``, once its inputs are read and
    checked. The body ends with ``run.finish(StageRun(...))``; the process group is destroyed on the way out,
    whatever happens."""
    from rlhf_pipeline.datasets_io import StageOutput

    try:
        out = StageOutput(stage, config, inputs=inputs, pusher=push_model_to_hub)
        accelerator = make_accelerator(config)
        finished = out.done(resume=config.resume, push_later=True)
        accelerator.wait_for_everyone()  # every process has looked before the main process changes anything
        if finished:
            on_main_process(accelerator, lambda: remove_leftover_checkpoints(out.path))
        run = TrainingRun(out, accelerator, finished)
        yield run
        if not (run.finished or run.completed):
            raise RuntimeError(f"{stage}: the training run ended without run.finish(...); it has no manifest")
        # every process is done before any tears its group down (a gloo group destroyed under a process still
        # talking to it can abort that process); on an error the others may never come, so only on success
        accelerator.wait_for_everyone()
    finally:
        finish_distributed()
    # The upload (16 GB at 8B) by the main process alone, no other process waiting for it in a collective: a failed
    # upload is one line, the run stays finished and the push pending for a rerun
    if out.pending_push is not None:
        out.push(out.pending_push)


def training_summary(result: TrainResult) -> dict[str, Any]:
    """The manifest's record of a training run."""
    return {
        "steps": result.steps,
        "loss_first_step": result.first_loss,
        "loss_last_step": result.last_loss,
        "eval": result.final_eval,
        "real_token_fraction": result.real_tokens / max(result.all_tokens, 1),
        "skipped_steps": result.skipped_steps,
        "seconds": round(result.seconds, 2),
        "resumed_from_step": result.resumed_from_step,
        "rows_left_out_per_epoch": result.rows_left_per_epoch,  # past the epoch's last full global batch
    }


def training_record(name: str, result: TrainResult, dd, sampling: dict | None, training: dict[str, Any],
                    model: str, summary: str | None = None) -> StageRun:
    """The record of a ``rlhf train`` run of ``model`` on its splits ``dd``: the sampling settings of its data and
    the training record, with who sampled the data (``training.sampler``: its model, and whether it is the policy
    trained here; not where an overlapped iteration trains on the samples of the policy one behind), in the
    manifest; one line on the console (``summary``, else steps and loss)."""
    sampler = (sampling or {}).get("model")
    if sampler is not None:
        training = {**training, "sampler": {"model": sampler, "is_trained_policy": same_model(sampler, model)}}
    return StageRun(
        result=result,
        rows_in=sum(ds.num_rows for ds in dd.values()),
        extra={"sampling": sampling, "training": training},
        summary=summary or (f"{name}: {result.steps} step{'s' if result.steps != 1 else ''}, "
                            f"loss {result.first_loss:.4f} -> {result.last_loss:.4f}"),
    )


# Files of a model repo's branch that a push leaves as they are (huggingface_hub keeps .gitattributes itself).
KEPT_ON_HUB = ("README.md", ".gitattributes")


def push_model_to_hub(output: Path, hub: HubTarget, manifest: bytes) -> None:
    """Upload the final model and its manifest (not the checkpoints, logs, cached reference log-probs or PPO rollout)
    to a model repo: its main branch, or the branch ``hub.config`` (``--hub-config``; rlhf iterate gives each
    iteration's policy its own, ``iter<t>-train``). The token comes from the environment (HF_TOKEN), read by
    huggingface_hub.

    A push replaces the branch's files (its ``README.md`` and ``.gitattributes`` aside): a model pushed there before
    leaves nothing behind, such as a single ``model.safetensors`` beside new shards (which transformers would load
    instead of them) or an ``adapter_config.json`` beside a full model. The deletions go with the upload's first
    commit (huggingface_hub may split a large upload into several), the old manifest among them, and the new
    manifest comes last: a branch caught midway has no manifest, never an old one beside new weights."""
    import glob

    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(hub.repo_id, repo_type="model", private=hub.private or None, exist_ok=True)
    revision = {}
    if hub.config:
        api.create_branch(hub.repo_id, branch=hub.config, repo_type="model", exist_ok=True)
        revision = {"revision": hub.config}
    present = api.list_repo_files(hub.repo_id, repo_type="model", **revision)
    api.upload_folder(
        folder_path=str(output),
        repo_id=hub.repo_id,
        repo_type="model",
        ignore_patterns=[f"{CHECKPOINTS}/*", f"{TRACKER_DIR}/*", f"{REF_LOGPS_CACHE}/*", f"{ROLLOUT_CACHE}/*",
                         MANIFEST],
        # exact names (escaped: a pattern here is fnmatch's), so a model card the user wrote stays
        delete_patterns=[glob.escape(name) for name in present if name not in KEPT_ON_HUB] or None,
        **revision,
    )
    api.upload_file(path_or_fileobj=manifest, path_in_repo=MANIFEST, repo_id=hub.repo_id, repo_type="model",
                    **revision)


# ----------------------------------------------------------------------------------------------------------------
# The data


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


def cached_splits(accelerator, cache: Path, compute: Callable[[], Any]):
    """A resumable run's expensive pass over its data (reference log-probs, PPO's rollout): the splits that an
    interrupted run of this output kept in ``cache``, else ``compute()``'s, kept there (atomically, by the main
    process) before anything trains on them. The kept splits are read only when every process sees them: the pass
    holds collectives, which a process that alone ran it (a shared disk not yet in sync) would wait in forever."""
    from datasets import load_from_disk

    from rlhf_pipeline.datasets_io import atomic_directory

    if not anywhere(accelerator, not (cache / "dataset_dict.json").exists()):
        return load_from_disk(str(cache))
    dd = compute()
    if accelerator.is_main_process:
        with atomic_directory(cache) as tmp:
            dd.save_to_disk(str(tmp))
    accelerator.wait_for_everyone()
    return dd


# ----------------------------------------------------------------------------------------------------------------
# The skeleton every training stage runs


@dataclass
class TrainingJob:
    """What a training stage has once it has read and checked its inputs (nothing is written yet): what the
    skeleton (:func:`run_training`) needs to load the model, train and record the run."""

    tokenizer: Any
    num_examples: int  # what one epoch counts (rows; PPO's samples), for the schedule
    # after run.start() and prepare(): (the loss task, the train rows, the test rows or None), e.g. after a reference
    # pass over the data with the prepared model
    task: Callable[[TrainingRun, Any], tuple[Any, Any, Any]]
    record: Callable[[TrainingRun, TrainResult], StageRun]  # the manifest's record (and anything saved beside it)
    loader: Optional[Callable[..., Any]] = None  # (path, trust_remote_code, **kwargs) -> model; a causal LM by default
    model_ready: Optional[Callable[[Any], None]] = None  # called on the loaded (and adapted) model, before start
    learning_rate: Optional[Callable[[str], float]] = None  # a parameter's own peak rate (PPO's critic)
    data: Optional[dict] = None  # the splits read, when they hold token ids: checked against the model's vocabulary


def run_training(stage: str, config: TrainOptions, inputs: list, read: Callable[[TrainingRun], TrainingJob]) -> Path:
    """The one skeleton of ``rlhf train`` (every family), ``rlhf sft`` and ``rlhf train-rm``, once the stage has
    checked ``--model`` and parsed its ``inputs`` (in that order, as every stage reports them): enter the run (a
    finished output is returned as it is), ``read(run)`` the inputs, load the model, make the output directory,
    prepare, train, and mark the run complete with the job's record."""
    from rlhf_pipeline.training.compilation import check_compile, compile_errors, require_decoder_layers
    from rlhf_pipeline.training.loop import load_trainable, prepare, train

    with training_run(stage, config, inputs) as run:
        if run.finished:
            return run.path
        if config.compile:  # before any work
            check_compile(run.accelerator.state.deepspeed_plugin is not None)
        job = read(run)
        if job.data is not None:
            check_tokenizer(job.tokenizer, config.data, config.model)  # before the model loads
            if stage == "train":  # sft and train-rm set the template they render with themselves (--chat-template)
                adopt_data_template(job.tokenizer, config.data, config.model)
        model = load_trainable(config, job.loader or causal_lm)
        if job.model_ready is not None:
            job.model_ready(model)
        if config.compile:
            require_decoder_layers(model, config.model)
        if job.data is not None:
            check_vocabulary(job.data, model, job.tokenizer, config.data, config.model)
        run.start()  # the data and the model are read and checked: now the output directory is made
        setup = prepare(config, run.accelerator, model, job.num_examples, learning_rate=job.learning_rate)
        with compile_errors(config.compile):  # compiled lazily, by the first forwards
            task, train_rows, test_rows = job.task(run, setup)
            result = train(config, run.accelerator, setup, job.tokenizer, task, train_rows, test_rows)
        run.finish(job.record(run, result))
    return run.path


def data_fix(model_name: str) -> str:
    """What to do about data tokenized for another model than ``model_name``."""
    return (f"make it again with this model's tokenizer (rlhf filter --tokenizer {model_name}), or use the model it "
            "was made for")


def check_tokenizer(tokenizer: Any, source: str, model_name: str) -> None:
    """The token ids of ``source`` mean to ``tokenizer`` what they meant to the tokenizer that made them (the probe
    its manifest recorded, ``chat.check_same_tokenizer``); checked before the model is loaded."""
    from rlhf_pipeline.chat import TOKENIZER_PROBE_KEY, check_same_tokenizer
    from rlhf_pipeline.datasets_io import find_in_lineage, parse_ref

    check_same_tokenizer(find_in_lineage([parse_ref(source)], TOKENIZER_PROBE_KEY), tokenizer, source,
                         f"{model_name}'s tokenizer", data_fix(model_name))


def adopt_data_template(tokenizer: Any, source: str, model_name: str):
    """``rlhf train`` (and ``rlhf sft`` on sampled ids): the trained policy's tokenizer renders as its data was
    rendered. A chat template the sampling chose by name (``--chat-template`` zephyr, a file, none: the lineage's
    ``sampling.chat_template``) is set on the tokenizer that is saved with the model, so the next ``rlhf generate``
    or a server renders with it, not with ``--model``'s own; the ``ChatTemplate`` set is returned. Data rendered with
    the sampling tokenizer's own template needs nothing (None)."""
    from rlhf_pipeline.chat import read_chat_template, recorded_chat_template, use_chat_template
    from rlhf_pipeline.datasets_io import find_in_lineage, parse_ref

    sampling = find_in_lineage([parse_ref(source)], "sampling") or {}
    record = sampling.get("chat_template")
    value = recorded_chat_template(record)
    if value is None:
        return None
    now = read_chat_template(value).sha
    if now != record.get("sha256"):  # a template file edited since the sampling
        log.warning("%s was rendered with the chat template %s (sha256 %s), which reads otherwise now (sha256 %s): "
                    "the trained model keeps %s's template", source, value, record.get("sha256"), now, model_name)
        return None
    return use_chat_template(tokenizer, value, model_name, required=False)


def check_vocabulary(data: dict, model: Any, tokenizer: Any, source: str, model_name: str) -> None:
    """Every token id of every split within the vocabulary of the model (its input embedding's rows, and the
    tokenizer's ids): data tokenized for another model fails here, naming the row, before anything is written."""
    from rlhf_pipeline.contracts import require_token_ids

    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    vocab_size = min(len(tokenizer), rows) if rows else len(tokenizer)
    for split, ds in data.items():
        require_token_ids(ds, vocab_size, f"{source}:{split}",
                          f"the data was tokenized for another model: {data_fix(model_name)}")


def causal_lm(path: str, trust_remote_code: bool = False, **kwargs):
    """The policy a training stage loads (``load_trainable``'s default loader): a causal LM from safetensors."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs, **SAFE_WEIGHTS)
