"""bfloat16 weights with float32 master copies (``--bf16-weights``), on one process without DeepSpeed.

With ``--bf16`` alone the model keeps float32 weights and every forward runs under bf16 autocast: each micro-batch
casts every weight to bfloat16 on the way in, the residual stream stays in float32, and the gradients land in
float32. With ``--bf16-weights`` the model's weights are bfloat16, so forwards and backwards read them as they are and
the activations are bfloat16; the optimizer steps float32 *master* copies of the trained weights instead, and writes
them back, rounded, after each step. That is what DeepSpeed's bf16 mode does (``accelerate_cfgs/zero*.yaml``), and
what this module gives the single-process trainer.

- Each trained weight's gradient is moved, once its backward has produced it (a post-accumulate hook), into a float32
  gradient on its master and the bfloat16 one freed: the micro-batches of a step add up in float32, as under
  autocast, and the model holds no gradients of its own.
- The optimizer, the clipping and the gradient norm see the masters (:attr:`MasterWeights.masters`);
  :meth:`MasterWeights.write_back` copies them into the model after each optimizer step.
- A small update that does not move a bfloat16 weight is kept by its master and adds up over the steps (at a learning
  rate of 1e-6 most single updates are below bfloat16's resolution).
- Only the parameters are cast. Buffers keep their dtype: a rotary embedding's ``inv_freq`` rounded to bfloat16
  would turn every position's angle by up to radians at a few thousand tokens, away from what a model loaded for
  inference computes. So do the modules a model keeps in float32 (``_keep_in_fp32_modules``).
- Checkpoints hold the masters as safetensors beside the optimizer state (:meth:`save`, :meth:`load`), so a resumed
  run continues from the same float32 values, and the model is saved from them (:meth:`state_dict`), in float32 as
  ``--bf16`` alone saves it: what a step added below bfloat16's resolution is not lost between stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MASTERS_FILE = "master_weights.safetensors"


class MasterWeights:
    """Float32 masters of ``model``'s trained parameters; the model itself is cast to ``dtype`` (bfloat16). Build it
    on the model where it will train (after it is moved to its device), and give :attr:`masters` to the optimizer."""

    def __init__(self, model: Any, dtype: Any = None):
        import torch

        dtype = dtype or torch.bfloat16
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        # copies taken before the cast: the masters start from the loaded weights, not their rounding
        self.names = [name for name, _ in trained]
        self.masters = [p.detach().to(torch.float32, copy=True) for _, p in trained]
        self.params = [p for _, p in trained]
        keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
        for name, p in model.named_parameters():  # shared weights once; the same Parameter objects, cast in place
            if p.is_floating_point() and not any(k in name.split(".") for k in keep):
                p.data = p.data.to(dtype)
        self.handles = [p.register_post_accumulate_grad_hook(self._mover(m)) for p, m in zip(self.params, self.masters)]

    @staticmethod
    def _mover(master):
        def move(param) -> None:
            if master.grad is None:
                master.grad = param.grad.to(master.dtype)
            else:
                master.grad.add_(param.grad)
            param.grad = None

        return move

    def named_masters(self) -> list[tuple[str, Any]]:
        """(the model parameter's name, its master), for grouping them in the optimizer."""
        return list(zip(self.names, self.masters))

    def write_back(self) -> None:
        """Copy the masters, rounded, into the model's weights (after an optimizer step)."""
        import torch

        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A model's ``state_dict`` with its trained weights replaced by their float32 masters (what is saved). An
        entry is matched to its weight by storage, so that every name of a shared weight (tied embeddings) gets the
        one master, and ``save_pretrained`` still sees them tied."""
        by_storage = {p.data_ptr(): m.detach() for p, m in zip(self.params, self.masters)}
        return {k: by_storage.get(v.data_ptr(), v) if hasattr(v, "data_ptr") else v for k, v in state_dict.items()}

    def save(self, directory: Path) -> None:
        """The masters as ``directory/master_weights.safetensors``, by parameter name."""
        from safetensors.torch import save_file

        save_file({n: m.detach().contiguous().cpu() for n, m in self.named_masters()}, str(directory / MASTERS_FILE))

    def load(self, directory: Path) -> None:
        """The masters :meth:`save` wrote, then into the model's weights; a checkpoint without them is an error."""
        from safetensors.torch import load_file

        path = directory / MASTERS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no master weights (the checkpoint was written without --bf16-weights)")
        saved = load_file(str(path))
        missing = [n for n in self.names if n not in saved]
        if missing or len(saved) != len(self.names):
            extra = sorted(set(saved) - set(self.names))
            what = f"no master for {missing[0]} ({len(missing)} missing)" if missing else f"{extra[0]} is not trained"
            raise KeyError(f"{path}: {what}: the checkpoint is of another model or another set of trained weights")
        for n, m in self.named_masters():
            if saved[n].shape != m.shape:
                raise ValueError(f"{path}: {n} has shape {tuple(saved[n].shape)}, the model's {tuple(m.shape)}")
            m.copy_(saved[n])
        self.write_back()
