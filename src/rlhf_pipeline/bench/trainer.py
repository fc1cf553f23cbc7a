"""Our DPO trainer against TRL's ``DPOTrainer``: throughput, padding, peak memory, and the loss on a fixed batch;
and peak memory again at Llama-3's 128k vocabulary (``memory_peak_vs_trl_large_vocab``, its own setup below).

Setup (both sides): the same random-initialised Llama (4 layers, hidden 256, vocab 8,192, float32, CPU), the same
pairs with a realistic length spread (prompts 16-256 tokens, each response 16-512, uniform), the same global batch
(micro-batch x accumulation), one epoch over all pairs, AdamW at 1e-6 with warmup + cosine, clipping at 1.0, DPO
beta 0.1. Each run is a fresh subprocess (``python -m rlhf_pipeline.bench.trainer --worker ...``) so its peak
resident memory is its own; the sides alternate round by round (ours, TRL default, TRL precomputed, then the
order rotates).

What is timed, on both sides: loading the model, the reference log-probs (ours: our one batched pass before
training, as ``rlhf train`` runs it when the data has none; TRL default: a second, frozen model run every step; TRL
precomputed: its pass before training), every training step, and saving the final model. Imports are not timed.
Real tokens are those of the pairs (prompt twice, both responses), identical for every side because each trains
on every pair once; tokens per second = real tokens / timed seconds.

TRL is given the token ids directly (its dataset tokenization is bypassed by overriding ``_prepare_dataset``), so
both sides train on exactly the same sequences and tokenization is not part of the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.common import Entry

SIDES = ("ours", "trl", "trl_precomputed")
VOCAB = 8192
LR, BETA = 1e-6, 0.1


def sizes(quick: bool) -> dict[str, int]:
    # A global batch of 8 pairs (4 x 2) quick, 16 (4 x 4) full; every pair is seen once.
    return {"pairs": 32, "batch_size": 4, "accumulation": 2} if quick else {
        "pairs": 192, "batch_size": 4, "accumulation": 4}


def make_model(path: Path, seed: int = 0, vocab: int = VOCAB, hidden: int = 256, layers: int = 4) -> None:
    """A Llama with ``vocab`` ids (the tiny BPE tokenizer covers its first ids; the data are ids anyway), ``layers``
    layers of width ``hidden`` (4 heads, MLP 3 x hidden), untied input and output embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_pipeline.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def make_pairs(path: Path, num_pairs: int, eos_id: int, seed: int = 0, vocab: int = VOCAB,
               prompt_lengths: tuple[int, int] = (16, 256), response_lengths: tuple[int, int] = (16, 512)) -> int:
    """Pairs of random ids below ``vocab``, prompts of ``prompt_lengths`` tokens and responses of ``response_lengths``
    (both inclusive and uniform; each response ends in EOS), saved as a ``train`` split in the pairs contract of
    ``rlhf filter``. Returns the number of real tokens one epoch processes."""
    import datasets
    import numpy as np

    rng = np.random.default_rng(seed)
    low = 16  # ids below the tokenizer's special tokens are avoided

    def ids(n: int) -> list[int]:
        return rng.integers(low, vocab, n).tolist()

    rows: dict[str, list] = {k: [] for k in ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids",
                                             "chosen_reward", "rejected_reward")}
    for _ in range(num_pairs):
        rows["prompt_token_ids"].append(ids(int(rng.integers(prompt_lengths[0], prompt_lengths[1] + 1))))
        for key in ("chosen_token_ids", "rejected_token_ids"):
            rows[key].append(ids(int(rng.integers(response_lengths[0] - 1, response_lengths[1]))) + [eos_id])
        rows["chosen_reward"].append(1.0)
        rows["rejected_reward"].append(0.0)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(path))
    return sum(2 * len(p) + len(c) + len(r) for p, c, r in
               zip(rows["prompt_token_ids"], rows["chosen_token_ids"], rows["rejected_token_ids"]))


# ----------------------------------------------------------------------------------------------------------------
# The two sides, each run in its own process


def run_ours(model: str, data: str, output: str, batch_size: int, accumulation: int, **options) -> dict[str, Any]:
    """``rlhf train --algo dpo`` with the benchmark's settings (``options`` override or add rlhf train options)."""
    from rlhf_pipeline.stages.train import TrainConfig, main

    config = TrainConfig(**{
        "algo": "dpo", "model": model, "data": data, "output": output, "batch_size": batch_size,
        "gradient_accumulation_steps": accumulation, "learning_rate": LR, "beta": BETA, "temperature": 1.0,
        "report_to": "none", "overwrite": True, "max_grad_norm": 1.0, "warmup_ratio": 0.1, **options,
    })
    main(config)
    manifest = json.loads((Path(output) / "manifest.json").read_text())["training"]
    first = json.loads((Path(output) / "metrics.jsonl").read_text().splitlines()[0])
    return {"first_loss": first["loss/train"], "steps": manifest["steps"],
            "real_token_fraction": manifest["real_token_fraction"]}


def trl_trainer(model, data, output: str, batch_size: int, accumulation: int, precompute: bool, ref_model=None):
    """TRL's DPOTrainer on our pairs, its defaults except what both sides must share (batch, lr, schedule)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class IdsDPOTrainer(DPOTrainer):
        """The data arrive as token ids already (prompt_ids / chosen_ids / rejected_ids): skip tokenization."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    ds = load_from_disk(data)["train"] if isinstance(data, str) else data
    ds = ds.rename_columns({"prompt_token_ids": "prompt_ids", "chosen_token_ids": "chosen_ids",
                            "rejected_token_ids": "rejected_ids"})
    ds = ds.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
    args = DPOConfig(
        output_dir=output, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
        num_train_epochs=1, learning_rate=LR, beta=BETA, lr_scheduler_type="cosine", warmup_steps=0.1,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=True, seed=0, precompute_ref_log_probs=precompute, max_length=None, dataloader_num_workers=0,
        bf16=False,  # TRL turns bf16 autocast on by default; both sides run float32 here
    )
    tokenizer = AutoTokenizer.from_pretrained(model if isinstance(model, str) else model.name_or_path)
    return IdsDPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=ds, processing_class=tokenizer)


def run_trl(model: str, data: str, output: str, batch_size: int, accumulation: int, precompute: bool) -> dict:
    trainer = trl_trainer(model, data, output, batch_size, accumulation, precompute)
    trainer.train()
    trainer.save_model(output)
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return {"first_loss": losses[0], "steps": trainer.state.global_step}


def worker(argv: list[str]) -> None:
    """One timed run of one side; prints a JSON line with seconds, peak resident memory and what the run logged."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=SIDES, required=True)
    for name in ("model", "data", "output"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accumulation", type=int, required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch  # noqa: F401  (imports are not timed: they cost the same on both sides)
    import transformers  # noqa: F401
    import datasets  # noqa: F401

    if a.worker == "ours":
        import rlhf_pipeline.stages.train  # noqa: F401
    else:
        import trl  # noqa: F401
    t0 = time.perf_counter()
    if a.worker == "ours":
        info = run_ours(a.model, a.data, a.output, a.batch_size, a.accumulation)
    else:
        info = run_trl(a.model, a.data, a.output, a.batch_size, a.accumulation, a.worker == "trl_precomputed")
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB
    print("RESULT " + json.dumps({"side": a.worker, "seconds": seconds, "peak_rss_mib": peak, **info}))


def spawn(side: str, model: Path, data: Path, output: Path, size: dict[str, int]) -> dict[str, Any]:
    return run_worker([__name__, "--worker", side, "--model", str(model), "--data", str(data), "--output",
                       str(output), "--batch-size", str(size["batch_size"]), "--accumulation",
                       str(size["accumulation"])], output)


def run_worker(argv: list[str], output: Path) -> dict[str, Any]:
    """``python -m argv...``, a benchmark worker, in a fresh process writing ``output``: what it printed after
    ``RESULT``."""
    shutil.rmtree(output, ignore_errors=True)  # a finished output would be reused, not retrained
    env = {**os.environ, "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker {' '.join(argv[:3])} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def spawn_rounds(sides: tuple[str, ...], rounds: int, model: Path, data: Path, workdir: Path, size: dict[str, int],
                 tag: str = "trainer") -> dict[str, list[dict]]:
    """``rounds`` rounds of one fresh run per side, the order rotating every round (a, b, c; b, c, a; ...)."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides[r % len(sides):] + sides[: r % len(sides)]:
            result = spawn(side, model, data, workdir / f"out_{side}", size)
            runs[side].append(result)
            print(f"[bench {tag}] round {r + 1} {side}: {result['seconds']:.1f} s, "
                  f"peak {result['peak_rss_mib']:.0f} MiB")
    return runs


# ----------------------------------------------------------------------------------------------------------------
# The fixed-batch loss check


def loss_agreement(model_path: Path, data: Path, rows: int = 8, dtype: str = "float64",
                   exact: bool = False) -> dict[str, float]:
    """DPO loss of our PairTask and of TRL's ``_compute_loss`` on the same batch, against a reference model that
    differs from the policy (its weights perturbed), so the loss is not the trivial log 2 of step 0. In float64 ours is
    exact and TRL's fused LM head still returns float32 log-probs (measured difference ~4e-6); in float32 both
    round sums of hundreds of token log-probs, in different layouts (packed against padded). With ``exact``, also
    the loss from each sequence's full logits and log_softmax in ``dtype`` (``"exact"``, ``"ours_vs_exact"``): at a
    128k vocabulary and ~1,000-token responses TRL's float32 log-probs drift further than 1e-5, so ours is held to
    this reference instead."""
    import copy

    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.algorithms.pairs import PairTask, pair_logps
    from rlhf_pipeline.losses import PairLossParams
    from rlhf_pipeline.modeling import SAFE_WEIGHTS

    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype), **SAFE_WEIGHTS).eval()
    reference = copy.deepcopy(policy)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    ds = load_from_disk(str(data))["train"].select(range(rows))
    batch = ds.to_list()
    with torch.no_grad():
        ref_c, ref_r, _ = pair_logps(reference, batch, pad_id=0, temperature=1.0)
        for row, c, r in zip(batch, ref_c.tolist(), ref_r.tolist()):
            row["chosen_ref_logp"], row["rejected_ref_logp"] = c, r
        task = PairTask("dpo", PairLossParams(beta=BETA), temperature=1.0, pad_id=0, pack_ratio=2.0)
        ours, _, _ = task.loss(policy, batch)

        trainer = trl_trainer(policy, ds, "/tmp/rlhf_bench_trl_check", len(batch), 1, precompute=False,
                              ref_model=reference)
        inputs = trainer.data_collator(
            [{"prompt_ids": r["prompt_token_ids"], "chosen_ids": r["chosen_token_ids"],
              "rejected_ids": r["rejected_token_ids"]} for r in batch]
        )
        trainer.model.eval()
        theirs = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
        result = {"ours": float(ours), "trl": float(theirs), "abs_diff": abs(float(ours) - float(theirs))}
        if exact:
            result["exact"] = full_logits_dpo_loss(policy, reference, batch, BETA)
            result["ours_vs_exact"] = abs(result["ours"] - result["exact"])
    return result


def full_logits_dpo_loss(policy, reference, rows: list[dict], beta: float) -> float:
    """The DPO loss the textbook way, one sequence at a time: full (T, V) logits, log_softmax, the response tokens'
    log-probs summed, ``-logsigmoid(beta * (policy log-ratio - reference log-ratio))`` averaged over the pairs."""
    import torch

    def logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + response])
        logprobs = model(input_ids=ids).logits[0, :-1].log_softmax(-1)  # (T-1, V): position t predicts t+1
        targets = ids[0, 1:]
        return logprobs.gather(-1, targets[:, None])[len(prompt) - 1:].sum()

    losses = []
    for row in rows:
        p, c, r = row["prompt_token_ids"], row["chosen_token_ids"], row["rejected_token_ids"]
        margin = (logp(policy, p, c) - logp(policy, p, r)) - (logp(reference, p, c) - logp(reference, p, r))
        losses.append(-torch.nn.functional.logsigmoid(beta * margin))
    return float(torch.stack(losses).mean())


# ----------------------------------------------------------------------------------------------------------------
# The entries


def run(config, workdir: Path) -> tuple[list[Entry], list[dict]]:
    from rlhf_pipeline.chat import load_tokenizer

    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("the trainer benchmarks compare against TRL: pip install -e '.[bench]'") from None
    size = sizes(config.quick)
    workdir.mkdir(parents=True, exist_ok=True)
    model, data = workdir / "model", workdir / "pairs"
    if not (model / "config.json").exists():
        make_model(model)
    real_tokens = make_pairs(data, size["pairs"], load_tokenizer(str(model)).eos_token_id)
    print(f"[bench trainer] {size['pairs']} pairs, {real_tokens} real tokens, global batch "
          f"{size['batch_size'] * size['accumulation']}; {config.num_rounds} rounds x {len(SIDES)} sides")

    runs = spawn_rounds(SIDES, config.num_rounds, model, data, workdir, size)
    check = loss_agreement(model, data)
    check32 = loss_agreement(model, data, dtype="float32")

    def median(side: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[side])

    tps = {side: real_tokens / median(side, "seconds") for side in SIDES}
    first = {side: runs[side][0]["first_loss"] for side in SIDES}
    fraction = runs["ours"][0]["real_token_fraction"]
    rebel_fraction = rebel_fixed_padding_fraction(data)
    per_round = {side: [round(x["seconds"], 2) for x in runs[side]] for side in SIDES}
    common = (f"DPO, Llama 4 layers x 256 hidden, vocab {VOCAB}, float32 on CPU; {size['pairs']} pairs (prompts 16-256 "
              f"tokens, responses 16-512), global batch {size['batch_size']} x {size['accumulation']}, one epoch, "
              f"{config.num_rounds} alternating rounds of fresh processes, median. Timed: model load, reference "
              "log-probs, every step, final save.")
    entries = [
        Entry("trainer_vs_trl_default", tps["ours"], tps["trl"], "real tokens/s", tps["ours"] / tps["trl"], 1.5,
              f"{common} Ours computes the reference log-probs in one batched pass before training (included); "
              "TRL 'default' keeps a second model and runs it every step. Seconds per round: ours "
              f"{per_round['ours']}, TRL {per_round['trl']}.",
              {"seconds": per_round, "real_tokens": real_tokens}),
        Entry("trainer_vs_trl_precomputed", tps["ours"], tps["trl_precomputed"], "real tokens/s",
              tps["ours"] / tps["trl_precomputed"], 1.2,
              f"{common} TRL with precompute_ref_log_probs=True (its pass included). Step-0 (first logged) loss: "
              f"ours {first['ours']:.8f}, TRL {first['trl_precomputed']:.8f}, TRL default {first['trl']:.8f}. On a "
              f"fixed batch of 8 pairs against a perturbed reference model (so not the trivial log 2), in float64: "
              f"ours {check['ours']:.10f}, TRL {check['trl']:.10f}, |diff| {check['abs_diff']:.1e} (must be <= "
              f"1e-5); in float32 |diff| {check32['abs_diff']:.1e}.",
              {"seconds": per_round, "first_loss": first, "fixed_batch_loss_float64": check,
               "fixed_batch_loss_float32": check32}),
        Entry("padding_real_token_fraction", fraction, rebel_fraction, "fraction", fraction, 0.9,
              f"Real tokens / token positions the trainer processed over the whole run (packed micro-batches, "
              f"pack ratio 2). REBEL pads every sequence to 1024 prompt + 2048 response positions: on the same "
              f"pairs its fraction would be {rebel_fraction:.3f} (the 'peer' column).",
              {"rebel_fixed_padding_fraction": rebel_fraction}),
        Entry("memory_peak_vs_trl", median("ours", "peak_rss_mib"), median("trl", "peak_rss_mib"), "MiB peak RSS",
              median("trl", "peak_rss_mib") / median("ours", "peak_rss_mib"), 1.0,
              f"Peak resident memory of each run's process (ru_maxrss), median over rounds; TRL default "
              f"(reference model in memory). TRL precomputed: {median('trl_precomputed', 'peak_rss_mib'):.0f} MiB.",
              {"peak_rss_mib": {side: [round(x["peak_rss_mib"]) for x in runs[side]] for side in SIDES}}),
    ]
    if check["abs_diff"] > 1e-5 or abs(first["ours"] - first["trl_precomputed"]) > 1e-5:
        entries[1].notes += " LOSS MISMATCH."
        entries[1].ratio = 0.0  # a wrong loss is not a speed-up
    entries.append(large_vocab_entry(config, workdir / "large_vocab"))
    return entries, []


# ----------------------------------------------------------------------------------------------------------------
# Peak memory at a real vocabulary size
#
# The model's vocabulary is Llama-3's 128,256 ids while its tokenizer stays the tiny kit's 1,024-id BPE: the data are
# token ids sampled over the whole vocabulary, handed to both trainers as ids, so the tokenizer never runs, and what
# a 128k vocabulary costs in memory (the embedding and LM-head matrices, their gradients and optimizer state, and
# above all the (tokens x vocabulary) logits) depends only on the model's vocab_size. A real 128k tokenizer would
# change the text, not one tensor shape. The hidden size is small so that the logits dominate, as they do at 8B
# once the weights are sharded or adapted (issue 15), and a step fits a 2-core CPU.

LARGE_VOCAB = 128_256  # Llama-3's vocabulary
LARGE_MODEL = {"vocab": LARGE_VOCAB, "hidden": 64, "layers": 2}
LARGE_PROMPTS, LARGE_RESPONSES = (16, 128), (768, 1024)  # token counts, inclusive
# TRL default only: with a 64-wide model its reference model is 33 MiB, so precompute_ref_log_probs=True would peak
# about as high (docs/benchmarks.md, "Measurements quoted in the code's design notes"), not worth a third side's
# minutes.
LARGE_SIDES = ("ours", "trl")
# float32 sums of ~1,000 log-probs near -log(128,256) = -11.8 are ~12,000 in size, where float32 ids are 2^-10
# apart: each sequence log-prob can round by ~1e-3 and the step-0 DPO loss moves by beta * sigmoid(0) = 0.05 per unit
# of log-ratio, over 4 sums: at most ~2e-4 between two correct float32 implementations in different layouts.
LARGE_FLOAT32_LOSS_TOLERANCE = 2e-4  # TRL's fused LM head returns float32 log-probs even for a float64 model


def large_vocab_sizes(quick: bool) -> dict[str, int]:
    # The micro-batch (2 pairs: 4 sequences of up to 1,152 tokens) sets the peak; full mode adds a micro-batch (one
    # step with accumulation, so gradients are held across micro-batches) and a round.
    return {"pairs": 2, "batch_size": 2, "accumulation": 1} if quick else {
        "pairs": 4, "batch_size": 2, "accumulation": 2}


def large_vocab_entry(config, workdir: Path) -> Entry:
    """``memory_peak_vs_trl_large_vocab``: TRL's peak resident memory over ours, DPO at a 128k vocabulary."""
    from rlhf_pipeline.chat import load_tokenizer

    size = large_vocab_sizes(config.quick)
    sides = LARGE_SIDES
    workdir.mkdir(parents=True, exist_ok=True)
    model, data = workdir / "model", workdir / "pairs"
    if not (model / "config.json").exists():
        make_model(model, **LARGE_MODEL)
    real_tokens = make_pairs(data, size["pairs"], load_tokenizer(str(model)).eos_token_id, vocab=LARGE_VOCAB,
                             prompt_lengths=LARGE_PROMPTS, response_lengths=LARGE_RESPONSES)
    print(f"[bench large vocab] vocab {LARGE_VOCAB:,}, {size['pairs']} pairs, {real_tokens} real tokens; "
          f"{config.num_rounds} rounds x {len(sides)} sides")
    started = time.perf_counter()
    runs = spawn_rounds(sides, config.num_rounds, model, data, workdir, size, tag="large vocab")
    check = loss_agreement(model, data, rows=1, exact=True)
    wall = time.perf_counter() - started

    def median(side: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[side])

    peaks = {side: [round(x["peak_rss_mib"]) for x in runs[side]] for side in sides}
    ours, trl = median("ours", "peak_rss_mib"), median("trl", "peak_rss_mib")
    first = {side: runs[side][0]["first_loss"] for side in sides}
    first_diff = abs(first["ours"] - first["trl"])
    entry = Entry(
        "memory_peak_vs_trl_large_vocab", ours, trl, "MiB peak RSS", trl / ours, 2.0,
        f"DPO at Llama-3's vocabulary: Llama {LARGE_MODEL['layers']} layers x {LARGE_MODEL['hidden']} hidden, vocab "
        f"{LARGE_VOCAB:,} (untied; the tiny kit's tokenizer, ids sampled over the whole vocabulary), float32 on CPU; "
        f"{size['pairs']} pairs (prompts {LARGE_PROMPTS[0]}-{LARGE_PROMPTS[1]} tokens, responses "
        f"{LARGE_RESPONSES[0]}-{LARGE_RESPONSES[1]}), micro-batch {size['batch_size']} pairs x accumulation "
        f"{size['accumulation']}, one epoch; {config.num_rounds} alternating rounds of fresh processes, median peak "
        f"resident memory (ru_maxrss): ours {ours:.0f} MiB, TRL default {trl:.0f} MiB (reference model in memory)."
        f" Per round: {peaks}. Ours runs the LM head on response positions only, in chunks of at most "
        f"2^25 logits; TRL 1.16's fused LM head tiles 4,096 positions x 32,768 ids, on a CPU over every position "
        f"(prompt and padding included). Step-0 loss: ours {first['ours']:.8f}, TRL {first['trl']:.8f}, |diff| "
        f"{first_diff:.1e} (float32 sums of ~1,000 log-probs; must be <= {LARGE_FLOAT32_LOSS_TOLERANCE:g}). On a fixed "
        f"pair against a perturbed reference, float64 model: ours {check['ours']:.10f}, full-logits reference "
        f"{check['exact']:.10f} (|diff| {check['ours_vs_exact']:.1e}, must be <= 1e-8), TRL {check['trl']:.10f} "
        f"(|diff| {check['abs_diff']:.1e}, must be <= {LARGE_FLOAT32_LOSS_TOLERANCE:g}: its fused head keeps float32 "
        f"log-probs). Wall time {wall:.0f} s.",
        {"peak_rss_mib": peaks, "seconds": {side: [round(x["seconds"], 1) for x in runs[side]] for side in sides},
         "model": LARGE_MODEL, "prompt_tokens": list(LARGE_PROMPTS), "response_tokens": list(LARGE_RESPONSES),
         "size": size, "real_tokens": real_tokens, "first_loss": first, "fixed_batch_loss_float64": check,
         "wall_seconds": round(wall, 1)},
    )
    if (check["ours_vs_exact"] > 1e-8 or check["abs_diff"] > LARGE_FLOAT32_LOSS_TOLERANCE
            or first_diff > LARGE_FLOAT32_LOSS_TOLERANCE):
        entry.notes += " LOSS MISMATCH."
        entry.ratio = 0.0  # a saving on a different computation is no saving
    return entry


def rebel_fixed_padding_fraction(data: Path) -> float:
    """Real tokens over REBEL's fixed grid: each pair's chosen and rejected padded to 1024 + 2048 positions."""
    from datasets import load_from_disk

    ds = load_from_disk(str(data))["train"]
    real = sum(2 * len(p) + len(c) + len(r) for p, c, r in
               zip(ds["prompt_token_ids"], ds["chosen_token_ids"], ds["rejected_token_ids"]))
    return real / (ds.num_rows * 2 * (1024 + 2048))


if __name__ == "__main__":
    worker(sys.argv[1:])
