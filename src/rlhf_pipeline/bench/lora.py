"""LoRA against full fine-tuning in our trainer: peak memory and step time, side by side.

Setup (both sides): the same random-initialised Llama (12 layers, hidden 1,024, MLP 3,072, vocab 8,192, about 180M
parameters, float32, CPU), the same DPO pairs (prompts 16-32 tokens, responses 16-64: short, so that the weights and
their optimizer state, not the activations, are what memory holds), the same global batch and steps, AdamW, the
reference log-probs in our one pass before training. The sides differ only in ``--lora-rank`` (16, alpha 32, every
linear layer of the decoder, peft's default set). Each run is a fresh subprocess, so its peak resident memory is its
own; the sides alternate round by round.

What it shows: full fine-tuning keeps a gradient and two AdamW moments for every weight (3 x 4 bytes per parameter
beside the weight's own 4), LoRA only for the adapters; and LoRA's backward computes no weight gradient for the
frozen layers (about a third of a training step's matmuls), at the price of the adapters' small matmuls. Step time =
the training loop's seconds (its steps and the final save, which for LoRA includes the merge) over its steps.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rlhf_pipeline.bench.common import Entry

SIDES = ("full", "lora")
RANK = 16
VOCAB = 8192
PROMPT, RESPONSE = (16, 32), (16, 64)  # token ranges: short, so the weights and their optimizer state dominate memory


def sizes(quick: bool) -> dict[str, int]:
    return {"pairs": 16, "batch_size": 1, "accumulation": 2, "max_steps": 6} if quick else {
        "pairs": 48, "batch_size": 1, "accumulation": 4, "max_steps": 10}


def make_model(path: Path) -> None:
    from rlhf_pipeline.bench.trainer import make_model as make_llama

    make_llama(path, hidden=1024, layers=12)


def run_side(side: str, model: str, data: str, output: str, size: dict[str, int]) -> dict[str, Any]:
    from rlhf_pipeline.bench.trainer import run_ours

    lora = {"lora_rank": RANK} if side == "lora" else {}
    info = run_ours(model, data, output, size["batch_size"], size["accumulation"], max_steps=size["max_steps"],
                    learning_rate=1e-4, **lora)
    training = json.loads((Path(output) / "manifest.json").read_text())["training"]
    return {**info, "train_seconds": training["seconds"]}


def worker(argv: list[str]) -> None:
    """One run of one side; prints a JSON line with its peak resident memory and step time."""
    side, model, data, output, size = argv[0], argv[1], argv[2], argv[3], json.loads(argv[4])
    import rlhf_pipeline.stages.train  # noqa: F401  (imports are not timed)

    t0 = time.perf_counter()
    info = run_side(side, model, data, output, size)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB
    print("RESULT " + json.dumps({"side": side, "seconds": time.perf_counter() - t0, "peak_rss_mib": peak, **info}))


def run(config, workdir: Path) -> tuple[list[Entry], list[dict]]:
    from rlhf_pipeline.bench.trainer import make_pairs, run_worker
    from rlhf_pipeline.chat import load_tokenizer

    try:
        import peft  # noqa: F401
    except ImportError:
        raise SystemExit("the LoRA benchmark needs peft: pip install -e '.[lora]'") from None
    size = sizes(config.quick)
    workdir.mkdir(parents=True, exist_ok=True)
    model, data = workdir / "model", workdir / "pairs"
    if not (model / "config.json").exists():
        make_model(model)
    make_pairs(data, size["pairs"], load_tokenizer(str(model)).eos_token_id, prompt_lengths=PROMPT, response_lengths=RESPONSE)
    print(f"[bench lora] {size['pairs']} pairs, {size['max_steps']} steps of {size['batch_size']} x "
          f"{size['accumulation']}; {config.num_rounds} rounds x {len(SIDES)} sides")
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(config.num_rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            result = run_worker([__name__, side, str(model), str(data), str(workdir / f"out_{side}"),
                                 json.dumps(size)], workdir / f"out_{side}")
            runs[side].append(result)
            print(f"[bench lora] round {r + 1} {side}: {result['train_seconds']:.1f} s training, "
                  f"peak {result['peak_rss_mib']:.0f} MiB")

    def median(side: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[side])

    step = {side: median(side, "train_seconds") / size["max_steps"] for side in SIDES}
    peak = {side: median(side, "peak_rss_mib") for side in SIDES}
    common = (f"DPO, Llama 12 layers x 1,024 hidden, vocab {VOCAB}, float32 on CPU; LoRA rank {RANK} on every linear "
              f"layer of the decoder against full fine-tuning; {size['max_steps']} steps of {size['batch_size']} x "
              f"{size['accumulation']} pairs (prompts {PROMPT[0]}-{PROMPT[1]} tokens, responses {RESPONSE[0]}-{RESPONSE[1]}); "
              f"{config.num_rounds} "
              "alternating rounds of fresh processes, median.")
    details = {side: {"train_seconds": [round(x["train_seconds"], 2) for x in runs[side]],
                      "peak_rss_mib": [round(x["peak_rss_mib"]) for x in runs[side]],
                      "first_loss": runs[side][0]["first_loss"]} for side in SIDES}
    entries = [
        Entry("lora_memory_vs_full", peak["lora"], peak["full"], "MiB peak RSS", peak["full"] / peak["lora"], None,
              f"{common} Peak resident memory of each run's process (ru_maxrss): full fine-tuning's over LoRA's "
              "(the process's fixed cost, about 0.7 GiB of libraries, is in both).", details),
        Entry("lora_step_time_vs_full", step["lora"], step["full"], "s/step", step["full"] / step["lora"], None,
              f"{common} Seconds per optimizer step of the training loop (the final save, with LoRA's merge, "
              "included): full fine-tuning's over LoRA's. Both start from the same loss (step 1: full "
              f"{details['full']['first_loss']:.6f}, LoRA {details['lora']['first_loss']:.6f}: the adapters start at "
              "zero).", details),
    ]
    if abs(details["full"]["first_loss"] - details["lora"]["first_loss"]) > 1e-5:
        for e in entries:
            e.notes += " FIRST-STEP LOSS MISMATCH: the two sides did not train the same model."
            e.ratio = 0.0
    return entries, []


if __name__ == "__main__":
    worker(sys.argv[1:])
