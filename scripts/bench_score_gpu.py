#!/usr/bin/env python
"""Reward-model scoring on one device: our batched scorer against REBEL's one-forward-per-response loop.

    python scripts/bench_score_gpu.py --output score_gpu.json              # cuda:0, three model sizes
    python scripts/bench_score_gpu.py --device cpu --sizes tiny --prompts 40  # a smoke test on a CPU

The question it answers: ``rlhf bench``'s ``score_batched_vs_one_by_one`` misses its target of 5 on a CPU, where
the peer's batch-1 forwards are mostly arithmetic (see docs/benchmarks/BENCHMARKS.md). On a GPU a batch-1 forward of
a small model is mostly kernel-launch latency, so batching should gain much more; this measures by how much.

Standalone: torch, transformers and tokenizers, and ``rlhf_pipeline`` from this checkout's ``src/`` (no install, no
``datasets``). Models are random-initialised Llama sequence classifiers (one label) built here, never downloaded,
with the tiny bundled tokenizer (vocabulary 1,024) and its chat template; bfloat16 on a GPU (what ``rlhf score
--dtype auto`` picks), float32 on a CPU; ``--dtype`` sets it. Sizes: ``tiny`` (hidden 64, 2 layers: the model of
``rlhf bench``), ``small`` (hidden 512, 8 layers, 26M parameters), ``1b`` (hidden 2048, 16 layers, intermediate
5632: 0.76B parameters with this vocabulary).

Data: ``--prompts`` bundled prompts (cycled, half with a corpus sentence appended) x ``--n`` responses of one to four
corpus sentences, as ``rlhf bench`` builds them. Sides, in one process, alternating for ``--rounds`` rounds after one
warm-up each, each model loaded once outside the timing (the CPU benchmark also times loading and dataset I/O):

* ours: ``RewardModelScorer.score`` as ``rlhf score`` calls it: whole conversations templated in one call, sorted by
  length, batches of ``--batch-size``, the mask-free fast path (checked against the model's forward on first use).
* peer: REBEL's ``rank.py`` loop: per response, ``apply_chat_template(..., truncation=True)``, one forward of batch 1,
  ``.item()``.

Both sides' rewards must agree (1e-4 relative in float32, 3e-2 in bfloat16) before a size's ratio is reported; a size
whose rewards disagree is recorded without one (with the differences and the rewards' spread) and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    "small": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 4},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
           "num_key_value_heads": 8},
}


def build_model(path: Path, size: str, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhf_pipeline.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **SIZES[size])
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def conversations(num_prompts: int, n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(prompt, response) texts, ``n`` responses per prompt, flattened prompt by prompt."""
    from rlhf_pipeline.tiny import bundled_path

    rng = random.Random(seed)
    bundled = [json.loads(line)["prompt"] for line in bundled_path("prompts.jsonl").read_text().splitlines()]
    corpus = [line for line in bundled_path("tiny_corpus.txt").read_text().splitlines() if line.strip()]
    prompts, responses = [], []
    for i in range(num_prompts):
        prompt = bundled[i % len(bundled)] + ((" " + rng.choice(corpus)) if rng.random() < 0.5 else "")
        for _ in range(n):
            prompts.append(prompt)
            responses.append(" ".join(rng.sample(corpus, rng.randint(1, 4))))
    return prompts, responses


def one_by_one(model, tokenizer, prompts: list[str], responses: list[str], device) -> list[float]:
    """REBEL's ``rank.py`` shape: template, one forward of batch 1 and ``.item()`` per response."""
    from rlhf_pipeline.bench.stages import rebel_score_one

    return [rebel_score_one(model, tokenizer, p, r, device) for p, r in zip(prompts, responses)]


def measure(size: str, args, workdir: Path) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_pipeline.bench.common import alternate
    from rlhf_pipeline.modeling import SAFE_WEIGHTS
    from rlhf_pipeline.rewards import RewardModelScorer

    path = workdir / size
    build_model(path, size)
    device = torch.device(args.device)
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    scorer = RewardModelScorer(str(path), dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                               batch_size=args.batch_size)
    scorer.model.to(device)
    peer_model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=dtype, **SAFE_WEIGHTS)
    peer_model = peer_model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts, responses = conversations(args.prompts, args.n)

    def sync(fn):
        def timed():
            value = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return value
        return timed

    result = alternate(sync(lambda: scorer.score(prompts, responses)),
                       sync(lambda: one_by_one(peer_model, tokenizer, prompts, responses, device)), args.rounds)
    ours, peer = result["ours_value"], result["peer_value"]
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(ours, peer))
    agree = worst <= tolerance
    if not agree:  # no ratio for this size; the others still run, and the script exits 1
        print(f"{size}: rewards disagree (worst relative difference {worst:.2e} > {tolerance})", file=sys.stderr)
    sequences = len(prompts)
    mean, std = statistics.fmean(peer), statistics.pstdev(peer)
    row = {
        "size": size, "parameters": sum(p.numel() for p in peer_model.parameters()), "dtype": str(dtype),
        "sequences": sequences, "batch_size": args.batch_size, "scorer_mode": scorer.mode,
        "ours_seconds": [round(s, 4) for s in result["ours_seconds"]],
        "peer_seconds": [round(s, 4) for s in result["peer_seconds"]],
        "ours_sequences_per_s": round(sequences / result["ours_median"], 1),
        "peer_sequences_per_s": round(sequences / result["peer_median"], 1),
        "ratio": round(result["ratio"], 3) if agree else None, "max_relative_reward_difference": worst,
        "rewards_agree": agree, "tolerance": tolerance,
        "mean_abs_reward_difference": sum(abs(a - b) for a, b in zip(ours, peer)) / len(peer),
        "peer_reward_mean": mean, "peer_reward_std": std,
    }
    scorer = peer_model = None  # free both models before the next size (not del: the timed lambdas name them)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", default="tiny,small,1b", help=f"comma-separated, from {', '.join(SIZES)}")
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--n", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="ours: sequences per forward (rlhf score's default)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="both sides' weights and activations (auto: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--output", help="write the results here as JSON")
    args = p.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown size(s) {', '.join(unknown)}; choose from {', '.join(SIZES)}")

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device here; pass --device cpu for a smoke test")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="rlhf_score_bench_") as tmp:
        rows = [measure(size, args, Path(tmp)) for size in sizes]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{'size':6s} {'params':>12s} {'ours seq/s':>11s} {'peer seq/s':>11s} {'ratio':>6s}   ({device_name})")
    for r in rows:
        ratio = "  n/a (rewards disagree)" if r["ratio"] is None else f"{r['ratio']:6.2f}"
        print(f"{r['size']:6s} {r['parameters']:12,d} {r['ours_sequences_per_s']:11.1f} "
              f"{r['peer_sequences_per_s']:11.1f} {ratio}")
    if args.output:
        report = {"device": device_name, "torch": torch.__version__, "prompts": args.prompts, "n": args.n,
                  "rounds": args.rounds, "median_ratio_of": "median seconds per side",
                  "wall_seconds": round(time.time() - started, 1), "results": rows}
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0 if all(r["rewards_agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
