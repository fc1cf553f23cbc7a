"""Trainer figures on the tiny kit, CPU, offline: loss at start and end for REBEL and DPO, the fraction of real
(non-pad) tokens in training batches, and the time per step with reference log-probs precomputed against
computed every step by a second, frozen reference model (the two alternate in one process; the ratio is the result).

    python scripts/bench_train.py [--out runs/bench_train] [--rounds 5] [--steps 10]

Data: generate (200 bundled prompts, n=5, 64 new tokens) -> score (a length/stop reward function) -> filter (pairs)
-> ref-logps, all with the real stage programs; the policy is a random-initialised Llama with hidden size 256 and
4 layers, so a step is not all Python overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REWARD = '''
def reward(prompts, responses, **columns):
    return [len(r) / 20 + (2.0 if f == "stop" else 0.0) for r, f in zip(responses, columns["finish_reasons"])]
'''


def stage(*args) -> None:
    from rlhf_pipeline.cli import main

    if main([str(a) for a in args]) != 0:
        raise SystemExit(f"stage failed: {args}")


def make_data(out: Path) -> tuple[str, Path]:
    from rlhf_pipeline.tiny import bundled_path, save_tiny_model

    policy = out / "policy"
    if not policy.exists():
        save_tiny_model(policy, kind="policy", seed=0, hidden_size=256, num_layers=4)
    (out / "reward.py").write_text(REWARD)
    prompts = bundled_path("prompts.jsonl")
    stage("generate", "--model", policy, "--prompts", prompts, "--output", out / "gen", "--n", 5,
          "--max-new-tokens", 64)
    stage("score", "--input", out / "gen", "--output", out / "scored", "--reward-fn", f"{out}/reward.py:reward")
    stage("filter", "--input", out / "scored", "--output", out / "pairs", "--tokenizer", policy, "--test-size", 20)
    stage("ref-logps", "--model", policy, "--input", out / "pairs", "--output", out / "ref")
    return str(policy), out / "ref"


def loss_curve(out: Path, policy: str, data: Path, algo: str, lr: float, steps: int) -> dict:
    run = out / f"train_{algo}"
    stage("train", "--algo", algo, "--model", policy, "--data", data, "--output", run, "--max-steps", steps,
          "--batch-size", 4, "--gradient-accumulation-steps", 2, "--learning-rate", lr, "--report-to", "none",
          *(["--temperature", 0.8] if algo != "rebel" else []), "--overwrite")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss/train"] for r in records if "loss/train" in r]
    manifest = json.loads((run / "manifest.json").read_text())["training"]
    return {
        "algo": algo,
        "learning_rate": lr,
        "steps": steps,
        "loss_first_5_mean": statistics.mean(train[:5]),
        "loss_last_5_mean": statistics.mean(train[-5:]),
        "eval_before": next(r for r in records if "loss/eval" in r),
        "eval_after": manifest["eval"],
        "real_token_fraction": manifest["real_token_fraction"],
    }


def time_steps(policy: str, data: Path, rounds: int, steps: int) -> dict:
    """Median seconds per optimizer step, precomputed reference log-probs vs a reference model every step."""
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    from rlhf_pipeline.algorithms import compute_pair_loss
    from rlhf_pipeline.losses import PairLossParams
    from rlhf_pipeline.algorithms.pairs import pair_logps
    from rlhf_pipeline.training.loop import global_batches

    torch.manual_seed(0)
    from rlhf_pipeline.chat import load_tokenizer
    from rlhf_pipeline.modeling import SAFE_WEIGHTS

    ds = load_from_disk(str(data))["train"]
    pad_id = load_tokenizer(policy).pad_token_id
    model = AutoModelForCausalLM.from_pretrained(policy, **SAFE_WEIGHTS)
    reference = AutoModelForCausalLM.from_pretrained(policy, **SAFE_WEIGHTS).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    params = PairLossParams(beta=0.1)
    batches = global_batches(ds.num_rows, 8, seed=0, epoch=0)

    def step(rows, precomputed: bool) -> None:
        chosen, rejected, _ = pair_logps(model, rows, pad_id, 1.0)
        if precomputed:
            ref_c = torch.tensor([r["chosen_ref_logp"] for r in rows])
            ref_r = torch.tensor([r["rejected_ref_logp"] for r in rows])
        else:
            with torch.no_grad():
                ref_c, ref_r, _ = pair_logps(reference, rows, pad_id, 1.0)
        loss, _ = compute_pair_loss("dpo", params, chosen, rejected, ref_c, ref_r)
        loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    times = {"precomputed": [], "reference_model": []}
    k = 0
    for r in range(rounds):
        for mode in (("precomputed", "reference_model") if r % 2 == 0 else ("reference_model", "precomputed")):
            for _ in range(steps):
                rows = ds.select(batches[k % len(batches)]).to_list()
                k += 1
                t0 = time.perf_counter()
                step(rows, mode == "precomputed")
                times[mode].append(time.perf_counter() - t0)
    pre, ref = statistics.median(times["precomputed"]), statistics.median(times["reference_model"])
    return {"batch_pairs": 8, "steps_each": len(times["precomputed"]), "precomputed_s_per_step": pre,
            "reference_model_s_per_step": ref, "ratio_reference_over_precomputed": ref / pre}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_train")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy, data = make_data(out)
    results = {
        "loss_curves": [loss_curve(out, policy, data, "rebel", 1e-5, 40), loss_curve(out, policy, data, "dpo", 1e-4, 40)],
        "step_time": time_steps(policy, data, args.rounds, args.steps),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
