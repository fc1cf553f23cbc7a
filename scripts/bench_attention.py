#!/usr/bin/env python
"""Attention over packed sequences on one GPU: variable-length flash attention against sdpa with a dense
block-diagonal mask and against padding, forward + backward, and the matmul ceiling at the trainer's shapes.

    python scripts/bench_attention.py                         # the GPU bench's shapes (heads 16/8, head dim 128)
    python scripts/bench_attention.py --device cpu --tiny     # the same code on a CPU, seconds (a smoke test)

Standalone: torch, and this checkout's ``rlhf_pipeline`` (``logprobs.pack_rows``, ``attention``'s kernel call and
reference). For each batch of sequence lengths (drawn as ``scripts/bench_gpu.py`` draws its pairs: prompt 16-256
tokens + response 16-512), the same q, k, v (bf16 on CUDA, float32 on a CPU) go through:

* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` over every sequence packed in one row (no padding, no mask),
  called as the trainer calls it (``rlhf_pipeline.attention``'s kernel path: causal, GQA by repeating the
  key/value heads where the torch release has no ``enable_gqa``). CUDA only.
* ``sdpa_packed``: ``scaled_dot_product_attention`` over rows of up to ``--pack-ratio`` x the longest sequence with
  the dense block-diagonal causal mask transformers builds for packed rows (what ``rlhf train`` ran before varlen).
* ``sdpa_padded``: one sequence per row, right-padded to the longest, ``is_causal=True`` (pads masked by position:
  their outputs are discarded).
* ``reference``: ``rlhf_pipeline.attention.varlen_reference`` in float32, one causal
  ``scaled_dot_product_attention`` per sequence: the oracle every layout is compared with (max abs error of the
  outputs on real tokens and of the gradient of q).

Times are medians of ``--repeats`` runs after ``--warmup``, with ``torch.cuda.synchronize`` at each clock reading.
The matmul ceiling times the MLP's up-projection at the same token count (``tokens x hidden`` @ ``hidden x
intermediate``, bf16): what the trainer's largest matmuls can reach at that micro-batch size.

Output: a JSON file (``--output``) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if (REPO / "src" / "rlhf_pipeline").is_dir():  # this checkout's code, installed or not
    sys.path.insert(0, str(REPO / "src"))


def draw_lengths(n: int, seed: int, tiny: bool) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    prompt, response = ((8, 64), (8, 128)) if tiny else ((16, 256), (16, 512))
    return [int(rng.integers(prompt[0], prompt[1] + 1)) + int(rng.integers(response[0], response[1] + 1))
            for _ in range(n)]


def repeat_kv(x, groups: int):
    return x if groups == 1 else x.repeat_interleave(groups, dim=-2)


def cumulative(lengths: list[int], device):
    """The sequences' bounds in the packed row, int32 (``cu_seq_lens``)."""
    import itertools

    import torch

    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def run_reference(q, k, v, lengths, scale):
    """(T, H, D) outputs of every sequence attended alone, in float32 (``attention.varlen_reference``)."""
    from rlhf_pipeline.attention import varlen_reference

    return varlen_reference(q.float(), k.float(), v.float(), cumulative(lengths, q.device), scale=scale)


def run_varlen(q, k, v, lengths, scale):
    """The trainer's varlen kernel call (``attention._varlen_kernel``: ``varlen_attn``, causal, GQA)."""
    from rlhf_pipeline.attention import _varlen_kernel

    cu, longest = cumulative(lengths, q.device), max(lengths)
    return _varlen_kernel(q, k, v, cu, cu, longest, longest, scale, True, None)


def scatter_rows(q, rows, lengths):
    """(R, T, H, D) rows of the packed sequences, zero after each row's end; and the index of each real token."""
    import torch

    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    width = max(sum(lengths[i] for i in row) for row in rows)
    index = []
    for r, row in enumerate(rows):
        at = r * width
        for i in row:
            index += list(range(at, at + lengths[i]))
            at += lengths[i]
    order = [i for row in rows for i in row]
    src = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in order]).to(q.device)
    index = torch.tensor(index, device=q.device)
    return width, src, index


def run_sdpa_rows(q, k, v, lengths, rows, scale, packed: bool):
    """sdpa over rows (packed with a dense block-diagonal causal mask, or one padded sequence per row)."""
    import torch
    import torch.nn.functional as F

    width, src, index = scatter_rows(q, rows, lengths)
    R, (H, D), Hk = len(rows), q.shape[1:], k.shape[1]

    def lay(t):
        out = t.new_zeros(R * width, t.shape[1], t.shape[2])
        out = out.index_copy(0, index, t.index_select(0, src))
        return out.view(R, width, t.shape[1], t.shape[2]).transpose(1, 2)

    qs, ks, vs = lay(q), lay(repeat_kv(k, H // Hk)), lay(repeat_kv(v, H // Hk))
    if packed:
        seg = torch.full((R, width), -1, dtype=torch.long, device=q.device)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                seg[r, at:at + lengths[i]] = i
                at += lengths[i]
        causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
        mask = (seg[:, :, None] == seg[:, None, :]) & causal & (seg[:, :, None] >= 0)
        mask = mask | torch.eye(width, dtype=torch.bool, device=q.device)  # pads see themselves: no NaN rows
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[:, None], scale=scale)
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
    flat = out.transpose(1, 2).reshape(R * width, H, D)
    result = torch.empty_like(q)
    return result.index_copy(0, src, flat.index_select(0, index))


def timed(fn, warmup: int, repeats: int, sync) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--tiny", action="store_true", help="4 heads / 2 KV heads of 16, short sequences (a smoke test)")
    p.add_argument("--sequences", default="8,32", help="comma-separated sequence counts per batch")
    p.add_argument("--pack-ratio", type=float, default=2.0)
    p.add_argument("--hidden", type=int, default=2048, help="hidden size for the matmul ceiling")
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="attention_bench.json")
    a = p.parse_args(argv)

    import torch

    from rlhf_pipeline.logprobs import pack_rows

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, head_dim = (4, 2, 16) if a.tiny else (16, 8, 128)
    hidden, intermediate = (256, 704) if a.tiny else (a.hidden, a.intermediate)
    scale = head_dim ** -0.5
    have_varlen = cuda
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        have_varlen = False
    results = []
    for n in [int(x) for x in a.sequences.split(",")]:
        lengths = draw_lengths(n, a.seed + n, a.tiny)
        total = sum(lengths)
        gen = torch.Generator(device="cpu").manual_seed(a.seed)
        q0 = torch.randn(total, heads, head_dim, generator=gen).to(device, dtype)
        k0 = torch.randn(total, kv_heads, head_dim, generator=gen).to(device, dtype)
        v0 = torch.randn(total, kv_heads, head_dim, generator=gen).to(device, dtype)
        grad = torch.randn(total, heads, head_dim, generator=gen).to(device, dtype)
        ref_q = q0.detach().float().clone().requires_grad_()
        ref = run_reference(ref_q, k0.float(), v0.float(), lengths, scale)
        ref.backward(grad.float())
        layouts = {"sdpa_padded": lambda q, k, v: run_sdpa_rows(q, k, v, lengths, [[i] for i in range(n)], scale,
                                                                 False),
                   "sdpa_packed": lambda q, k, v: run_sdpa_rows(q, k, v, lengths, pack_rows(lengths, a.pack_ratio),
                                                                scale, True)}
        if have_varlen:
            layouts["varlen"] = lambda q, k, v: run_varlen(q, k, v, lengths, scale)
        row = {"sequences": n, "tokens": total, "longest": max(lengths), "layouts": {}}
        for name, fn in layouts.items():
            q = q0.detach().clone().requires_grad_()
            k, v = k0.detach().clone().requires_grad_(), v0.detach().clone().requires_grad_()
            try:
                out = fn(q, k, v)
                out.backward(grad)
                err_out = float((out.detach().float() - ref.detach()).abs().max())
                err_grad = float((q.grad.float() - ref_q.grad).abs().max())

                def step():
                    q.grad = k.grad = v.grad = None
                    fn(q, k, v).backward(grad)

                fwd = timed(lambda: fn(q.detach(), k.detach(), v.detach()), a.warmup, a.repeats, sync)
                both = timed(step, a.warmup, a.repeats, sync)
                row["layouts"][name] = {"forward_ms": fwd * 1e3, "forward_backward_ms": both * 1e3,
                                        "max_abs_err_out": err_out, "max_abs_err_grad_q": err_grad}
            except Exception as e:  # noqa: BLE001 (reported, the other layouts still run)
                row["layouts"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        # The matmul ceiling at this token count (bf16 on CUDA).
        x = torch.randn(total, hidden, device=device, dtype=dtype)
        w = torch.randn(hidden, intermediate, device=device, dtype=dtype)
        mm = timed(lambda: x @ w, a.warmup, a.repeats, sync)
        row["matmul_tflops"] = 2 * total * hidden * intermediate / mm / 1e12
        results.append(row)

    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
              "pack_ratio": a.pack_ratio, "results": results}
    Path(a.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"attention on {report['device']} (torch {torch.__version__}, {dtype}); "
          f"heads {heads}/{kv_heads} x {head_dim}")
    print("| sequences | tokens | layout | fwd ms | fwd+bwd ms | max err out | max err grad q |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        for name, r in row["layouts"].items():
            if "error" in r:
                print(f"| {row['sequences']} | {row['tokens']} | {name} | FAILED: {r['error'][:80]} | | | |")
                continue
            print(f"| {row['sequences']} | {row['tokens']} | {name} | {r['forward_ms']:.3f} | "
                  f"{r['forward_backward_ms']:.3f} | {r['max_abs_err_out']:.2e} | {r['max_abs_err_grad_q']:.2e} |")
        print(f"| {row['sequences']} | {row['tokens']} | matmul {hidden}x{intermediate} | "
              f"{row['matmul_tflops']:.1f} TFLOP/s | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
