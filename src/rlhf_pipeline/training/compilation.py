"""``--compile``: each decoder layer compiled with ``torch.compile``, on one process without DeepSpeed.

A training step of a transformers decoder runs, per layer, a handful of matmuls and attention among some forty small
kernels forward and twice as many backward: RMSNorm in float32 (a cast, a square, a mean, a reciprocal root, two
products, a cast back), the rotary embedding (slices, a negation, a concatenation, products and sums for q and k),
the SwiGLU product, the residual sums. On a GPU each is a launch and a trip through memory; the trainer's profiles in
docs/benchmarks.md show how much of a step they take. Compiled, Inductor fuses each run of them into one or two
kernels, forward and backward.

How, and why that way:

- Regional: each decoder layer (transformers' ``GradientCheckpointingLayer``, else the classes the model names in
  ``_no_split_modules``) is compiled in place (``nn.Module.compile``), not the whole model. The layers are alike, so
  Dynamo traces one and reuses it for the others: the compilation costs one layer's, not the model's. The model's
  parameters and state dict keep their names, so checkpoints, the master weights and the saved model are untouched.
- ``dynamic=True``: every micro-batch has its own lengths (packed, unpadded or padded), so the graphs take symbolic
  sizes from the start instead of recompiling for the first few new ones.
- What stays outside: the embedding, the rotary table, the final norm and the LM head with its chunked log-softmax
  (``rlhf_pipeline.logprobs``), whose chunks run under activation checkpointing.
- A few variants are compiled at most: training and the no-grad reference or evaluation pass are separate graphs, and
  a micro-batch of one row (the varlen layout) is specialised apart from several.
- Not under DeepSpeed: ZeRO-3 gathers each layer's parameters with module hooks as it runs, which a compiled layer
  would have to trace; this refuses it rather than compile something DeepSpeed's own ``compile`` should handle.

The compiled model computes what the eager one does to float rounding (Inductor reorders and fuses float
operations); the tests check losses and gradients against it. The first steps pay the compilation.
"""

from __future__ import annotations

import logging
from typing import Any

from rlhf_pipeline.errors import PipelineError

log = logging.getLogger(__name__)

FLAG = "--compile"


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


def compile_decoder_layers(model: Any, what: str = "the model") -> int:
    """Compile each of ``model``'s decoder layers in place (:func:`decoder_layers`, ``dynamic=True``); returns how
    many. ``what`` names the model in the error when it has none."""
    layers = decoder_layers(model)
    if not layers:
        raise PipelineError(
            f"{FLAG}: found no decoder layers to compile in {what} (no transformers GradientCheckpointingLayer and no "
            f"_no_split_modules class); drop {FLAG}"
        )
    for layer in layers:
        layer.compile(dynamic=True)
    log.info("%s: %d decoder layers (%s) compiled with torch.compile; the first steps pay the compilation", FLAG,
             len(layers), type(layers[0]).__name__)
    return len(layers)


def refuse_deepspeed(enabled: bool) -> None:
    """The error for ``--compile`` under accelerate's DeepSpeed plugin (see the module docstring)."""
    if enabled:
        raise PipelineError(
            f"{FLAG} is for the single-process trainer: under DeepSpeed, ZeRO gathers each layer's parameters with "
            f"hooks that a compiled layer would have to trace; drop {FLAG}, or run without the DeepSpeed config"
        )
