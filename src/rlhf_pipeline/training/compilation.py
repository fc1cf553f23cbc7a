"""``--compile``: each decoder layer compiled with ``torch.compile``, on one process without DeepSpeed.

A training step of a transformers decoder runs, per layer, a handful of matmuls and attention among some forty small
kernels forward and twice as many backward: RMSNorm in float32 (a cast, a square, a mean, a reciprocal root, two
products, a cast back), the rotary embedding (slices, a negation, a concatenation, products and sums for q and k),
the SwiGLU product, the residual sums. On a GPU each is a launch and a trip through memory; the trainer's profiles in
docs/benchmarks.md show how much of a step they take. Compiled, Inductor can fuse such runs into a few kernels,
forward and backward (how much that gains on a GPU is to be measured: docs/benchmarks.md).

How, and why that way:

- Regional: each decoder layer (transformers' ``GradientCheckpointingLayer``, else the classes the model names in
  ``_no_split_modules``) is compiled in place (``nn.Module.compile``), not the whole model. The layers are alike, so
  Dynamo traces one and reuses it for the others: the compilation costs one layer's, not the model's. The model's
  parameters and state dict keep their names, so checkpoints, the master weights and the saved model are untouched.
- ``dynamic=True``: every micro-batch has its own lengths (packed, unpadded or padded), so the graphs take symbolic
  sizes from the start instead of recompiling for the first few new ones.
- What stays outside: the embedding, the rotary table, the final norm and the LM head with its chunked log-softmax
  (``rlhf_pipeline.logprobs``), whose chunks run under activation checkpointing.
- Each way the layers run is a graph of its own: with and without gradients, train and eval mode, one row (the
  varlen layout) or several, and so on; a run of one stage uses a handful. They all count against one Dynamo limit,
  which is raised (:func:`compile_decoder_layers`) so that none falls back to eager unnoticed.
- Not under DeepSpeed: ZeRO-3 gathers each layer's parameters with module hooks as it runs, which a compiled layer
  would have to trace; this refuses it rather than compile something DeepSpeed's own ``compile`` should handle. Nor
  with QLoRA's 4-bit layers (bitsandbytes' kernels), nor before torch 2.5 (:func:`check_compile`).

The compiled model computes what the eager one does to float rounding (Inductor reorders and fuses float
operations); the tests check losses and gradients against it. The first steps pay the compilation.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any, Iterator

from rlhf_pipeline.errors import PipelineError

log = logging.getLogger(__name__)

FLAG = "--compile"
MIN_TORCH = (2, 5)  # nn.Module.compile (2.2); Dynamo inlining built-in modules, so alike layers share a trace (2.5)
RECOMPILE_LIMIT = 64  # graphs Dynamo keeps for the layers' code (see compile_decoder_layers)


def decoder_layers(model: Any) -> list[Any]:
    """The model's repeated decoder layers, in order: the modules transformers marks as ``GradientCheckpointingLayer``
    (its decoder layers), else those of the classes its ``_no_split_modules`` names. A LoRA (peft) model is searched
    through its wrappers alike. Empty when the model has neither."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers
        GradientCheckpointingLayer = ()  # noqa: N806
    layers = [m for m in model.modules() if GradientCheckpointingLayer and isinstance(m, GradientCheckpointingLayer)]
    if layers:
        return layers
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def check_compile(deepspeed: bool) -> None:
    """Refuse ``--compile`` where it cannot work, before a stage reads or writes anything: under accelerate's
    DeepSpeed plugin (see the module docstring), or on a torch older than :data:`MIN_TORCH` (``nn.Module.compile``,
    and one trace shared by alike layers). (With QLoRA's 4-bit layers the options refuse it.)"""
    import torch

    if deepspeed:
        raise PipelineError(
            f"{FLAG} is for the single-process trainer: under DeepSpeed, ZeRO gathers each layer's parameters with "
            f"hooks that a compiled layer would have to trace; drop {FLAG}, or run without the DeepSpeed config"
        )
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    if version < MIN_TORCH:
        raise PipelineError(f"{FLAG} needs torch >= {'.'.join(map(str, MIN_TORCH))} (this is {torch.__version__}); "
                            f"upgrade torch, or drop {FLAG}")


def require_decoder_layers(model: Any, what: str = "the model") -> list[Any]:
    """:func:`decoder_layers`, or the error that names ``what`` when it has none."""
    layers = decoder_layers(model)
    if not layers:
        raise PipelineError(
            f"{FLAG}: found no decoder layers to compile in {what} (no transformers GradientCheckpointingLayer and no "
            f"_no_split_modules class); drop {FLAG}"
        )
    return layers


def compile_decoder_layers(model: Any, what: str = "the model") -> int:
    """Compile each of ``model``'s decoder layers in place (:func:`decoder_layers`, ``dynamic=True``); returns how
    many. ``what`` names the model in the error when it has none.

    The layers share one code object, so Dynamo's limit on the graphs it keeps for one (8 by default) is shared by
    every way they run (the module docstring); past it a layer would quietly run eager, so the limit is raised to
    :data:`RECOMPILE_LIMIT` for this process."""
    import torch._dynamo

    layers = require_decoder_layers(model, what)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its name before 2.7
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    for layer in layers:
        layer.compile(dynamic=True)
    log.info("%s: %d decoder layers (%s) compiled with torch.compile; the first steps pay the compilation", FLAG,
             len(layers), type(layers[0]).__name__)
    return len(layers)


@contextlib.contextmanager
def compile_errors(enabled: bool) -> Iterator[None]:
    """A compilation that fails (Inductor's backend: a missing compiler, Triton) as one error line naming the fix,
    instead of the backend's traceback. Compilation is lazy, so this wraps what runs the model (the reference pass,
    the training)."""
    if not enabled:
        yield
        return
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        yield
    except BackendCompilerFailed as e:
        cause = getattr(e, "inner_exception", None) or e
        lines = str(cause).strip().splitlines()
        what = f"{type(cause).__name__}: {lines[0][:300]}" if lines else type(cause).__name__
        raise PipelineError(f"{FLAG}: torch.compile failed ({what}); drop {FLAG}") from e
