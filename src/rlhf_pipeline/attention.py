"""Attention implementations: the one place the choices of ``--attn-implementation`` are declared, and ``varlen``,
the one this package adds to transformers.

Every stage that loads a model takes ``--attn-implementation`` (:data:`ATTENTION_IMPLEMENTATIONS`) and loads it with
:func:`from_pretrained_kwargs`:

* ``sdpa`` (the default): what transformers picks when asked for nothing, which is PyTorch's
  ``scaled_dot_product_attention`` where the model supports it (eager otherwise). Packed rows get a dense
  block-diagonal mask built from the position ids (``rlhf_pipeline.logprobs``).
* ``eager``: transformers' plain matmul-softmax attention, the slowest; for models or checks that need it.
* ``flash_attention_2``: the ``flash-attn`` package's kernels (a CUDA GPU, bf16/fp16), through transformers.
* ``varlen``: PyTorch's own variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``, PyTorch
  2.10+, no extra package), registered with transformers here (:func:`register_varlen`).

With ``flash_attention_2`` and ``varlen`` the log-prob pass lays a micro-batch out as one row of sequences with no
padding and no mask, and gives the attention each sequence's bounds (transformers' ``FlashAttentionKwargs``:
``cu_seq_lens_q``/``cu_seq_lens_k``, ``max_length_q``/``max_length_k``), so no position attends across a sequence
and none is spent on padding. ``varlen`` runs ``varlen_attn`` on a CUDA GPU in bf16 or fp16; anywhere else (a CPU,
float32, a PyTorch without it) it runs :func:`varlen_reference`, one ``scaled_dot_product_attention`` call per
sequence, which is also what the tests check the GPU kernel against. Any other call of a ``varlen`` model (generation,
reward scoring, a padded forward with its attention mask) goes to transformers' sdpa attention, as with ``sdpa``.

The choice changes results only by float rounding, so it is not part of what decides whether a finished output is
reused (``semantic=False``, as ``--pack-ratio``); the manifest records it with the rest of the config. The vLLM
engine picks its own attention backend: there any other value than the default is an error.

Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Literal

from rlhf_pipeline.errors import PipelineError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "varlen")
AttnImplementation = Literal[ATTENTION_IMPLEMENTATIONS]  # type: ignore[valid-type]  # the CLI's choices
DEFAULT_ATTENTION = "sdpa"
FLAG = "--attn-implementation"
VARLEN = "varlen"
# The implementations that take one row of unpadded sequences and their bounds (FlashAttentionKwargs), as a model's
# config names them (``config._attn_implementation``): the log-prob pass lays batches out that way for these.
VARLEN_CAPABLE = (VARLEN, "flash_attention_2", "flash_attention_3")

LOG_PROBS_NOTE = ("With flash_attention_2 and varlen the log-prob passes take each micro-batch as one row of "
                  "sequences, without padding or a mask.")


def attn_help(whose: str = "The model's", note: str = LOG_PROBS_NOTE) -> str:
    """The help of ``--attn-implementation``: the same in every stage, but for whose attention it is and a note on
    what it changes there."""
    return (
        f"{whose} attention implementation: sdpa (transformers' default), eager, flash_attention_2 (the flash-attn "
        "package) or varlen (PyTorch's variable-length flash attention on a GPU; a per-sequence reference on a CPU). "
        f"{note} See rlhf_pipeline.attention."
    )


def check_attn_implementation(name: str) -> None:
    """Refuse, before a stage writes anything, an implementation that cannot load here."""
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise PipelineError(f"{FLAG} {name}: not one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise PipelineError(
            f"{FLAG} flash_attention_2: the flash-attn package is not installed; pip install flash-attn (a CUDA "
            f"build), or use {FLAG} varlen (PyTorch's own variable-length attention) or sdpa"
        )


def check_engine(name: str, engine: str, engine_flag: str = "--engine",
                 error: type[Exception] = PipelineError) -> None:
    """vLLM picks its own attention backend, so an implementation asked for there would be silently ignored: refuse
    anything but the default with the ``vllm`` engine (``engine``, as ``engine_flag`` resolved). ``error``: a config's
    checks raise ValueError, which the config parser turns into its one line."""
    if engine == "vllm" and name != DEFAULT_ATTENTION:
        raise error(
            f"{FLAG} {name}: applies to the hf engine only (with {engine_flag} vllm, vLLM picks its own attention "
            f"backend); drop {FLAG}, or use {engine_flag} hf"
        )


def from_pretrained_kwargs(name: str) -> dict[str, str]:
    """What ``from_pretrained`` is given for ``--attn-implementation name``: nothing for the default (transformers'
    own choice, as before the option existed), else ``attn_implementation``, with ``varlen`` registered first."""
    check_attn_implementation(name)
    if name == DEFAULT_ATTENTION:
        return {}
    if name == VARLEN:
        register_varlen()
    return {"attn_implementation": name}


def takes_varlen(model) -> bool:
    """Whether ``model``'s attention takes one row of unpadded sequences with their bounds (:data:`VARLEN_CAPABLE`)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) in VARLEN_CAPABLE


def sdpa_backends(model, device):
    """The context a log-prob pass runs its decoder in: on a CUDA GPU with sdpa (or varlen, whose calls without
    bounds are sdpa's), every backend of PyTorch's ``scaled_dot_product_attention`` but cuDNN's, elsewhere nothing.

    Why: the log-prob passes give every forward new shapes (each micro-batch's lengths), and cuDNN's SDPA plans
    anew for each shape on the host, which in a profile of the trainer on an H100 left the GPU idle most of each step
    (docs/benchmarks.md, "The trainer on one H100: the profile"); flash or memory-efficient attention, which PyTorch
    picks without cuDNN, plan nothing."""
    import contextlib

    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if device.type != "cuda" or implementation not in ("sdpa", VARLEN):  # varlen's calls without bounds are sdpa's
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def register_varlen() -> None:
    """Register ``varlen`` with transformers: its attention function, and its mask function. Both are needed:
    ``create_causal_mask`` looks the mask function up under the model's attention name (an unknown name gets no mask
    at all, which would let padded generation attend to pads). Registering again replaces the same functions."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, varlen_mask)
    _varlen_attn()  # looked up now, outside any compiled layer


def varlen_mask(batch_size, q_length, kv_length, *args, attention_mask=None, local_size=None, **kwargs):
    """The mask function of ``varlen``. Without a padding mask there is none to build: a row of packed sequences
    is given its bounds through ``cu_seq_lens_q`` instead, so no dense ``(T, T)`` mask is made for it. With a padding
    mask (batched generation, a padded forward), or a sliding window shorter than the row, it is sdpa's mask, which
    the sdpa fallback of :func:`varlen_attention` reads."""
    if attention_mask is None and (local_size is None or kv_length <= local_size):
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, local_size=local_size,
                     **kwargs)


def varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     is_causal: bool | None = None, sliding_window: int | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function of ``varlen``, with transformers' contract: query ``(B, Hq, T, D)``, key and value
    ``(B, Hkv, T, D)``; returns ``((B, T, Hq, D), None)``.

    Given ``cu_seq_lens_q`` (int32, the cumulative sequence lengths over the ``B*T`` tokens, 0 first) and
    ``max_length_q`` (an int; the ``_k`` ones default to them), each sequence attends causally to itself alone (and
    within ``sliding_window`` tokens, for a model that has one): on a CUDA GPU in bf16 or fp16 with ``varlen_attn``,
    elsewhere with :func:`varlen_reference`. Without them (generation, reward scoring, a padded forward) it is
    transformers' sdpa attention, with the mask :func:`varlen_mask` made; a row of several sequences given without
    their bounds would then be one sequence.
    """
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if dropout:
        raise PipelineError(
            f"--attn-implementation varlen: attention dropout {dropout} is not supported (training turns dropout off); "
            "use --attn-implementation sdpa for a model trained with it"
        )
    for name in ("softcap", "s_aux"):  # Gemma-2's attention-logit cap, gpt-oss's attention sinks
        if kwargs.get(name) is not None:
            raise PipelineError(f"--attn-implementation varlen: the model's attention uses {name}, which varlen does "
                                "not apply; use --attn-implementation eager")
    cu_k = kwargs.get("cu_seq_lens_k")
    cu_k = cu_q if cu_k is None else cu_k
    max_q = kwargs.get("max_length_q")
    max_k = kwargs.get("max_length_k") or max_q
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    batch, heads, length, _ = query.shape
    if key.shape[2] != length:
        raise ValueError(f"varlen attention takes no KV cache: {length} queries but {key.shape[2]} keys")
    # (B, H, T, D) -> (B*T, H, D): a view when B is 1, as the log-prob pass calls it
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[3]) for x in (query, key, value))
    q, k, v = _autocast_inputs(q, k, v)
    if _kernel_runs(q):
        out = _varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scaling, causal, sliding_window)
    else:
        out = varlen_reference(q, k, v, cu_q, scale=scaling, causal=causal, sliding_window=sliding_window)
    return out.reshape(batch, length, heads, out.shape[-1]), None


def _autocast_inputs(q, k, v):
    """q, k, v in autocast's dtype where autocast is on for their device, as ``scaled_dot_product_attention`` gets
    them. Under bf16 autocast over float32 weights (the trainer's --bf16) the projections come out in bf16 but a
    Llama's rotary embedding, computed in the residual stream's float32, promotes q and k back to float32: without
    this cast, varlen would take its float32 reference path on a GPU instead of the kernel."""
    import torch

    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x for x in (q, k, v))


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                     scale: float | None = None, causal: bool = True,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Variable-length attention one sequence at a time: ``q`` ``(N, Hq, D)``, ``k`` and ``v`` ``(N, Hkv, D)`` hold
    the sequences one after another, ``cu_seq_lens`` ``(S + 1,)`` their bounds; returns ``(N, Hq, D)``. Each sequence
    is one ``scaled_dot_product_attention`` call (causal; a query sees the ``sliding_window`` latest keys, itself
    included, when given), the key/value heads repeated for grouped-query attention. What ``varlen`` runs off the
    GPU kernel's path, and the oracle the kernel is tested against."""
    import torch
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bounds = cu_seq_lens.tolist()  # free on a CPU, the only place this runs in a real pass
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, L, D)
        mask = None
        if causal and sliding_window is not None and end - start > sliding_window:
            rows = torch.arange(end - start, device=q.device)
            offset = rows[:, None] - rows[None, :]
            mask = (offset >= 0) & (offset < sliding_window)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                             is_causal=causal and mask is None)
        pieces.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(pieces) if pieces else q.new_zeros((0, q.shape[1], v.shape[-1]))


_KERNEL: tuple | None | bool = False  # _varlen_attn()'s answer, False until it has looked


def _varlen_attn():
    """PyTorch's ``varlen_attn`` and whether it takes ``enable_gqa`` (2.13 does, 2.11 does not), or None before 2.10
    (said once). Looked up once, by :func:`register_varlen` when a model loads with ``varlen``, and kept in a module
    variable that a compiled layer (``--compile``) reads as a constant: a cached function's lookup (``inspect``, the
    import) would break its graph in two at every layer."""
    global _KERNEL
    if _KERNEL is False:
        import inspect

        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            log.warning("--attn-implementation varlen: this PyTorch has no torch.nn.attention.varlen (2.10+); "
                        "attending one sequence at a time instead")
            _KERNEL = None
        else:
            _KERNEL = varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters
    return _KERNEL


def _kernel_runs(q: torch.Tensor) -> bool:
    import torch

    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None


def _varlen_kernel(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None, causal: bool,
                   sliding_window: int | None):
    varlen_attn, takes_gqa = _varlen_attn()
    extra = {}
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if takes_gqa:
            extra["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # (left, right) as flash attention counts them: (-1, 0) is causal; a window of w keys is w - 1 to the left
    window = ((-1 if sliding_window is None else sliding_window - 1), 0) if causal else (-1, -1)
    return varlen_attn(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale=scale, window_size=window, **extra)
