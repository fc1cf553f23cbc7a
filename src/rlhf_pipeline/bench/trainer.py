"""Our DPO trainer against TRL's ``DPOTrainer``: throughput, padding, peak memory, and the loss on a fixed batch.

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


def make_model(path: Path, seed: int = 0, hidden_size: int = 256, intermediate_size: int = 768, num_layers: int = 4,
               heads: int = 4) -> None:
    """A Llama with a vocabulary of 8,192 (the tiny BPE tokenizer covers its first ids; the data are ids anyway)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_pipeline.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def make_pairs(path: Path, num_pairs: int, eos_id: int, seed: int = 0, prompt: tuple[int, int] = (16, 256),
               response: tuple[int, int] = (16, 512)) -> int:
    """Pairs with prompts of 16-256 tokens and responses of 16-512 (each ending in EOS; other ``prompt`` and
    ``response`` ranges on request), saved as a ``train`` split in the pairs contract of ``rlhf filter``. Returns the
    number of real tokens one epoch processes."""
    import datasets
    import numpy as np

    rng = np.random.default_rng(seed)
    low = 16  # ids below the tokenizer's special tokens are avoided

    def ids(n: int) -> list[int]:
        return rng.integers(low, VOCAB, n).tolist()

    rows: dict[str, list] = {k: [] for k in ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids",
                                             "chosen_reward", "rejected_reward")}
    for _ in range(num_pairs):
        rows["prompt_token_ids"].append(ids(int(rng.integers(prompt[0], prompt[1] + 1))))
        rows["chosen_token_ids"].append(ids(int(rng.integers(response[0] - 1, response[1]))) + [eos_id])
        rows["rejected_token_ids"].append(ids(int(rng.integers(response[0] - 1, response[1]))) + [eos_id])
        rows["chosen_reward"].append(1.0)
        rows["rejected_reward"].append(0.0)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(path))
    return sum(2 * len(p) + len(c) + len(r) for p, c, r in
               zip(rows["prompt_token_ids"], rows["chosen_token_ids"], rows["rejected_token_ids"]))


# ----------------------------------------------------------------------------------------------------------------
# The two sides, each run in its own process


def run_ours(model: str, data: str, output: str, batch_size: int, accumulation: int, **options) -> dict[str, Any]:
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


def spawn(argv: list[str], output: Path) -> dict[str, Any]:
    """``python -m argv...`` (a benchmark worker) in a fresh process, writing ``output``; what it printed after
    ``RESULT``."""
    cmd = [sys.executable, "-m", *argv]
    side = " ".join(argv[:2])
    shutil.rmtree(output, ignore_errors=True)  # a finished output would be reused, not retrained
    env = {**os.environ, "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker {side} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ----------------------------------------------------------------------------------------------------------------
# The fixed-batch loss check


def loss_agreement(model_path: Path, data: Path, rows: int = 8, dtype: str = "float64") -> dict[str, float]:
    """DPO loss of our PairTask and of TRL's ``_compute_loss`` on the same batch, against a reference model that
    differs from the policy (its weights perturbed), so the loss is not the trivial log 2 of step 0. In float64 ours is
    exact and TRL's fused LM head still returns float32 log-probs (measured difference ~4e-6); in float32 both
    round sums of hundreds of token log-probs, in different layouts (packed against padded)."""
    import copy

    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.losses import PairLossParams
    from rlhf_pipeline.pairs import PairTask, pair_logps

    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
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
    return {"ours": float(ours), "trl": float(theirs), "abs_diff": abs(float(ours) - float(theirs))}


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

    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(config.num_rounds):
        order = SIDES[r % len(SIDES):] + SIDES[: r % len(SIDES)]
        for side in order:
            output = workdir / f"out_{side}"
            result = spawn([__name__, "--worker", side, "--model", str(model), "--data", str(data), "--output",
                            str(output), "--batch-size", str(size["batch_size"]), "--accumulation",
                            str(size["accumulation"])], output)
            runs[side].append(result)
            print(f"[bench trainer] round {r + 1} {side}: {result['seconds']:.1f} s, "
                  f"peak {result['peak_rss_mib']:.0f} MiB")
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
    return entries, []


def rebel_fixed_padding_fraction(data: Path) -> float:
    """Real tokens over REBEL's fixed grid: each pair's chosen and rejected padded to 1024 + 2048 positions."""
    from datasets import load_from_disk

    ds = load_from_disk(str(data))["train"]
    real = sum(2 * len(p) + len(c) + len(r) for p, c, r in
               zip(ds["prompt_token_ids"], ds["chosen_token_ids"], ds["rejected_token_ids"]))
    return real / (ds.num_rows * 2 * (1024 + 2048))


if __name__ == "__main__":
    worker(sys.argv[1:])
