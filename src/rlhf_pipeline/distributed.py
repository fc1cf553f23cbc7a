"""Running on one or many processes: the accelerator, inference shared over the processes, and the collectives the
training loop needs.

Inference stages (``rlhf score``, ``rlhf ref-logps``, ``rlhf eval``) run plain data parallelism under
``accelerate launch --num_processes N`` (``--multi_gpu``): every process holds the whole model, takes its share of
the length-sorted batches, and the main process gathers the results in the original order and writes the output
(:func:`inference_accelerator`, :func:`gather_guarded`); outside ``accelerate launch`` they run in one process, as
they always have.

The same code runs single-process on a CPU and under ``accelerate launch --config_file accelerate_cfgs/zero3.yaml``
on many GPUs (or, in the tests, ``accelerate_cfgs/cpu_zero3.yaml`` on CPUs with gloo). Under DeepSpeed ZeRO-3 every
forward is collective (each process holds a shard of the weights), so every process must run the same number of
forwards: that is why inference here hands each process the same number of batches, with stand-ins where it has
none left.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

from rlhf_pipeline.errors import FailedElsewhere, PipelineError, ProcessFailed, UserCodeError, one_line


def cpu_deepspeed_backend() -> None:
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


def finish_distributed() -> None:
    """Destroy the process group before exit (a CPU gloo group otherwise aborts the process at teardown)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def outside_zero3_init(accelerator) -> Iterator[None]:
    """Models loaded inside are whole on every process, not partitioned: for a frozen model beside a ZeRO-3 engine
    (``--ref-model``). Under a DeepSpeed stage-3 plugin accelerate registers its config with transformers whatever
    ``zero3_init_flag`` says, and ``from_pretrained`` then builds every model inside ``deepspeed.zero.Init``: each
    process would hold a 0-element share of each weight, which only an engine gathers (a forward outside one fails
    on the first weight). Elsewhere it changes nothing."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # as accelerate set it


def on_main_process(accelerator, fn: Callable[[], Any]) -> None:
    """Run ``fn`` on the main process only; if it fails, every process raises instead of waiting forever."""
    if accelerator is None:  # one process, without accelerate (an inference stage)
        fn()
        return
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
            raise FailedElsewhere(f"the main process failed: {flag[0]}")
    if error is not None:
        raise error


def zero_stage(accelerator) -> int | None:
    """The run's DeepSpeed ZeRO stage (0-3), or None without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else int(plugin.zero_stage)


def quiet(accelerator) -> bool:
    """Progress bars off on all but the main process, and everywhere when TQDM_DISABLE is set (an explicit
    ``disable=`` would otherwise override tqdm's own reading of it)."""
    from rlhf_pipeline.progress import bars_disabled

    return not accelerator.is_main_process or bars_disabled()


def unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


def anywhere(accelerator, flag: bool) -> bool:
    """Whether ``flag`` holds on any process of the run (every process gets the same answer)."""
    if accelerator.num_processes == 1:
        return flag
    import torch

    value = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return float(accelerator.reduce(value, reduction="sum").item()) > 0


def reduce_sums(accelerator, sums: dict[str, Any]) -> dict[str, float]:
    """Sum each value (a number, or a one-element tensor, on the device or not) over all processes, in float64.
    The tensors come to the host in one read, so values summed on the device over many forwards make it wait for
    the device once. Every process must pass the same keys."""
    import torch

    keys = sorted(sums)
    if not keys:
        return {}
    device = accelerator.device
    t = torch.stack([
        sums[k].detach().to(device, torch.float64).reshape(()) if torch.is_tensor(sums[k])
        else torch.tensor(float(sums[k]), dtype=torch.float64, device=device)
        for k in keys
    ])
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    return dict(zip(keys, t.tolist()))


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
    from tqdm.auto import tqdm

    batches = sharded_batches(lengths, batch_size, accelerator.num_processes, accelerator.process_index)

    def mine() -> list[tuple[int, Any]]:
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
        return results

    if accelerator.num_processes > 1 and any(hasattr(p, "ds_id") for p in list(model.parameters())[:1]):
        # ZeRO-3: every forward gathers weights from all processes, so a process that failed midway and went to
        # the guarded gather would meet the others inside a forward (a hang, or another collective's data): it
        # raises at once instead, and the launcher stops the others
        from accelerate.utils import gather_object

        parts = gather_object([mine()])
    else:
        # a process that fails tells the others at the gather, so they fail with it instead of waiting there
        parts = gather_guarded(accelerator, mine)
    results = [pair for part in parts for pair in part]
    out: list[Any] = [None] * len(lengths)
    for i, value in results:
        out[i] = value
    return out


# How long a process waits for the others at a collective (the default is 10 minutes with NCCL, 30 with gloo): the
# other processes of an inference stage wait while the main one writes the output, or, in rlhf eval, samples. A
# process that dies is noticed by the launcher (torchrun stops the others), not by this timeout.
COLLECTIVE_TIMEOUT = timedelta(hours=6)
# A training stage's: its processes work in step (the main process alone writes a checkpoint's model, minutes at 8B,
# and uploads only after the group is gone), so a collective that waits longer than this is a hang, which would
# otherwise hold every GPU for COLLECTIVE_TIMEOUT. As TRL's default (TrainingArguments.ddp_timeout, 1800 s);
# RLHF_TRAINING_TIMEOUT_MINUTES sets another (storage slow enough that the main process writes longer).
TRAINING_TIMEOUT_VARIABLE = "RLHF_TRAINING_TIMEOUT_MINUTES"
TRAINING_COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def training_collective_timeout() -> timedelta:
    """:data:`TRAINING_COLLECTIVE_TIMEOUT`, or the minutes ``RLHF_TRAINING_TIMEOUT_MINUTES`` gives."""
    value = os.environ.get(TRAINING_TIMEOUT_VARIABLE)
    if value is None:
        return TRAINING_COLLECTIVE_TIMEOUT
    try:
        minutes = float(value)
    except ValueError:
        minutes = math.nan
    if not math.isfinite(minutes) or minutes <= 0:
        raise PipelineError(f"{TRAINING_TIMEOUT_VARIABLE}={value!r}: give a number of minutes above 0 (30 when unset)")
    return timedelta(minutes=minutes)


def launched() -> bool:
    """Whether this process is one of several started by ``accelerate launch`` (torchrun sets WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def inference_accelerator(prog: str):
    """The Accelerator of an inference stage under ``accelerate launch --num_processes N``, or None in a single
    process (the stage then runs exactly as it does without accelerate).

    Plain data parallelism: each process loads the whole model on its own device (``accelerator.device``) and runs
    its own forwards. A DeepSpeed launch is refused: a stage would load the whole model in every process anyway (only
    ``deepspeed.initialize`` shards it), so ZeRO-3 would promise a memory saving it does not give; a model too large
    for one device is beyond these stages. On machines without a GPU the processes talk over gloo (what the tests do,
    ``accelerate launch --multi_gpu --num_processes 2`` on CPUs).
    """
    if not launched():
        return None
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        message = (f"{prog} runs data-parallel, each process holding the whole model, and does not run under "
                   "DeepSpeed: launch it with accelerate launch --multi_gpu --num_processes N (no DeepSpeed "
                   "--config_file such as accelerate_cfgs/zero3.yaml)")
        if int(os.environ.get("RANK", "0")) != 0:  # every process refuses; the main one says why
            raise FailedElsewhere(message)
        raise PipelineError(message)
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    return Accelerator(cpu=not torch.cuda.is_available(),
                       kwargs_handlers=[InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT)])


def world_and_rank(accelerator) -> tuple[int, int]:
    """(number of processes, this process's index); (1, 0) without an accelerator."""
    return (1, 0) if accelerator is None else (accelerator.num_processes, accelerator.process_index)


def _failure(error: BaseException, rank: int, world: int) -> tuple[str, str]:
    """(message, traceback text) of a process's failure, as the main process reports it."""
    where = f"process {rank} of {world}"
    if isinstance(error, UserCodeError):
        return f"{where}: {error}", error.user_traceback()
    if isinstance(error, PipelineError):
        return f"{where}: {error}", ""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return f"{where} failed: {one_line(error)}", text


def gather_guarded(accelerator, fn: Callable[[], Any]) -> list[Any]:
    """``fn()`` on every process, then every process's value, in process order (``[fn()]`` without an accelerator).

    If ``fn`` raised on any process, every process raises instead of waiting for the others at a later collective:
    the main process its own error, or, when it succeeded, a :class:`ProcessFailed` naming the first process that
    failed with its error (and the user's traceback, when a reward function raised there); the other processes a
    :class:`FailedElsewhere`, which ``rlhf`` exits on without a word. So a stage that fails on one rank ends the
    launch with one error, printed by the main process.
    """
    return _exchange(accelerator, fn, gather=True)


def guarded(accelerator, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every process, returning this process's own value; a failure anywhere fails every process, as in
    :func:`gather_guarded` (only the errors travel between the processes)."""
    return _exchange(accelerator, fn, gather=False)


def _exchange(accelerator, fn: Callable[[], Any], gather: bool) -> Any:
    if accelerator is None or accelerator.num_processes == 1:
        value = fn()
        return [value] if gather else value
    from accelerate.utils import gather_object

    error, value = None, None
    try:
        value = fn()
    except Exception as e:  # every process learns of it at the gather below
        error = e
    world, rank = accelerator.num_processes, accelerator.process_index
    report = None if error is None else _failure(error, rank, world)
    gathered = gather_object([(report, value if gather and error is None else None)])
    failed = [rep for rep, _ in gathered if rep is not None]
    if failed:
        if error is not None and accelerator.is_main_process:
            raise error
        if not accelerator.is_main_process:
            raise FailedElsewhere(failed[0][0])
        raise ProcessFailed(*failed[0])
    return [v for _, v in gathered] if gather else value


def run_inference(prog: str, body: Callable[[Any], Any]) -> Any:
    """``body(accelerator)`` with :func:`inference_accelerator`'s accelerator (None in one process). At the end, on
    success, every process waits for the others (a gloo group destroyed under a process still talking to it can
    abort that process), then the process group is destroyed, whatever happened."""
    accelerator = inference_accelerator(prog)
    if accelerator is None:
        return body(None)
    try:
        result = body(accelerator)
        accelerator.wait_for_everyone()
        return result
    finally:
        finish_distributed()


def stop_everywhere(accelerator, message: str) -> PipelineError:
    """The error that every process of the run raises at the same point, on a verdict they share: the main
    process's is the one ``error:`` line; the others exit without a word (``FailedElsewhere``)."""
    return PipelineError(message) if accelerator.is_main_process else FailedElsewhere(message)
