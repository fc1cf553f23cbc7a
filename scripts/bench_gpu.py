#!/usr/bin/env python
"""DPO training throughput and MFU on one GPU: our trainer's step against TRL's ``DPOTrainer``, full fine-tuning
and LoRA.

    python scripts/bench_gpu.py                                  # ~0.9B Llama, bf16 autocast, on cuda:0
    python scripts/bench_gpu.py --lora-rank 0,16                 # full fine-tuning and LoRA r16 side by side
    python scripts/bench_gpu.py --attn sdpa --max-tokens-per-micro-batch 0   # ours as before varlen and the budget
    python scripts/bench_gpu.py --sides ours_bf16 --profile      # and a torch.profiler summary of 3 more steps
    python scripts/bench_gpu.py --device cpu --tiny              # the same code end to end on a CPU, < 1 minute

Standalone: it needs torch, transformers, peft (with ``--lora-rank``) and (for the TRL sides) trl + datasets, and
imports ``rlhf_pipeline`` from this checkout's ``src/`` (no install needed). Neither ``datasets`` nor ``deepspeed``
is needed for our side; TRL imports ``datasets``, so without it the TRL sides are skipped with a message.

Model and data (identical on every side)
----------------------------------------
A random-initialised Llama built from ``LlamaConfig`` (never downloaded): hidden 2048, 16 layers, 16 heads, 8 KV heads,
intermediate 5632, vocab 32000, untied LM head (~0.89B parameters), saved once to a work directory that every side
loads from. Weights are float32 (master weights) and every forward runs under bf16 autocast, on both sides: TRL's
default (``bf16=True`` on a float32 model) and our ``rlhf train --bf16``. Synthetic pairs of random ids: prompt
16-256 tokens, each response 16-512 (uniform; each response ends with EOS). Every side trains ``warmup + steps``
optimizer steps (default 2 + 20) over the same ``batch_size x accumulation`` global batches (default 4 x 4 pairs), one
pass over ``(warmup + steps) x global batch`` pairs, with AdamW (torch, fused on CUDA) at 1e-6, warmup + cosine,
clipping at 1.0, DPO beta 0.1, no gradient checkpointing (TRL defaults it on; it is turned off there so both sides do
the same work; ``--gradient-checkpointing`` turns it on for both).

``--tiny`` (a smoke test, not a measurement): hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512, float32 without
autocast, prompts 8-64 and responses 8-128 tokens, a global batch of 2 x 2, 2 + 2 steps, one CPU thread per side.

Sides, each in a fresh subprocess (so peak memory is its own)
-------------------------------------------------------------
* ``ours``: our trainer's step, reproduced from the library without the CLI (which needs ``datasets``). Reference
  log-probs first, as ``rlhf train`` computes them when the data has none: one no-grad pass over all pairs with
  ``algorithms.pairs.pair_logps`` in length-sorted batches of ``--ref-batch-size`` (``distributed.sharded_batches``).
  Then per step: the global batch from ``training.loop.global_batches``, cut by ``training.loop.step_micro_batches``
  (``--batch-size`` pairs each, or micro-batches of up to ``--max-tokens-per-micro-batch`` tokens: 8,192 by default
  on CUDA), each micro-batch through ``pairs.PairTask.loss`` (``pair_logps`` for the policy log-probs, with the
  model's ``--attn`` attention: varlen by default on CUDA, one unpadded row per micro-batch; sdpa elsewhere, packed
  by ``pack_ratio``; ``algorithms.pairs.compute_pair_loss("dpo", PairLossParams(beta=0.1), ...)`` against the
  precomputed reference), backward of loss x ``training.loop.micro_batch_weight`` / accumulation, metrics summed per
  micro-batch as the trainer does (``training.loop.add_to_sums``, on the device, read once per step), clip, AdamW
  step, schedule step.
* ``ours_bf16``: the same step with ``rlhf train --bf16-weights``: the model's weights in bf16 and float32 master
  copies in the optimizer (``training.master_weights.MasterWeights``: gradients moved onto the masters as each
  backward produces them, summed over the micro-batches in float32; clipping and AdamW on the masters, written back
  rounded after each step), under bf16 autocast whatever ``--precision`` says (the trainer takes the option only with
  ``--bf16``); full fine-tuning only (skipped in LoRA modes).
* ``ours_compile``: ``ours_bf16`` with ``rlhf train --compile``: each decoder layer compiled with ``torch.compile``
  (``training.compilation``, dynamic shapes), so its norms, rotary embedding, activation and casts run as fused
  kernels. The compilation falls in the reference pass and the warmup steps, outside the steps window; the step-1
  loss and gradient norm against ``ours_bf16`` (``ours_compile_vs_ours_bf16``) check that it computes the same step.
* TRL's sides use ``--trl-attn`` (sdpa by default) with cuDNN's SDPA backend off (``--trl-cudnn-sdpa off``, as our
  log-prob passes run sdpa on a GPU, ``rlhf_pipeline.attention.sdpa_backends``; ``on`` is PyTorch's default, which
  plans on the host for every new shape: docs/benchmarks.md has what that cost TRL on an H100).
* ``trl``: TRL's ``DPOTrainer`` with its default reference model (a second model loaded from the same directory and
  run every step).
* ``trl_precomputed``: TRL with ``precompute_ref_log_probs=True`` (its pass runs in the trainer's constructor, with
  ``precompute_ref_batch_size = --ref-batch-size``).
  TRL gets the token ids directly (its tokenization is bypassed by overriding ``_prepare_dataset``). With
  ``--trl-order ours`` (default) it reads the pairs in exactly our micro-batch order (sequential sampler), so every
  micro-batch holds the same pairs on all sides (and the step-1 loss and grad norm must agree); ``--trl-order
  random`` uses TRL's default shuffled sampler instead (each pair still seen once, micro-batches not length-sorted).

Full fine-tuning and LoRA (``--lora-rank``)
-------------------------------------------
``--lora-rank`` lists the modes, each run on every side: 0 = full fine-tuning (the default, alone), R = rank-R LoRA
with alpha ``--lora-alpha`` (default 2R), on every linear layer of the decoder but the LM head (peft's
``all-linear``, our default), no adapter dropout. ``--lora-rank 0,16`` gives full and LoRA side by side in one run
(runs ``ours``, ``trl``, ..., then ``ours_lora16``, ``trl_lora16``, ...). The same pairs, steps and optimizer
settings in every mode; AdamW and clipping see only the trained parameters.

* ours: the model is loaded as ``rlhf train --lora-rank R`` loads it, through ``training.loop.load_trainable`` with
  ``training.lora.LoraOptions`` (seeded, loaded on the CPU, dropout off, then ``training.lora.add_adapters`` freezes it and adds the
  adapters), and moved to the device. The reference pass runs that model as ``rlhf train`` does: the adapters' B
  matrices start at zero, so it is the starting model.
* TRL: ``peft_config=peft.LoraConfig(...)`` with the same rank, alpha and targets. TRL then holds no second model:
  with a peft model and no ``ref_model`` its reference is the policy with the adapters disabled, run every step in
  ``trl`` (a second forward of the one model) and once in the constructor in ``trl_precomputed`` (the same
  adapter-disabled model; precompute then saves only the per-step reference forward, no memory).
* The same start: TRL seeds (``set_seed(seed)``) before loading the model and calling peft, as ``load_trainable``
  does, so the adapters' A matrices are the same draws on every side; B = 0, so the step-1 loss is the full model's.
  The step-1 grad norm is then over the B matrices alone (A's gradient is zero while B is) and depends on A, so its
  agreement with TRL checks that both sides built the same adapters; ``same_trained_params`` compares the counts.

What is timed (``torch.cuda.synchronize`` at every clock reading; imports and CUDA context creation are not timed)
* steps window: from the end of step ``--warmup`` to the end of the last step, i.e. ``--steps`` steady steps.
* not timed: ``--profile``'s steps, run under the profiler after the last timed step.
* whole run: setup + reference pass + every step (warmup steps included); no save. Setup is the model load for ours
  and the trainer's construction for TRL (its model load(s), Trainer / accelerate set-up; the precompute pass is
  reported apart as the reference pass). Optimizer creation and ``train()``'s start-up fall in the first step.

Real tokens of a pair = prompt twice + both responses (what a pair's chosen and rejected sequences hold). Tokens/s
= real tokens of the window / its seconds. Positions processed (padding, packing slack) are reported as the
real-token fraction. Peak memory = ``torch.cuda.max_memory_allocated`` of the side's own process (CPU: peak RSS).

FLOPs and MFU
-------------
Model FLOPs follow PaLM (Chowdhery et al. 2022, appendix B): per token, ``6N + 12·L·H·Q·T`` for a training step
(forward + backward), with N the parameters that take part in matmuls (all parameters minus the input embedding
table; the LM head counted), L layers, H·Q = heads × head dim = hidden size, T the sequence's length. Summed over a
sequence of T tokens:

    training  (forward + backward) of one sequence:  6·N·T + 12·L·hidden·T²
    reference (forward only, no grad) of one sequence: 2·N·T +  4·L·hidden·T²

summed over the chosen and the rejected sequence (prompt + response) of every pair. T is the sequence's own real
length: padding and the cross-sequence blocks of a packed row are not model FLOPs, and the attention term is PaLM's
(no halving for the causal mask), the LM head is counted at every position.

A LoRA step computes no weight gradients of the frozen N: per token the forward (2N) and the input gradients (2N)
remain, plus the adapters' own forward, input- and weight-gradient matmuls (6 per adapter parameter, N_lora =
Σ rank·(in + out) over the adapted layers); the attention term has no weights and is unchanged:

    LoRA training of one sequence:  (4·N + 6·N_lora)·T + 12·L·hidden·T²

Its MFU uses these FLOPs; the "6N" count would overstate it by about half (6N / 4N at a small rank). 4N slightly
overcounts: autograd skips the input gradient of the first layer's q/k/v projections, whose input (the frozen
embedding's output) needs none (about 0.5% of 4N at the default size). The reference forward is counted as the base
model's (2N + attention) in every mode. FLOPs are counted from the sequences each
side actually trained on in each step; with ``--trl-order ours`` these are the same pairs on every side, so MFU
differences are speed differences.

    MFU (steps)          = training FLOPs of the window's steps / window seconds / peak
    MFU (steps, +ref)    = the same plus the reference forward FLOPs run inside those steps (TRL default only; the
                           other sides compute the reference before training, so it equals MFU (steps) for them)
    MFU (run)            = (training FLOPs of all steps + reference FLOPs of all pairs) / whole-run seconds / peak
    step_mfu             = MFU (steps) of each timed step alone (its own FLOPs over its own seconds), in order

so MFU (steps) excludes the reference pass everywhere, and MFU (run) includes it (each side does one reference forward
per pair, in a pass or inside its steps), with the setup in its seconds. The peak is ``--peak-tflops`` (dense
bf16), by default from the device name: H100 SXM / H200 989, H100 NVL 835, H100 PCIe 756, A100 312; unknown devices
(and the CPU) get no MFU unless ``--peak-tflops`` is given.

Output: a JSON file (``--output``, default gpu_bench.json) and a markdown table on stdout, with the ratios
ours / TRL within each mode for tokens/s (> 1: ours faster) and peak memory (< 1: ours smaller), ours_compile /
ours_bf16 alike (with the step-1 loss and gradient norm: the same step, compiled), and LoRA / full on
each side (``ours_lora16_vs_ours``, ...) for peak memory and step time (the steps window's seconds, the same steps;
< 1: LoRA smaller / faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if (REPO / "src" / "rlhf_pipeline").is_dir():  # benchmark this checkout's code, installed or not
    sys.path.insert(0, str(REPO / "src"))

from rlhf_pipeline.attention import ATTENTION_IMPLEMENTATIONS  # noqa: E402  (imports neither torch nor transformers)

# Our trainer's sides and the rlhf train options each runs with: float32 weights under autocast; bf16 weights with
# float32 masters (--bf16-weights); and those with each decoder layer compiled (--compile).
OURS: dict[str, dict[str, bool]] = {
    "ours": {},
    "ours_bf16": {"bf16_weights": True},
    "ours_compile": {"bf16_weights": True, "compile": True},
}
SIDES = (*OURS, "trl", "trl_precomputed")
FULL_ONLY = "bf16 weights are for full fine-tuning"  # why bf16-weights sides skip LoRA modes (rlhf train refuses it)
PROFILE_STEPS = 3  # --profile: steps run under the profiler after a side's timed ones
GPU_TOKEN_BUDGET = 8192  # ours on CUDA by default: --max-tokens-per-micro-batch
PAD, BOS, EOS, UNK = 0, 1, 2, 3
FIRST_ID = 4  # random ids avoid the special tokens
LR, BETA = 1e-6, 0.1

FULL_MODEL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048)
TINY_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=176, vocab_size=512, max_position_embeddings=1024)

# Dense bf16 tensor-core peaks (TFLOP/s), matched against torch.cuda.get_device_name, first match wins.
PEAK_TFLOPS = (("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("GH200", 989.0),
               ("A100", 312.0))


def parse_side(name: str) -> tuple[str, int | None]:
    """A side as ``--sides`` names it: one of :data:`SIDES`, and for our sides optionally ``@N``, its own micro-batch
    budget in tokens (``ours_compile@16384``; 0 = by pair count), so that one run compares budgets. ValueError when
    it is neither."""
    base, at, budget = name.partition("@")
    if base not in SIDES or (at and (base not in OURS or not budget.isdigit())):
        raise ValueError(f"{name}: a side is one of {', '.join(SIDES)}, our sides optionally with @TOKENS (their own "
                         "--max-tokens-per-micro-batch, e.g. ours_compile@16384)")
    return base, int(budget) if at else None


def side_budget(side: str, default: int | None) -> int | None:
    """The micro-batch budget ``side`` runs with: its own ``@N``, else ``default`` (None or 0: by pair count)."""
    own = parse_side(side)[1]
    return (own if own is not None else default) or None


# ----------------------------------------------------------------------------------------------------------------
# Setup (parent process): model, tokenizer, pairs


def build_model(path: Path, dims: dict[str, int], seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    config = LlamaConfig(**dims, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    # A tokenizer only for its special ids (TRL wants one); the data are ids already.
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": UNK}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                  pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(path)


def make_pairs(num_pairs: int, vocab: int, seed: int, prompt: tuple[int, int] = (16, 256),
               response: tuple[int, int] = (16, 512)) -> list[dict[str, list[int]]]:
    """Prompts of ``prompt`` tokens, responses of ``response`` tokens (inclusive bounds, uniform) ending in EOS."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(FIRST_ID, vocab, n).tolist()

    def response_ids() -> list[int]:
        return ids(int(rng.integers(response[0] - 1, response[1]))) + [EOS]

    return [{"prompt_token_ids": ids(int(rng.integers(prompt[0], prompt[1] + 1))),
             "chosen_token_ids": response_ids(), "rejected_token_ids": response_ids()} for _ in range(num_pairs)]


def bench_pairs(num_pairs: int, vocab: int, seed: int, tiny: bool) -> list[dict[str, list[int]]]:
    """The pairs the bench trains on (:func:`make_pairs` at the full or ``--tiny`` lengths)."""
    return make_pairs(num_pairs, vocab, seed, *(((8, 64), (8, 128)) if tiny else ((16, 256), (16, 512))))


def seq_lengths(pairs) -> list[int]:
    """Lengths of every pair's chosen and rejected sequence (prompt + response)."""
    out = []
    for p in pairs:
        out += [len(p["prompt_token_ids"]) + len(p["chosen_token_ids"]),
                len(p["prompt_token_ids"]) + len(p["rejected_token_ids"])]
    return out


def pair_lengths(pairs) -> list[int]:
    return [2 * len(p["prompt_token_ids"]) + len(p["chosen_token_ids"]) + len(p["rejected_token_ids"]) for p in pairs]


def step_order(spec: dict) -> list[list[list[int]]]:
    """Pair indices of every micro-batch of every step, as our trainer cuts them on one process
    (``training.loop.step_micro_batches``: ``--batch-size`` pairs each, or by ``--max-tokens-per-micro-batch``)."""
    from types import SimpleNamespace

    from rlhf_pipeline.training.loop import global_batches, step_micro_batches

    b, a = spec["batch_size"], spec["accumulation"]
    cut = SimpleNamespace(batch_size=b, gradient_accumulation_steps=a,
                          max_tokens_per_micro_batch=spec.get("max_tokens_per_micro_batch"))
    batches = global_batches(spec["num_pairs"], b * a, spec["seed"], 0)
    return [step_micro_batches(ids, spec["pair_lengths"], cut, 1, 0) for ids in batches[: spec["total_steps"]]]


# ----------------------------------------------------------------------------------------------------------------
# Workers (one side per process)


class Clock:
    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self._sync = torch.cuda.synchronize if self.cuda else (lambda: None)

    def __call__(self) -> float:
        self._sync()
        return time.perf_counter()


class StepProfiler:
    """``torch.profiler`` over the steps run inside it (``--profile``: :data:`PROFILE_STEPS` steps after a side's timed
    ones, so that the profiler's overhead touches no timing), CPU and CUDA activity. The trace is summarised by
    :func:`summarise_trace` into :attr:`summary` and, with ``--profile-trace``, kept gzipped."""

    def __init__(self, device, steps: int, trace: str | None = None):
        self.device, self.steps, self.trace, self.prof, self.summary = device, steps, trace, None, None

    def __enter__(self) -> "StepProfiler":
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof = tp.profile(activities=activities)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.prof.__exit__(*exc)
        if exc[0] is not None:
            return
        path = Path(tempfile.mkdtemp(prefix="bench_gpu_trace_")) / "trace.json"
        self.prof.export_chrome_trace(str(path))
        self.summary = summarise_trace(json.loads(path.read_text()), steps=self.steps)
        if self.trace:
            import gzip

            with open(path, "rb") as src, gzip.open(self.trace, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
        shutil.rmtree(path.parent, ignore_errors=True)


# Kernel families by name (first match wins), for the profile's breakdown.
KERNEL_FAMILIES = (
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma", "sm90")),
    ("softmax / logsumexp / reductions", ("softmax", "logsumexp", "reduce", "norm")),
    ("copies and casts", ("copy", "cast", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "index", "gather", "scatter")),
)

# CUDA runtime calls that make the host wait for the device.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def summarise_trace(trace: dict, steps: int) -> dict[str, Any]:
    """What a chrome trace of ``steps`` training steps says: GPU busy time against wall time, the kernels that take
    it (top 25 by time, and by family), the idle gaps between kernels, and the host's waits on the device."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = sorted(((e["ts"], e["dur"], e["name"]) for e in events
                      if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda k: k[0])
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")]
    out: dict[str, Any] = {"steps": steps, "kernels": len(kernels)}
    if cpu_ops:
        start = min(e["ts"] for e in cpu_ops + [{"ts": k[0]} for k in kernels])
        end = max(e["ts"] + e["dur"] for e in cpu_ops + [{"ts": k[0], "dur": k[1]} for k in kernels])
        out["wall_ms"] = (end - start) / 1e3
    busy, gaps, last_end, last_name = 0.0, [], None, None
    for ts, dur, name in kernels:
        if last_end is not None and ts > last_end:
            gaps.append((ts - last_end, last_name, name))
        busy += max(0.0, ts + dur - max(ts, last_end or ts))
        if last_end is None or ts + dur > last_end:
            last_end, last_name = ts + dur, name
    out["gpu_busy_ms"] = busy / 1e3
    if out.get("wall_ms"):
        out["gpu_busy_fraction"] = busy / 1e3 / out["wall_ms"]
    by_name: dict[str, list[float]] = {}
    for _, dur, name in kernels:
        by_name.setdefault(name, []).append(dur)
    total = sum(d for _, d, _ in kernels) or 1.0
    out["top_kernels"] = [
        {"name": name[:160], "calls": len(d), "total_ms": round(sum(d) / 1e3, 3), "share": round(sum(d) / total, 4),
         "mean_us": round(sum(d) / len(d), 1)}
        for name, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    ]
    families: dict[str, float] = {}
    for name, d in by_name.items():
        low = name.lower()
        family = next((f for f, keys in KERNEL_FAMILIES if any(k in low for k in keys)), "other")
        families[family] = families.get(family, 0.0) + sum(d)
    out["families_ms"] = {f: round(v / 1e3, 3) for f, v in sorted(families.items(), key=lambda kv: -kv[1])}
    gaps.sort(key=lambda g: -g[0])
    out["gaps"] = {
        "count_over_20us": sum(1 for g in gaps if g[0] > 20),
        "ms_over_20us": round(sum(g[0] for g in gaps if g[0] > 20) / 1e3, 3),
        "ms_total": round(sum(g[0] for g in gaps) / 1e3, 3),
        "largest": [{"us": round(g[0], 1), "after": (g[1] or "")[:100], "before": g[2][:100]} for g in gaps[:12]],
    }
    out["host_top_self_ms"] = host_self_times(events)
    waits: dict[str, list[float]] = {}
    for e in cpu_ops:
        if any(e["name"].startswith(c) for c in SYNC_CALLS) or e["name"] in ("aten::item", "aten::_local_scalar_dense"):
            waits.setdefault(e["name"], []).append(e["dur"])
    out["host_waits"] = {k: {"calls": len(v), "ms": round(sum(v) / 1e3, 3)} for k, v in sorted(waits.items())}
    return out


def host_self_times(events: list[dict], top: int = 15) -> list[dict[str, Any]]:
    """The host's time per operator, without the operators it called (its self time), summed over the trace: where
    the CPU spends a step while the GPU waits for its next kernel."""
    threads: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    own: dict[str, list[float]] = {}
    for ops in threads.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, self time]
        for e in ops:
            while stack and stack[-1][0] <= e["ts"]:
                end, name, mine = stack.pop()
                own.setdefault(name, []).append(mine)
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], e["dur"]])
        for _, name, mine in stack:
            own.setdefault(name, []).append(mine)
    ranked = sorted(own.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"op": name[:100], "calls": len(v), "ms": round(sum(v) / 1e3, 2)} for name, v in ranked]


def run_ours(spec: dict, mode: dict, pairs: list[dict], device, clock: Clock, bf16_weights: bool = False,
             compile: bool = False) -> dict[str, Any]:
    import contextlib
    from dataclasses import dataclass

    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.losses import PairLossParams
    from rlhf_pipeline.training.lora import LoraOptions
    from rlhf_pipeline.algorithms.pairs import pair_logps
    from rlhf_pipeline.algorithms.pairs import PairTask
    from rlhf_pipeline.modeling import SAFE_WEIGHTS
    from rlhf_pipeline.distributed import sharded_batches
    from rlhf_pipeline.training.compilation import compile_decoder_layers
    from rlhf_pipeline.training.loop import add_to_sums, load_trainable, micro_batch_weight, warmup_cosine
    from rlhf_pipeline.training.master_weights import MasterWeights

    @dataclass(kw_only=True)
    class LoadOptions(LoraOptions):
        """What ``training.loop.load_trainable`` reads of ``rlhf train``'s options (LoRA's through ``LoraOptions``)."""

        model: str
        seed: int
        trust_remote_code: bool = False
        gradient_checkpointing: bool = False
        attn_implementation: str = "sdpa"

    amp = spec["precision"] == "amp" or bf16_weights  # rlhf train takes --bf16-weights only with --bf16

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()

    t0 = clock()
    # As rlhf train loads its model: seeded, float32, dropout off, checkpointing as asked, then the adapters
    # (lora.add_adapters: peft's all-linear, the model frozen) when mode asks for LoRA; the trainer's accelerator
    # moves it to the device afterwards, as here.
    options = LoadOptions(model=spec["model_dir"], seed=spec["seed"], lora_rank=mode["lora_rank"],
                          lora_alpha=mode["lora_alpha"], gradient_checkpointing=spec["gradient_checkpointing"],
                          attn_implementation=spec["attn"])
    options.check_lora()
    # in float32: load_trainable asks for it, whatever the checkpoint holds
    model = load_trainable(options, lambda path, **kw: AutoModelForCausalLM.from_pretrained(path, **kw, **SAFE_WEIGHTS))
    model = model.to(device)
    # rlhf train --bf16-weights: the model in bf16, the optimizer on float32 masters (training.master_weights)
    masters = MasterWeights(model) if bf16_weights else None
    trainable = masters.masters if masters else [p for p in model.parameters() if p.requires_grad]
    if compile:  # rlhf train --compile: after the cast, as training.loop.prepare does
        compile_decoder_layers(model)
    t_loaded = clock()

    # Reference log-probs: one batched no-grad pass, length-sorted (as pairs.compute_ref_logps).
    model.eval()
    with torch.no_grad():
        for idx in sharded_batches(spec["pair_lengths"], spec["ref_batch_size"], 1, 0):
            rows = [pairs[i] for i in idx]
            with autocast():
                chosen, rejected, _ = pair_logps(model, rows, PAD, 1.0, spec["pack_ratio"])
            for i, c, r in zip(idx, chosen.tolist(), rejected.tolist()):
                pairs[i]["chosen_ref_logp"], pairs[i]["rejected_ref_logp"] = c, r
    model.train()
    t_ref = clock()

    total, accumulation = spec["total_steps"], spec["accumulation"]
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **fused)
    warmup = int(0.1 * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, total))
    task = PairTask("dpo", PairLossParams(beta=BETA), temperature=1.0, pad_id=PAD,
                    pack_ratio=spec["pack_ratio"])

    def train_step(micro: list[list[int]]) -> tuple[float, float, dict[str, int]]:
        """One optimizer step over ``micro``; its loss, gradient norm and token counts."""
        sums: dict[str, Any] = {}
        real = sq = positions = 0
        for ids in micro:
            rows = [pairs[i] for i in ids]
            with autocast():
                loss, metrics, (n_real, n_total) = task.loss(model, rows)
            # weighted by its pairs (1 when cut by count) and divided by the accumulation steps, as the trainer does
            (loss * micro_batch_weight(len(ids), spec["batch_size"]) / accumulation).backward()
            add_to_sums(sums, loss, metrics, len(ids))  # on the device, read once per step, as the trainer does
            lens = seq_lengths(rows)
            real, sq, positions = real + n_real, sq + sum(t * t for t in lens), positions + n_total
        norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        if masters:
            masters.write_back()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum, norm = torch.stack([sums["loss"].float(), norm.float()]).tolist()  # the step's one read
        return loss_sum / sums["_n"], norm, {"real": real, "sq": sq, "positions": positions}

    from torch._dynamo.utils import counters  # what Dynamo has compiled (--compile)

    step_ends, stats, losses, grad_norms = [], [], [], []
    order = step_order(spec)
    for step, micro in enumerate(order):
        if step == spec["warmup"]:
            graphs_before_window = counters["stats"]["unique_graphs"]
        loss, norm, counts = train_step(micro)
        losses.append(loss)
        grad_norms.append(norm)
        stats.append(counts)
        step_ends.append(clock())
    # a compilation inside the steps window would be timed as a step: say so
    compiled = {"before_window": graphs_before_window,
                "in_window": counters["stats"]["unique_graphs"] - graphs_before_window,
                # frames Dynamo gave up on (a recompile limit, an error), which then ran eager
                "frames_fell_back": counters["frames"]["total"] - counters["frames"]["ok"]} if compile else None
    profile, trace = None, spec.get("profile_trace")
    if spec["side"] in spec["profile_sides"]:  # more steps, untimed, on the first steps' micro-batches
        if trace:  # one file per side, mode and round where there are several
            run = spec["side"] + ("" if mode["name"] == "full" else f"_{mode['name']}")
            tags = ([run] if len(spec["profile_sides"]) > 1 or len(spec["modes"]) > 1 else []) + (
                [f"round{spec['round'] + 1}"] if spec["rounds"] > 1 else [])
            trace = str(Path(trace).with_name(".".join([*tags, Path(trace).name])))
        with StepProfiler(device, len(order[:PROFILE_STEPS]), trace) as profiler:
            for micro in order[:PROFILE_STEPS]:
                train_step(micro)
        profile = profiler.summary
    return {"t0": t0, "seconds_setup": t_loaded - t0, "seconds_ref": t_ref - t_loaded, "step_ends": step_ends,
            "step_stats": stats, "first_loss": losses[0], "first_grad_norm": grad_norms[0],
            "trainable_params": sum(p.numel() for p in trainable), "profile": profile, "compiled_graphs": compiled}


def teach_dill_pyarrow_types() -> None:
    """Let ``datasets``' fingerprint hashing pickle pyarrow's struct-sequence types (``pyarrow.lib.MonthDayNano``).

    On Python 3.12 such a type reports ``__module__ == "builtins"`` and cannot be found there, so pickling the class
    object raises ``PicklingError: Can't pickle <class 'MonthDayNano'>: it's not found as builtins.MonthDayNano``
    (``python -c "import datasets.fingerprint as f, pyarrow as pa; f.Hasher.hash(pa.MonthDayNano)"`` alone fails
    with datasets 5.2, dill 0.4.1, pyarrow 24-26). TRL's DPOTrainer reached it on a GPU machine's Python 3.12.3
    image. dill pickles the types in its ``_typemap`` by name through ``_load_type``; registering each such pyarrow
    type there under its real qualified name gives a stable hash, which is all fingerprinting needs. The type is
    immutable, so its ``__module__`` cannot be corrected instead."""
    import builtins

    import pyarrow.lib

    try:
        import dill._dill as dill_internals
    except ImportError:
        return
    for name in dir(pyarrow.lib):
        obj = getattr(pyarrow.lib, name)
        if isinstance(obj, type) and obj.__module__ == "builtins" and not hasattr(builtins, obj.__name__):
            key = f"pyarrow.lib.{obj.__qualname__}"
            dill_internals._reverse_typemap.setdefault(key, obj)
            dill_internals._typemap.setdefault(obj, key)


def run_trl(spec: dict, mode: dict, pairs: list[dict], device, clock: Clock, precompute: bool) -> dict[str, Any]:
    import dataclasses

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    records: list[tuple[int, Any, int]] = []  # (global step at the call, sequence lengths on device, positions)
    ref_seconds = [0.0]

    class IdsDPOTrainer(DPOTrainer):
        """The data arrive as token ids (prompt_ids / chosen_ids / rejected_ids): skip tokenization."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

        def _precompute_ref_logps(self, dataset, name, batch_size):
            t = clock()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            ref_seconds[0] += clock() - t
            return out

        def _get_train_sampler(self, *args, **kwargs):
            if spec["trl_order"] != "ours":
                return super()._get_train_sampler(*args, **kwargs)
            from torch.utils.data import SequentialSampler

            dataset = args[0] if args else kwargs.get("train_dataset")
            return SequentialSampler(dataset if dataset is not None else self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # Lengths stay on the device (no sync); read after training.
            records.append((self.state.global_step, inputs["attention_mask"].sum(1), inputs["input_ids"].numel()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(clock())

    if spec["trl_order"] == "ours":  # read sequentially (the sampler above): our micro-batches, in our order
        order = [i for micro in step_order(spec) for ids in micro for i in ids]
    else:
        order = list(range(spec["num_pairs"]))
    ds = Dataset.from_dict({
        "prompt_ids": [pairs[i]["prompt_token_ids"] for i in order],
        "chosen_ids": [pairs[i]["chosen_token_ids"] for i in order],
        "rejected_ids": [pairs[i]["rejected_token_ids"] for i in order],
    })
    cpu = device.type == "cpu"
    kwargs = dict(
        output_dir=str(Path(spec["workdir"]) / f"trl_out_{'pre' if precompute else 'default'}_{mode['name']}"),
        per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=spec["accumulation"],
        max_steps=spec["total_steps"], num_train_epochs=1, learning_rate=LR, beta=BETA, lr_scheduler_type="cosine",
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch" if cpu else "adamw_torch_fused",
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=spec["seed"],
        use_cpu=cpu, bf16=spec["precision"] == "amp", gradient_checkpointing=spec["gradient_checkpointing"],
        precompute_ref_log_probs=precompute, precompute_ref_batch_size=spec["ref_batch_size"], max_length=None,
        dataloader_num_workers=0, model_init_kwargs={"dtype": "float32", "attn_implementation": spec["trl_attn"]},
    )
    fields = {f.name for f in dataclasses.fields(DPOConfig)}
    # transformers 5 dropped warmup_ratio: a warmup_steps below 1 is the ratio
    kwargs["warmup_ratio" if "warmup_ratio" in fields else "warmup_steps"] = 0.1
    dropped = sorted(k for k in kwargs if k not in fields)
    if dropped:  # another TRL / transformers version than the one this was written against (trl 1.16, transformers 5)
        print(f"[bench_gpu] this DPOConfig has no {', '.join(dropped)}; left at its default", file=sys.stderr)
    args = DPOConfig(**{k: v for k, v in kwargs.items() if k in fields})
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    peft_config = None
    if mode["lora_rank"]:  # our LoraOptions' peft config: every linear layer but the LM head, no dropout
        import peft

        peft_config = peft.LoraConfig(r=mode["lora_rank"], lora_alpha=mode["lora_alpha"], lora_dropout=0.0,
                                      target_modules="all-linear", bias="none", task_type="CAUSAL_LM")
    t0 = clock()
    trainer = IdsDPOTrainer(model=spec["model_dir"], args=args, train_dataset=ds, processing_class=tokenizer,
                            callbacks=[StepClock()], peft_config=peft_config)
    t_init = clock()
    if mode["lora_rank"] and trainer.ref_model is not None:
        raise RuntimeError("TRL with a peft_config loaded a reference model; expected the adapter-disabled policy")
    trainer.train()
    if len(step_ends) != spec["total_steps"]:
        raise RuntimeError(f"TRL ran {len(step_ends)} steps, expected {spec['total_steps']}")
    model_device = next(trainer.model.parameters()).device
    if model_device.type != device.type:
        raise RuntimeError(f"TRL trained on {model_device}, expected {device}")

    stats = [{"real": 0, "sq": 0, "positions": 0} for _ in range(spec["total_steps"])]
    for step, lens, positions in records:
        lens = lens.long().cpu()
        s = stats[step]
        s["real"] += int(lens.sum())
        s["sq"] += int((lens * lens).sum())
        s["positions"] += positions
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return {"t0": t0, "seconds_setup": t_init - t0 - ref_seconds[0], "seconds_ref": ref_seconds[0],
            "step_ends": step_ends, "step_stats": stats, "first_loss": logs[0]["loss"],
            "first_grad_norm": logs[0].get("grad_norm"),
            "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}


def worker(side: str, mode_name: str, spec_path: str, round_index: int = 0) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (imports are not timed: the
    # model classes are imported lazily, on first use, so import them here for both sides)

    import rlhf_pipeline.stages.train  # noqa: F401

    spec = json.loads(Path(spec_path).read_text())
    mode = spec["modes"][mode_name]
    pairs = json.loads(Path(spec["pairs_path"]).read_text())
    if mode["lora_rank"]:
        import peft  # noqa: F401
    base = parse_side(side)[0]
    spec["max_tokens_per_micro_batch"] = side_budget(side, spec["max_tokens_per_micro_batch"])
    if base not in OURS:
        import datasets  # noqa: F401
        import trl  # noqa: F401

        teach_dill_pyarrow_types()
        if spec["trl_cudnn_sdpa"] == "off":  # as our log-prob passes run sdpa (rlhf_pipeline.attention.sdpa_backends)
            torch.backends.cuda.enable_cudnn_sdp(False)
    device = torch.device(spec["device"])
    if device.type == "cuda":  # the parent made exactly one GPU visible (TRL refuses several: nn.DataParallel)
        torch.zeros(1, device=device)  # CUDA context outside the timing
        torch.cuda.reset_peak_memory_stats(device)
    clock = Clock(device)
    spec["side"], spec["round"] = side, round_index
    if base in OURS:
        out = run_ours(spec, mode, pairs, device, clock, **OURS[base])
        out["max_tokens_per_micro_batch"] = spec["max_tokens_per_micro_batch"]
    else:
        out = run_trl(spec, mode, pairs, device, clock, precompute=base == "trl_precomputed")
    out["side"], out["mode"] = side, mode_name
    if device.type == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Parent: spawn, compute FLOPs and MFU, report


def spawn(side: str, mode: str, spec_path: Path, timeout: float | None, visible_gpu: str | None,
          cpu_threads: int | None, round_index: int = 0) -> dict[str, Any]:
    env = {**os.environ, "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if visible_gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_gpu
    if cpu_threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(cpu_threads)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--worker-mode", mode,
           "--worker-round", str(round_index), "--spec", str(spec_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-4000:]
        return {"error": f"exit {proc.returncode}", "stderr_tail": tail}
    return json.loads(lines[-1][len("RESULT "):])


def flops(lengths_sum: int, sq_sum: int, n: int, layers: int, hidden: int, train: bool, lora_params: int = 0) -> float:
    """PaLM model FLOPs of sequences with Σ T = lengths_sum and Σ T² = sq_sum (see the module docstring). A LoRA
    training step (``lora_params`` > 0: the adapters' parameter count) does no weight gradients of the frozen N:
    4N + 6·lora_params per token instead of 6N; the attention term is the same."""
    if not train:
        per_token = 2 * n
    elif lora_params:
        per_token = 4 * n + 6 * lora_params
    else:
        per_token = 6 * n
    return per_token * lengths_sum + (12 if train else 4) * layers * hidden * sq_sum


def lora_param_count(config, rank: int) -> int:
    """Parameters of the rank-``rank`` adapters ``rlhf_pipeline.training.lora.add_adapters`` puts on a model of ``config``
    (built on the meta device: nothing is allocated): Σ rank · (in + out) over the adapted linear layers."""
    import torch
    import transformers

    from rlhf_pipeline.training.lora import LoraOptions, add_adapters

    with torch.device("meta"):
        model = add_adapters(transformers.AutoModelForCausalLM.from_config(config), LoraOptions(lora_rank=rank))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def summarise(raw: dict, spec: dict, peak_flops: float | None) -> dict[str, Any]:
    n, layers, hidden = spec["flops_params"], spec["model"]["num_hidden_layers"], spec["model"]["hidden_size"]
    mode = spec["modes"][raw["mode"]]
    lora = mode["lora_params"]
    warmup, stats, ends = spec["warmup"], raw["step_stats"], raw["step_ends"]
    window = stats[warmup:]
    w_real = sum(s["real"] for s in window)
    w_sq = sum(s["sq"] for s in window)
    w_seconds = ends[-1] - ends[warmup - 1]
    w_train = flops(w_real, w_sq, n, layers, hidden, True, lora)
    w_ref = flops(w_real, w_sq, n, layers, hidden, False) if raw["side"] == "trl" else 0.0
    run_seconds = ends[-1] - raw["t0"]
    all_real = sum(s["real"] for s in stats)
    all_sq = sum(s["sq"] for s in stats)
    run_flops = (flops(all_real, all_sq, n, layers, hidden, True, lora)
                 + flops(all_real, all_sq, n, layers, hidden, False))
    step_seconds = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]

    def mfu(f: float, s: float) -> float | None:
        return f / s / peak_flops if peak_flops else None

    # each timed step's own MFU: the window's figure hides whether its first steps were still warming up
    step_mfu = [mfu(flops(st["real"], st["sq"], n, layers, hidden, True, lora), dt)
                for st, dt in zip(window, step_seconds)]

    out = {
        "side": raw["side"], "mode": raw["mode"], "lora_rank": mode["lora_rank"], "lora_alpha": mode["lora_alpha"],
        "trainable_params": raw["trainable_params"],
        "seconds_steps": w_seconds, "steps_timed": len(window), "median_step_seconds": statistics.median(step_seconds),
        "real_tokens_steps": w_real, "tokens_per_s_steps": w_real / w_seconds,
        "seconds_run": run_seconds, "seconds_setup": raw["seconds_setup"], "seconds_ref": raw["seconds_ref"],
        "seconds_all_steps": ends[-1] - (raw["t0"] + raw["seconds_setup"] + raw["seconds_ref"]),
        "real_tokens_run": all_real, "tokens_per_s_run": all_real / run_seconds,
        "real_token_fraction": all_real / max(1, sum(s["positions"] for s in stats)),
        "train_tflops_per_s_steps": w_train / w_seconds / 1e12,
        "mfu_steps": mfu(w_train, w_seconds), "mfu_steps_with_ref": mfu(w_train + w_ref, w_seconds),
        "mfu_run": mfu(run_flops, run_seconds),
        "peak_memory_gib": raw["peak_memory_bytes"] / 2**30 if "peak_memory_bytes" in raw else None,
        "peak_reserved_gib": raw["peak_reserved_bytes"] / 2**30 if "peak_reserved_bytes" in raw else None,
        "peak_rss_gib": raw["peak_rss_bytes"] / 2**30,
        "first_loss": raw["first_loss"], "first_grad_norm": raw["first_grad_norm"],
        "step_seconds": [round(s, 4) for s in step_seconds],
        "step_mfu": None if peak_flops is None else [round(m, 4) for m in step_mfu],
    }
    for key in ("max_tokens_per_micro_batch", "compiled_graphs", "profile"):
        if raw.get(key):
            out[key] = raw[key]
    return out


def step_mfu_of_report(report: dict[str, Any]) -> dict[str, list[float]]:
    """Each side's ``step_mfu`` recomputed from a report's config and ``step_seconds``, for reports written before
    they carried it: the pairs are made again from the config's seed, and each step's FLOPs counted from its pairs,
    which are the same on every side with ``--trl-order ours`` (the micro-batch cut does not change a step's pairs)."""
    from rlhf_pipeline.training.loop import global_batches

    c = report["config"]
    if not c.get("peak_tflops_bf16"):
        raise SystemExit("the report has no peak TFLOP/s (a CPU run without --peak-tflops): no MFU to recompute")
    if c.get("trl_order", "ours") != "ours":
        raise SystemExit("the report ran --trl-order random: TRL's steps held other pairs than the config's order")
    pairs = bench_pairs(c["num_pairs"], c["model"]["vocab_size"], c["seed"], c["tiny"])
    steps = global_batches(c["num_pairs"], c["batch_size"] * c["accumulation"], c["seed"], 0)[: c["total_steps"]]
    window = [seq_lengths([pairs[i] for i in ids]) for ids in steps[c["warmup"]:]]
    # the pairs made again must be the run's (another numpy or another make_pairs would make others)
    if sum(pair_lengths(pairs)) != c["real_tokens_all_pairs"]:
        raise SystemExit(f"the pairs made again hold {sum(pair_lengths(pairs)):,} real tokens, the run's "
                         f"{c['real_tokens_all_pairs']:,}: this bench_gpu.py cannot make that run's pairs again")
    layers, hidden, peak = c["model"]["num_hidden_layers"], c["model"]["hidden_size"], c["peak_tflops_bf16"] * 1e12
    out = {}
    for name, side in report["sides"].items():
        if side.get("pending") or "step_seconds" not in side:
            continue
        if sum(map(sum, window)) != side["real_tokens_steps"]:
            raise SystemExit(f"{name}: its timed steps held {side['real_tokens_steps']:,} real tokens, the steps made "
                             f"again {sum(map(sum, window)):,}")
        lora = c["modes"][side["mode"]]["lora_params"]
        out[name] = [round(flops(sum(ls), sum(t * t for t in ls), c["flops_params"], layers, hidden, True, lora)
                           / dt / peak, 4) for ls, dt in zip(window, side["step_seconds"])]
    return out


def count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def table(sides: dict[str, dict], mem_key: str) -> str:
    head = ("| run | trained params | steps s | tok/s (steps) | MFU steps | MFU steps+ref | run s (setup / ref) | tok/s (run) | "
            "MFU run | real-token frac | peak mem GiB | step-1 loss | step-1 grad norm |")
    columns = head.count("|") - 1
    lines = [head, "|" + "---|" * columns]
    for side, s in sides.items():
        if "skipped" in s or "error" in s or s.get("pending"):
            why = (f"skipped: {s['skipped']}" if "skipped" in s else f"FAILED: {s['error']}" if "error" in s
                   else "not run (--deadline)")
            lines.append(f"| {side} | {why} |" + " |" * (columns - 2))
            continue
        pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        lines.append(
            f"| {side} | {count(s['trainable_params'])} | {s['seconds_steps']:.2f} | {s['tokens_per_s_steps']:,.0f} | {pct(s['mfu_steps'])} | "
            f"{pct(s['mfu_steps_with_ref'])} | {s['seconds_run']:.2f} ({s['seconds_setup']:.2f} / "
            f"{s['seconds_ref']:.2f}) | {s['tokens_per_s_run']:,.0f} | {pct(s['mfu_run'])} | "
            f"{s['real_token_fraction']:.3f} | {fmt(s[mem_key], '.2f')} | {s['first_loss']:.6f} | "
            f"{fmt(s['first_grad_norm'], '.5f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available, else cpu)")
    p.add_argument("--tiny", action="store_true",
                   help="hidden 64, 2 layers, vocab 512, few short pairs, float32 (a smoke test)")
    p.add_argument("--sides", default=",".join(SIDES),
                   help=f"comma-separated subset of {','.join(SIDES)}; our sides may carry their own micro-batch "
                        "budget, ours_compile@16384 (tokens; 0 = by pair count), and appear more than once that way")
    p.add_argument("--lora-rank", default="0",
                   help="comma-separated modes by LoRA rank, each run on every side: 0 = full fine-tuning, R = rank-R "
                        "adapters on every linear layer but the LM head (e.g. 0,16: full and LoRA side by side)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale alpha (default: 2 x each rank)")
    p.add_argument("--batch-size", type=int, default=None, help="pairs per micro-batch (default 4; tiny 2)")
    p.add_argument("--accumulation", type=int, default=None, help="micro-batches per step (default 4; tiny 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps after the warmup (default 20; tiny 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before the steps window (>= 1; default 4, tiny 2: a compiled side settles over "
                        "its first steps; each side's step_mfu shows every timed step)")
    p.add_argument("--ref-batch-size", type=int, default=8,
                   help="pairs per reference forward (ours; TRL's precompute_ref_batch_size)")
    p.add_argument("--pack-ratio", type=float, default=2.0,
                   help="ours: pack ratio (0 = pad; no effect with --attn varlen or flash_attention_2)")
    p.add_argument("--attn", default=None, choices=ATTENTION_IMPLEMENTATIONS,
                   help="ours: --attn-implementation (default: varlen on CUDA, sdpa elsewhere)")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                   help=f"ours: cut each step's pairs into micro-batches of up to this many tokens (rlhf train's "
                        f"option; default {GPU_TOKEN_BUDGET} on CUDA, 0 = by --batch-size; by --batch-size on a CPU)")
    p.add_argument("--trl-attn", default="sdpa", choices=("sdpa", "flash_attention_2", "eager"),
                   help="TRL sides: attn_implementation (flash_attention_2 needs flash-attn)")
    p.add_argument("--trl-cudnn-sdpa", choices=("off", "on"), default="off",
                   help="TRL sides: cuDNN's SDPA backend (off: as our log-prob passes run sdpa; on: PyTorch's default)")
    p.add_argument("--precision", choices=("amp", "fp32"), default=None,
                   help="amp = float32 master weights + bf16 autocast (TRL's bf16=True; default on CUDA); "
                        "fp32 = no autocast (default on CPU)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="on both sides (TRL's default is on)")
    p.add_argument("--trl-order", choices=("ours", "random"), default="ours",
                   help="ours: TRL reads the pairs in our micro-batch order (same pairs per micro-batch); "
                        "random: TRL's default shuffled sampler")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the device, TFLOP/s")
    p.add_argument("--rounds", type=int, default=1, help="repeat every side, alternating; the median run is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where the model and pairs go (default: a temporary directory)")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads per side on a CPU (default 1 with --device cpu --tiny: a tiny model gains "
                        "nothing from more and timings on a shared machine are steadier; else torch's default)")
    p.add_argument("--worker-timeout", type=float, default=None, help="seconds per side run")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds from the start after which no side starts and a running one is stopped (a lease's "
                        "end): the report keeps every side that finished, marks those never run pending and counts "
                        "the runs not started (later --rounds too) in runs_pending; the exit status is then 1, also "
                        "when only a later round was cut")
    p.add_argument("--profile", action="store_true",
                   help=f"our sides: after the timed steps, run {PROFILE_STEPS} more under torch.profiler and add its "
                        "summary (GPU busy fraction, top kernels, kernel families, gaps, host waits) to the side's "
                        "output; no timing includes the profiler")
    p.add_argument("--profile-sides", default=None,
                   help="with --profile: which of our sides to profile (default: every one that runs)")
    p.add_argument("--profile-trace", default=None,
                   help="with --profile: also keep the chrome trace here (gzipped); with several sides or modes "
                        "profiled, one file per side and mode, its run name before this file name, and with --rounds "
                        "one per round (roundN.)")
    p.add_argument("--output", default="gpu_bench.json")
    p.add_argument("--step-mfu", metavar="REPORT", default=None,
                   help="run nothing: print each side's MFU step by step (step_mfu) recomputed from an earlier "
                        "report's config and step times, for reports written before they carried it")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-mode", help=argparse.SUPPRESS)
    p.add_argument("--worker-round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.worker_mode, a.spec, a.worker_round)
        return 0
    if a.step_mfu:
        print(json.dumps(step_mfu_of_report(json.loads(Path(a.step_mfu).read_text())), indent=1))
        return 0
    started = time.perf_counter()
    if a.deadline is not None and a.deadline <= 0:
        raise SystemExit(f"--deadline {a.deadline:g}: no time left to run a side")

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU; pass --device cpu (with --tiny for a smoke test)")
    on_cuda = device.startswith("cuda")
    visible_gpu = None
    if on_cuda:  # each worker sees exactly this GPU, as cuda:0
        index = torch.device(device).index or 0
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        visible_gpu = visible[index] if visible else str(index)
        # Asked in a child process, so this one never holds a CUDA context while the sides run.
        device_name = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"], capture_output=True,
            text=True, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": visible_gpu},
        ).stdout.strip()
        device = "cuda:0"
    else:
        device_name = "cpu"
    precision = a.precision or ("amp" if on_cuda else "fp32")
    if precision == "amp" and not on_cuda:
        print("[bench_gpu] note: bf16 autocast on a CPU is slow and not what TRL's use_cpu runs; using it anyway")
    attn = a.attn or ("varlen" if on_cuda else "sdpa")
    budget = a.max_tokens_per_micro_batch if a.max_tokens_per_micro_batch is not None else (
        GPU_TOKEN_BUDGET if on_cuda else 0)
    if budget < 0:
        raise SystemExit("--max-tokens-per-micro-batch must be >= 0 (0 = by --batch-size)")
    cut = f"up to {budget} tokens" if budget else f"{a.batch_size or (2 if a.tiny else 4)} pairs"
    if "flash_attention_2" in (attn, a.trl_attn) and importlib.util.find_spec("flash_attn") is None:
        raise SystemExit("--attn/--trl-attn flash_attention_2 needs the flash-attn package (pip install flash-attn)")
    a.warmup = a.warmup if a.warmup is not None else (2 if a.tiny else 4)
    if a.warmup < 1:
        raise SystemExit("--warmup must be at least 1 (the steps window starts at the end of a step)")
    batch_size = a.batch_size or (2 if a.tiny else 4)
    accumulation = a.accumulation or (2 if a.tiny else 4)
    steps = a.steps or (2 if a.tiny else 20)
    total_steps = a.warmup + steps
    num_pairs = batch_size * accumulation * total_steps
    dims = TINY_MODEL if a.tiny else FULL_MODEL
    cpu_threads = a.cpu_threads or (1 if a.tiny and not on_cuda else None)

    sides = list(dict.fromkeys(s.strip() for s in a.sides.split(",") if s.strip()))
    try:
        base_of = {s: parse_side(s)[0] for s in sides}
    except ValueError as e:
        raise SystemExit(f"--sides: {e}")
    ours_sides = [s for s in sides if base_of[s] in OURS]
    if (a.profile_sides is not None or a.profile_trace) and not a.profile:
        raise SystemExit("--profile-sides and --profile-trace go with --profile")
    profile_sides = [] if not a.profile else ours_sides if a.profile_sides is None else [
        s.strip() for s in a.profile_sides.split(",") if s.strip()]
    if any(s not in ours_sides for s in profile_sides):
        raise SystemExit(f"--profile-sides {a.profile_sides}: name our sides that run ({', '.join(ours_sides)})")
    try:
        ranks = [int(r) for r in a.lora_rank.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"--lora-rank {a.lora_rank}: give comma-separated integers (0 = full fine-tuning), e.g. 0,16")
    if not ranks or min(ranks) < 0 or len(set(ranks)) != len(ranks):
        raise SystemExit(f"--lora-rank {a.lora_rank}: give distinct ranks >= 0 (0 = full fine-tuning), e.g. 0,16")
    if a.lora_alpha is not None and (a.lora_alpha <= 0 or ranks == [0]):
        raise SystemExit("--lora-alpha must be > 0 and needs a LoRA rank (--lora-rank R or 0,R)")
    if any(ranks) and importlib.util.find_spec("peft") is None:
        raise SystemExit("--lora-rank R needs peft: pip install peft (or this project's [lora] extra)")
    trl_missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    skipped: dict[str, str] = {}
    if trl_missing:
        reason = (f"{' and '.join(trl_missing)} not installed (TRL's DPOTrainer imports datasets); "
                  "pip install trl datasets to compare")
        for s in sides:
            if s not in ours_sides:
                skipped[s] = reason
        print(f"[bench_gpu] TRL sides skipped: {reason}")

    peak_tflops, peak_source = a.peak_tflops, "--peak-tflops"
    if peak_tflops is None and on_cuda:
        for key, value in PEAK_TFLOPS:
            if key.lower() in device_name.lower():
                peak_tflops, peak_source = value, f"default for '{key}' in the device name"
                break
    if peak_tflops is None:
        peak_source = "none (pass --peak-tflops for MFU)"
    print(f"[bench_gpu] device {device_name}; peak {fmt(peak_tflops, 'g')} TFLOP/s bf16 ({peak_source})")

    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "model"
    t = time.perf_counter()
    build_model(model_dir, dims, a.seed)
    pairs = bench_pairs(num_pairs, dims["vocab_size"], a.seed, a.tiny)
    (workdir / "pairs.json").write_text(json.dumps(pairs))
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    total_params = sum(x.numel() for x in meta.parameters())
    tied = meta.get_output_embeddings().weight is meta.get_input_embeddings().weight
    flops_params = total_params - (0 if tied else meta.get_input_embeddings().weight.numel())  # the LM head stays
    del meta
    modes = {}
    for r in ranks:
        name = f"lora{r}" if r else "full"
        modes[name] = {"name": name, "lora_rank": r, "lora_alpha": (a.lora_alpha or 2.0 * r) if r else None,
                       "lora_params": lora_param_count(config, r) if r else 0}
    real_tokens = sum(pair_lengths(pairs))
    print(f"[bench_gpu] Llama {dims['num_hidden_layers']} layers x {dims['hidden_size']}, vocab {dims['vocab_size']}: "
          f"{count(total_params)} params ({count(flops_params)} in matmuls); {num_pairs} pairs, "
          f"{real_tokens:,} real tokens; global batch {batch_size} x {accumulation}, {a.warmup} warmup + {steps} "
          f"timed steps; {precision}, ours attn {attn}, micro-batches of {cut}; TRL attn {a.trl_attn}; "
          + ", ".join(m if not v["lora_rank"] else f"{m} (alpha {v['lora_alpha']:g}, {count(v['lora_params'])} "
                      "adapter params)" for m, v in modes.items())
          + f"; setup {time.perf_counter() - t:.1f} s")

    spec = {
        "device": device, "model_dir": str(model_dir), "pairs_path": str(workdir / "pairs.json"),
        "workdir": str(workdir), "model": dims, "num_pairs": num_pairs, "pair_lengths": pair_lengths(pairs),
        "batch_size": batch_size, "accumulation": accumulation, "warmup": a.warmup, "steps": steps,
        "total_steps": total_steps, "ref_batch_size": a.ref_batch_size, "pack_ratio": a.pack_ratio,
        "attn": attn, "trl_attn": a.trl_attn, "trl_cudnn_sdpa": a.trl_cudnn_sdpa,
        "max_tokens_per_micro_batch": budget or None, "precision": precision,
        "gradient_checkpointing": a.gradient_checkpointing,
        "trl_order": a.trl_order, "seed": a.seed, "flops_params": flops_params, "cpu_threads": cpu_threads,
        "modes": modes, "profile_sides": profile_sides, "rounds": a.rounds,
        "profile_trace": str(Path(a.profile_trace).resolve()) if a.profile_trace else None,
    }
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))

    def run_name(side: str, mode: str) -> str:
        return side if mode == "full" else f"{side}_{mode}"

    def full_only(side: str) -> bool:  # rlhf train takes --bf16-weights for full fine-tuning only
        return bool(OURS.get(base_of[side], {}).get("bf16_weights"))

    for mode, m in modes.items():
        for side in sides:
            if m["lora_rank"] and full_only(side):
                print(f"[bench_gpu] {side} skipped in mode {mode}: {FULL_ONLY}")
    runnable = [(side, mode) for mode in modes for side in sides
                if side not in skipped and not (full_only(side) and modes[mode]["lora_rank"])]
    runs: dict[str, list[dict]] = {run_name(*x): [] for x in runnable}
    mem_key = "peak_memory_gib" if on_cuda else "peak_rss_gib"
    memory_measure = "torch.cuda.max_memory_allocated" if on_cuda else "peak RSS (CPU)"

    def side_results() -> dict[str, dict]:
        """Each side's summary (the median round by tokens/s), or why it has none: skipped, failed, or not run yet."""
        results: dict[str, dict] = {}
        for mode in modes:
            for side in sides:
                name = run_name(side, mode)
                if side in skipped:
                    results[name] = {"side": side, "mode": mode, "skipped": skipped[side]}
                    continue
                if name not in runs:  # not run in this mode
                    results[name] = {"side": side, "mode": mode, "skipped": FULL_ONLY}
                    continue
                if not runs[name]:  # its turn has not come: the report of a run still going, or cut short
                    results[name] = {"side": side, "mode": mode, "pending": True}
                    continue
                ok = [x for x in runs[name] if "error" not in x]
                if not ok:
                    results[name] = {"side": side, "mode": mode, "error": runs[name][-1]["error"],
                                     "stderr_tail": runs[name][-1].get("stderr_tail")}
                    continue
                ok.sort(key=lambda x: x["summary"]["tokens_per_s_steps"])
                results[name] = dict(ok[len(ok) // 2]["summary"])
                if len(ok) > 1:
                    results[name]["tokens_per_s_steps_all_rounds"] = [x["summary"]["tokens_per_s_steps"] for x in ok]
                if len(ok) < len(runs[name]):  # rounds that failed (or were stopped) are not in the median
                    results[name]["rounds_failed"] = [x["error"] for x in runs[name] if "error" in x]
        return results

    def budget(side: str) -> int | None:  # the micro-batch budget a side ran with (None: by pair count)
        return side_budget(side, spec["max_tokens_per_micro_batch"])

    def side_ratios(results: dict[str, dict]) -> dict[str, dict]:
        done = {k: v for k, v in results.items() if "tokens_per_s_steps" in v}
        ratios = {}
        # ours vs TRL within a mode (> 1 ours faster, < 1 ours smaller), and the compiled step against the same step
        # eager (the same numbers, and how much faster)
        pairs_compared = [(m, o, t) for m in modes for o in ours_sides for t in ("trl", "trl_precomputed")]
        eager_sides = [o for o in ours_sides if base_of[o] == "ours_bf16"]
        for o in (o for o in ours_sides if base_of[o] == "ours_compile"):  # the eager step at the same budget, else any
            same = [e for e in eager_sides if budget(e) == budget(o)] or eager_sides
            pairs_compared += [(m, o, same[0]) for m in modes] if same else []
        for mode, ours_side, other in pairs_compared:
            ours, theirs = done.get(run_name(ours_side, mode)), done.get(run_name(other, mode))
            if ours and theirs:
                ratios[f"{run_name(ours_side, mode)}_vs_{run_name(other, mode)}"] = {
                    "tokens_per_s_steps": ours["tokens_per_s_steps"] / theirs["tokens_per_s_steps"],
                    "tokens_per_s_run": ours["tokens_per_s_run"] / theirs["tokens_per_s_run"],
                    "peak_memory": ours[mem_key] / theirs[mem_key],
                    "memory_measure": memory_measure,
                    "same_trained_params": ours["trainable_params"] == theirs["trainable_params"],
                    "step1_loss_abs_diff": abs(ours["first_loss"] - theirs["first_loss"]),
                    "step1_grad_norm_rel_diff": (abs(ours["first_grad_norm"] - theirs["first_grad_norm"])
                                                 / max(abs(theirs["first_grad_norm"]), 1e-12)
                                                 if theirs.get("first_grad_norm") is not None else None),
                }
                if other in ours_sides:  # two of ours: the budgets they ran with
                    ratios[f"{run_name(ours_side, mode)}_vs_{run_name(other, mode)}"]["budgets"] = [
                        budget(ours_side), budget(other)]
        for mode, m in modes.items():  # LoRA vs full on each side: < 1 LoRA smaller / faster per step
            for side in sides:
                lora, full = done.get(run_name(side, mode)), done.get(run_name(side, "full"))
                if m["lora_rank"] and lora and full:
                    ratios[f"{run_name(side, mode)}_vs_{side}"] = {
                        "peak_memory": lora[mem_key] / full[mem_key],
                        "memory_measure": memory_measure,
                        "step_time": lora["seconds_steps"] / full["seconds_steps"],  # the same steps' mean
                        "median_step_time": lora["median_step_seconds"] / full["median_step_seconds"],
                        "tokens_per_s_steps": lora["tokens_per_s_steps"] / full["tokens_per_s_steps"],
                        "trained_params": lora["trainable_params"] / full["trainable_params"],
                        "step1_loss_abs_diff": abs(lora["first_loss"] - full["first_loss"]),
                    }
        return ratios

    def version(name: str) -> str | None:
        try:
            return __import__(name).__version__
        except ImportError:
            return None

    config_report = {
        **{k: v for k, v in spec.items()
           if k not in ("pair_lengths", "model_dir", "pairs_path", "workdir", "profile_trace")},
        "device_name": device_name, "peak_tflops_bf16": peak_tflops, "peak_tflops_source": peak_source,
        "total_params": total_params, "real_tokens_all_pairs": real_tokens, "tiny": a.tiny,
        "weights": "float32 master weights" + (" + bf16 autocast" if precision == "amp" else ", no autocast")
                   + "; ours_bf16: bf16 weights, float32 masters in the optimizer; ours_compile: ours_bf16 with "
                     "each decoder layer compiled (torch.compile)",
        "versions": {m: version(m) for m in ("torch", "transformers", "trl", "datasets", "peft", "flash_attn")},
        "flops_formula": ("PaLM: training 6*N*T + 12*L*hidden*T^2 per sequence (LoRA: (4*N + 6*N_lora)*T + "
                          "12*L*hidden*T^2, no weight gradients of the frozen N; N_lora = the adapters' "
                          "parameters), reference forward 2*N*T + 4*L*hidden*T^2; T = the sequence's real length "
                          "(prompt + response), summed over chosen and rejected of every pair; N = parameters "
                          "minus the input embedding"),
        "mfu_definitions": {
            "mfu_steps": "training FLOPs of the timed steps / their seconds / peak (reference FLOPs excluded)",
            "mfu_steps_with_ref": "plus the reference forward FLOPs run inside those steps (TRL default only)",
            "mfu_run": "(training FLOPs of all steps + reference forward FLOPs of all pairs) / whole-run "
                       "seconds (setup + reference pass + all steps) / peak",
            "step_mfu": "each timed step's training FLOPs / its seconds / peak, in order",
        },
    }

    def write_report(still_to_run: int, cut: bool = False) -> dict[str, Any]:
        """The report of the runs so far, written whole over ``--output`` (a temporary file renamed over it): after
        every side, so that a run cut short (a lease's end) leaves every side it finished: those not run yet are
        ``"pending"``, and ``runs_pending`` counts the runs to come (absent once all ran). ``cut_by_deadline``: a
        run was stopped, or not started, at ``--deadline``."""
        results = side_results()
        report = {"config": config_report, "sides": results, "ratios": side_ratios(results)}
        if still_to_run:
            report["runs_pending"] = still_to_run
        if cut:
            report["cut_by_deadline"] = True
        output = Path(a.output)
        partial = output.with_name(output.name + ".partial")
        partial.write_text(json.dumps(report, indent=2) + "\n")
        partial.replace(output)
        return report

    order = [(side, mode, r) for r in range(a.rounds)
             for side, mode in (runnable[r % len(runnable):] + runnable[: r % len(runnable)] if runnable else [])]
    report, cut = write_report(len(order)), False
    for done_count, (side, mode, r) in enumerate(order, 1):
        name, t = run_name(side, mode), time.perf_counter()
        timeout, left = a.worker_timeout, None
        if a.deadline is not None:
            left = a.deadline - (t - started)
            if left <= 0:
                print(f"[bench_gpu] --deadline {a.deadline:g} s reached: {len(order) - done_count + 1} side run(s) not "
                      "started (runs_pending in the report)")
                report = write_report(len(order) - done_count + 1, cut=True)
                break
            timeout = min(timeout or left, left)
        raw = spawn(side, mode, spec_path, timeout, visible_gpu, cpu_threads, r)
        if left is not None and timeout == left and raw.get("error", "").startswith("timed out"):
            raw["error"] = f"stopped at --deadline {a.deadline:g} s (it had {left:.0f} s left to run)"
            cut = True
        if "error" in raw:
            print(f"[bench_gpu] {name} FAILED ({raw['error']}):\n{raw.get('stderr_tail', '')}")
        else:
            s = summarise(raw, spec, peak_tflops * 1e12 if peak_tflops else None)
            raw["summary"] = s
            print(f"[bench_gpu] round {r + 1} {name}: {s['tokens_per_s_steps']:,.0f} tok/s over the steps, "
                  f"run {s['seconds_run']:.1f} s (process {time.perf_counter() - t:.1f} s)")
            if s.get("compiled_graphs", {}).get("in_window"):
                print(f"[bench_gpu] warning: {name} compiled {s['compiled_graphs']['in_window']} graph(s) inside "
                      "the steps window, which timed them as steps; more --warmup steps would leave them out")
        runs[name].append(raw)
        report = write_report(len(order) - done_count, cut)
    results, ratios = report["sides"], report["ratios"]

    print()
    print(f"DPO, Llama {dims['num_hidden_layers']}x{dims['hidden_size']} ({count(total_params)} params), "
          f"{report['config']['weights']}, ours attn {attn} (micro-batches of {cut}), TRL attn {a.trl_attn}, "
          f"on {device_name}; {num_pairs} pairs, global batch "
          f"{batch_size} x {accumulation}, {steps} timed steps after {a.warmup} warmup; peak "
          f"{fmt(peak_tflops, 'g')} TFLOP/s ({peak_source})")
    print()
    print(table(results, mem_key))
    print()
    for name, r in ratios.items():
        if "step_time" in r:
            print(f"- {name}: peak memory {r['peak_memory']:.2f}x ({r['memory_measure']}), step time "
                  f"{r['step_time']:.2f}x (median {r['median_step_time']:.2f}x), trained params "
                  f"{r['trained_params']:.2%}; step-1 loss |diff| {r['step1_loss_abs_diff']:.2e}")
            continue
        print(f"- {name}: tokens/s {r['tokens_per_s_steps']:.2f}x over the steps, {r['tokens_per_s_run']:.2f}x "
              f"over the whole run; peak memory {r['peak_memory']:.2f}x ({r['memory_measure']}); step-1 loss "
              f"|diff| {r['step1_loss_abs_diff']:.2e}, grad norm rel. diff {fmt(r['step1_grad_norm_rel_diff'], '.2e')}"
              + ("" if r["same_trained_params"] else "; TRAINED PARAMETER COUNTS DIFFER")
              + (f"; micro-batch budgets {r['budgets'][0]} vs {r['budgets'][1]} tokens"
                 if "budgets" in r and r["budgets"][0] != r["budgets"][1] else ""))
    print(f"\nwritten {a.output}")
    if not a.keep_workdir and not a.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    # a run cut by --deadline (the only way a side stays pending) is incomplete, also when every side ran at least
    # once (a later round was cut)
    return 0 if not report.get("cut_by_deadline") and all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
