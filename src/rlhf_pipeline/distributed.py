"""Running on one or many processes: the accelerator, inference shared over the processes, and the collectives the
training loop needs.

The same code runs single-process on a CPU and under ``accelerate launch --config_file accelerate_cfgs/zero3.yaml``
on many GPUs (or, in the tests, ``accelerate_cfgs/cpu_zero3.yaml`` on CPUs with gloo). Under DeepSpeed ZeRO-3 every
forward is collective (each process holds a shard of the weights), so every process must run the same number of
forwards: that is why inference here hands each process the same number of batches, with stand-ins where it has
none left.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rlhf_pipeline.errors import PipelineError

if TYPE_CHECKING:
    from rlhf_pipeline.trainer import TrainOptions


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
    """The Accelerator of a training run, with DeepSpeed's batch sizes and clipping set from ``config``."""
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


def finish_distributed() -> None:
    """Destroy the process group before exit (a CPU gloo group otherwise aborts the process at teardown)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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


def reduce_sums(accelerator, sums: dict[str, float]) -> dict[str, float]:
    """Sum each value over all processes."""
    import torch

    if accelerator.num_processes == 1:
        return dict(sums)
    keys = sorted(sums)
    t = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=accelerator.device)
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
