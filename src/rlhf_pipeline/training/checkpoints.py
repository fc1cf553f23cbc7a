"""What a training run saves: the final model and the resumable checkpoints.

Output directory of a training stage::

    OUTPUT/                  the final model (save_pretrained, safetensors) + tokenizer: vLLM and from_pretrained load it
    OUTPUT/manifest.json     written last: the run completed (rlhf_pipeline.training.stage)
    OUTPUT/metrics.jsonl     one JSON object per logged step ({"step", "loss/train", ...}); TensorBoard in OUTPUT/runs
    OUTPUT/checkpoints/step_N/   a save_pretrained model + state/ (optimizer, scheduler, RNG) + trainer_state.json

Checkpoints are written to a temporary name (``step_N.tmp``), flushed to the disk and sealed with ``files.json`` (every
file and its size, ``rlhf_pipeline.files.seal``), then renamed: a kill at any point leaves at most one ``.tmp``, never
taken for complete and removed by the next save. ``--resume`` continues from the newest checkpoint that is whole (its
files as sealed, each readable: ``rlhf_pipeline.files.verify``) and loads; a damaged one is named in a warning and set
aside as ``step_N.damaged`` (kept, never deleted), and the run goes on from the one before. ``--save-total-limit N``
keeps the newest N (default 2, 0 = all; older ones are deleted only after a newer one is complete). A finished run
deletes its complete checkpoints once its final model and manifest are written (:func:`remove_checkpoints`), unless
``--keep-checkpoints``; the manifest lists the checkpoints that remain.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from rlhf_pipeline.training import lora
from rlhf_pipeline.distributed import (
    anywhere, on_main_process, outside_zero3_init, stop_everywhere, unwrap, zero_stage,
)
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.files import first_line, flush_files, seal, verify, writing
from rlhf_pipeline.layout import CHECKPOINTS, MANIFEST
from rlhf_pipeline.training.master_weights import MasterWeights

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
DAMAGED = ".damaged"  # the suffix of a checkpoint that --resume found damaged and set aside


def save_model(accelerator, model, tokenizer, path: Path, masters: MasterWeights | None = None) -> None:
    """A full save_pretrained directory (safetensors); under ZeRO-3 the shards are gathered first. With LoRA, the
    merged model and the adapters (``rlhf_pipeline.training.lora``). With ``masters`` (``--bf16-weights``), the
    trained weights are theirs, in float32."""
    state_dict = accelerator.get_state_dict(model)  # collective under ZeRO-3: every process calls it
    if masters is not None:
        state_dict = masters.state_dict(state_dict)

    def write() -> None:
        inner = unwrap(model)
        if lora.parts(inner):  # LoRA: the merged model, what the next stage loads, and the adapters beside it
            lora.save_merged(inner, path, state_dict)
        else:
            inner.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
            if masters is not None:
                # save_pretrained writes config.json's dtype from the bf16 model, not from the float32 masters it
                # saved: a loader that reads it (dtype="auto") would round them back to bf16
                cast_as, inner.config.dtype = inner.config.dtype, "float32"
                try:
                    inner.config.save_pretrained(path)
                finally:
                    inner.config.dtype = cast_as
        tokenizer.save_pretrained(path)

    # QLoRA's merge loads the starting model again, on the main process alone: whole, not inside ZeRO-3's
    # partitioning, whose collectives the other processes would never join
    with outside_zero3_init(accelerator):
        on_main_process(accelerator, write)


def save_checkpoint(accelerator, model, tokenizer, output: Path, state: dict[str, Any],
                    keep: int | None = None, masters: MasterWeights | None = None) -> Path:
    """Model + resumable state at ``output/checkpoints/step_N``, renamed into place once complete; then, with
    ``keep``, only the newest ``keep`` complete checkpoints remain (the new one among them). ``masters``
    (``--bf16-weights``) are saved beside the optimizer state."""
    final = output / CHECKPOINTS / f"step_{state['step']:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        _remove_unfinished(final.parent)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        with writing(output, needed=_size(latest_checkpoint(output)), what=f"the checkpoint of step {state['step']}",
                     again="run the same command again with --resume: it goes on from the newest checkpoint "
                     "(--save-total-limit N keeps only the newest N checkpoints, 2 by default)"):
            save_model(accelerator, model, tokenizer, tmp, masters)
            accelerator.save_state(str(tmp / "state"), **_state_options(accelerator, model)[0])
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                if masters is not None:
                    masters.save(tmp / "state")
                (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
                seal(tmp)
    except BaseException:
        if accelerator.is_main_process:  # free the space a failed save took; the checkpoints before it stay
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        if keep is not None:
            for old in list_checkpoints(output)[:-keep]:
                _remove(old)
    accelerator.wait_for_everyone()
    return final


def remove_checkpoints(output: Path) -> None:
    """A finished run's complete checkpoints, deleted (main process) once its final model is on the disk: its files
    are flushed first. They only serve to resume an unfinished run, and at 8B each is about 112 GB with its
    optimizer state (docs/full-size.md). Checkpoints set aside as damaged stay, as always."""
    flush_files(output)
    for old in list_checkpoints(output):
        _remove(old)
    root = output / CHECKPOINTS
    _remove_unfinished(root)
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()


def remove_leftover_checkpoints(output: Path) -> int:
    """The checkpoints of a finished run whose manifest keeps none, still there because the run was killed between
    writing its manifest and removing them (about 112 GB each at 8B): removed when the finished run is found again
    (by its stage, or by ``rlhf iterate``, which then launches nothing). Returns how many complete ones there were."""
    root = output / CHECKPOINTS
    if not root.is_dir() or json.loads((output / MANIFEST).read_text()).get("checkpoints") != []:
        return 0
    left = len(list_checkpoints(output))
    remove_checkpoints(output)
    if left:
        print(f"{output}: removed the {left} checkpoint{'s' if left != 1 else ''} its finished run left behind "
              "(stopped while removing them)", flush=True)
    return left


def _remove_unfinished(root: Path) -> None:
    """The ``step_N.tmp`` directories under ``root``: what a killed save or removal left."""
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _remove(checkpoint: Path) -> None:
    # out of the listing in one rename first: a kill midway leaves a .tmp that the next save removes, not a step_N
    # that is half deleted (or, its trainer state gone first, never listed and never removed)
    doomed = checkpoint.with_name(checkpoint.name + ".tmp")
    os.rename(checkpoint, doomed)
    shutil.rmtree(doomed)


def load_checkpoint(accelerator, model, checkpoint: Path, masters: MasterWeights | None = None) -> dict[str, Any]:
    """Restore the weights (and ``masters``), optimizer and RNG state that :func:`save_checkpoint` saved; returns its
    trainer state (``step``, ``epoch``, ``processes``, ``first_loss``, ``first_grad_norm`` and ``divergence_warned``
    for the divergence warning, ``real_tokens``, ``all_tokens``, ``seconds``). The learning-rate scheduler is set
    from the step (``loop.scheduler_at``)."""
    with _without_pickled_objects(checkpoint / "state") as state:
        accelerator.load_state(str(state), **_state_options(accelerator, model)[1])
    if masters is not None:
        masters.load(checkpoint / "state")
    return json.loads((checkpoint / TRAINER_STATE).read_text())


@contextlib.contextmanager
def _without_pickled_objects(state: Path) -> Iterator[Path]:
    """``state``, or, when it holds the pickled scheduler that checkpoints of earlier versions carry
    (``custom_checkpoint_0.pkl``, which accelerate loads with ``weights_only=False`` and which may run code), a
    directory of links to everything else in it: accelerate refuses a state whose custom objects are not all
    registered, and none is any more."""
    pickled = list(state.glob("custom_checkpoint_*.pkl"))
    if not pickled:
        yield state
        return
    links = Path(tempfile.mkdtemp(prefix="rlhf-state-"))
    try:
        for entry in state.iterdir():
            if entry not in pickled:
                (links / entry.name).symlink_to(entry.resolve())
        yield links
    finally:
        shutil.rmtree(links, ignore_errors=True)


def resume_checkpoint(accelerator, model, output: Path,
                      masters: MasterWeights | None = None) -> tuple[Path | None, dict[str, Any]]:
    """Load the newest checkpoint under ``output`` that is whole and loads; returns it and its trainer state, or
    ``(None, {})`` when there is none. A damaged one (``files.verify``) is named in a warning and set aside as
    ``step_N.damaged``; when checkpoints exist and none of them is whole, one error line says so. A whole one that
    does not load stops the run with one line and is left in place. Every process checks the same files and agrees
    on whether the load worked, so all of them resume from the same step."""
    checkpoints = list_checkpoints(output)
    _check_processes(accelerator, checkpoints)
    problems = []
    for checkpoint in reversed(checkpoints):
        problem, failure = verify(checkpoint), None
        if problem is None:
            try:
                state = load_checkpoint(accelerator, model, checkpoint, masters)
            except Exception as e:  # torch, safetensors and DeepSpeed each raise their own kinds
                failure = f"{type(e).__name__}: {first_line(e)}"
        if anywhere(accelerator, failure is not None):
            # Its files are whole (verify), so what failed is more likely the machine (memory, package versions)
            # than the checkpoint: setting it aside, and then every other one the same failure hits, would leave
            # nothing to resume from once that is fixed.
            raise stop_everywhere(accelerator, (
                f"--resume: {checkpoint} has all its files whole but did not load ({failure or 'on another process'}); "
                "it is left as it is, as are the checkpoints before it. Fix what changed (memory, package versions) "
                f"and resume again; if it is damaged, move it out of {output / CHECKPOINTS} and --resume goes on from "
                "the one before"))
        if not anywhere(accelerator, problem is not None):
            return checkpoint, state
        problem = problem or "its files are damaged on another process"
        problems.append(problem)
        aside = _unused(checkpoint.with_name(checkpoint.name + DAMAGED))
        if accelerator.is_main_process:
            log.warning("checkpoint %s is damaged: %s; set aside as %s, resuming from the one before", checkpoint,
                        problem, aside.name)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            os.rename(checkpoint, aside)
        accelerator.wait_for_everyone()
    if checkpoints:
        raise PipelineError(
            f"--resume: none of the {len(checkpoints)} checkpoint(s) under {output / CHECKPOINTS} loads (the newest: "
            f"{problems[0]}); they are kept as step_N{DAMAGED}; pass --overwrite to start the run over"
        )
    return None, {}


def _check_processes(accelerator, checkpoints: list[Path]) -> None:
    """Refuse, before any checkpoint loads, to resume on another number of processes than the run's: its global batch
    (``--batch-size`` x accumulation x processes), so its schedule and data order, would change, and a ZeRO
    checkpoint's optimizer shards would not load (each would then be set aside as damaged); or under another ZeRO
    stage (or with DeepSpeed against without), whose optimizer state is laid out otherwise. Every process reads the
    same file; the main process's error is the one line."""
    processes = accelerator.num_processes
    for checkpoint in reversed(checkpoints):
        try:
            state = {**_launch_by_files(checkpoint), **json.loads((checkpoint / TRAINER_STATE).read_text())}
            recorded = state.get("processes")
        except (OSError, ValueError, TypeError):
            continue  # a damaged one: verify() says so
        if "zero_stage" in state and not _same_layout(state["zero_stage"], zero_stage(accelerator)):
            def name(stage: int | str | None) -> str:
                return "no DeepSpeed" if stage is None else f"DeepSpeed ZeRO stage {stage}"

            raise stop_everywhere(
                accelerator,
                f"--resume: {checkpoint} was saved by a run under {name(state['zero_stage'])}, and this launch has "
                f"{name(zero_stage(accelerator))}: the optimizer's state would not load; resume it with the accelerate "
                "config it started with, or pass --overwrite to start over"
            )
        if recorded is None:  # from before the count was recorded
            return
        if recorded != processes:
            raise stop_everywhere(
                accelerator,
                f"--resume: {checkpoint} was saved by a run on {recorded} process{'es' * (recorded != 1)}, and this "
                f"launch has {processes}: the global batch and its schedule would change, and the optimizer's shards "
                f"would not load; resume it on {recorded}, or pass --overwrite to start over"
            )
        return


# What the files of a checkpoint saved under DeepSpeed below ZeRO-3 show of its stage: its optimizer state's files
# are named alike under ZeRO-0 (bf16) and ZeRO-1/2.
BELOW_ZERO3 = "0, 1 or 2"


def _launch_by_files(checkpoint: Path) -> dict[str, Any]:
    """The launch a checkpoint's files show, for one saved before its trainer state recorded it (``processes`` and
    ``zero_stage``; those recorded win): accelerate's ``random_states_N.pkl``, one per process, and DeepSpeed's model
    states, one per process under ZeRO-3 (``zero_pp_rank_N_mp_rank_00_model_states.pt``) and one in all below it
    (``mp_rank_00_model_states.pt``: :data:`BELOW_ZERO3`); none without DeepSpeed."""
    state = checkpoint / "state"
    found: dict[str, Any] = {}
    processes = len(list(state.glob("random_states_*.pkl")))
    if processes:
        found["processes"] = processes
    model_states = [p.name for p in state.glob("*/*model_states.pt")]
    if state.is_dir():
        found["zero_stage"] = (3 if any(name.startswith("zero_pp_rank_") for name in model_states)
                               else BELOW_ZERO3 if model_states else None)
    return found


def _same_layout(recorded: int | str | None, now: int | None) -> bool:
    """Whether the optimizer's state a checkpoint saved under ``recorded`` (a ZeRO stage, None without DeepSpeed, or
    :data:`BELOW_ZERO3`) loads under ``now``: stages 1 and 2 lay it out alike (partitioned optimizer state, whole
    weights), stage 3 and no DeepSpeed otherwise."""
    if recorded == BELOW_ZERO3:
        return now is not None and now != 3

    def layout(stage: int | None) -> int | None:
        return 2 if stage == 1 else stage

    return layout(recorded) == layout(now)


def _size(directory: Path | None) -> int | None:
    """The bytes a directory's files take (a checkpoint's: about what the next one needs)."""
    if directory is None:
        return None
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _unused(path: Path) -> Path:
    n = 1
    candidate = path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def _state_options(accelerator, model) -> tuple[dict[str, Any], dict[str, Any]]:
    """Options of ``accelerator.save_state`` and ``load_state``. With LoRA the resumable state holds only the weights
    that train (the adapters, a score head trained whole), not the frozen model, which a resumed run loads again
    from its starting point (for an 8B model, ``state/`` is megabytes instead of gigabytes beside the checkpoint's
    merged model; and QLoRA's 4-bit weights could not be loaded back as saved anyway)."""
    if not lora.parts(unwrap(model)):
        return {}, {}
    if accelerator.state.deepspeed_plugin is not None:
        return {"exclude_frozen_parameters": True}, {"load_module_strict": False}
    if not getattr(accelerator, "_rlhf_frozen_out", False):
        def drop_frozen(models, weights, output_dir):
            for m, state in zip(models, weights):
                trainable = {name for name, p in m.named_parameters() if p.requires_grad}
                for key in [k for k in state if k not in trainable]:
                    del state[key]

        accelerator.register_save_state_pre_hook(drop_frozen)
        accelerator._rlhf_frozen_out = True
    return {}, {"strict": False}


def list_checkpoints(output: Path) -> list[Path]:
    """The complete checkpoints under ``output``, oldest first (a ``.tmp`` one is still being written, a
    ``.damaged`` one was set aside by :func:`resume_checkpoint`)."""
    root = output / CHECKPOINTS
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if not p.suffix and (p / TRAINER_STATE).exists())


def latest_checkpoint(output: Path) -> Path | None:
    """The newest complete checkpoint under ``output``, or None."""
    done = list_checkpoints(output)
    return done[-1] if done else None
