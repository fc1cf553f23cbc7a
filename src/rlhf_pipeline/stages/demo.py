"""The whole loop on a CPU, offline, in minutes: a tiny policy learns to write positive reviews.

    rlhf demo                          # REBEL, into runs/demo
    rlhf demo --algo dpo --output runs/demo_dpo
    rlhf demo --task topics --output runs/demo_topics   # the second task: a python reward, no reward model

The task (``rlhf_pipeline.demo.task``): prompts ask for a short review of a named product; the gold reward is the
sentiment polarity of the response, in [-1, 1]. The demo runs the real stages, each as its own process, exactly
as ``rlhf iterate`` runs them:

1. a tiny tokenizer and a random-initialised Llama, built offline (``DIR/base_policy``);
2. ``rlhf sft`` on bundled demonstrations of every shade of sentiment (``DIR/sft``: iteration 0's policy);
3. ``rlhf train-rm`` on pairs labelled by the gold reward, starting from the SFT policy (``DIR/reward_model``);
4. ``rlhf iterate``'s stages for T iterations, with the trained reward model as the reward (not the gold one);
5. ``rlhf eval`` of iterations 0..T on 160 held-out prompts, scored with the gold reward and the reward model,
   against the SFT policy;
6. ``rlhf report``: ``DIR/report.md`` and ``DIR/plots/``, and ``DIR/summary.json``::

    {"iterations": [{"iteration": t, "gold_reward_mean", "gold_reward_stderr", "rm_reward_mean",
                     "rm_win_rate_vs_base", "rm_lc_win_rate_vs_base", ...}, ...]}
    # iteration 0 is the SFT policy (win rate 0.5: itself); LC: the length-controlled win rate

``--task topics`` (``rlhf_pipeline.demo.topics``; the tasks are registered in ``rlhf_pipeline.demo.TASKS``) asks for
three things that belong to a topic and has no reward model: step 3 is left out, and the iterations score with the
gold reward itself, a verifiable python function (PPO's critic then starts from the SFT policy).

Interrupted (Ctrl-C, a crash), the same command resumes at the first unfinished stage and redoes nothing that
finished. Everything is seeded; the sizes below are the defaults, and the options change them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from rlhf_pipeline.algorithms import AlgoName, get, help_text
from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import option
from rlhf_pipeline.demo import DEFAULT_TASK, TASKS
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.layout import EVAL_RESULTS, SUMMARY, iteration_dir
from rlhf_pipeline.tiny import TINY_HEAD_DIM

TaskName = Literal[tuple(TASKS)]  # type: ignore[valid-type]
CPU_UP_TO_HIDDEN = 512  # --device auto keeps models up to this hidden size on the CPU


@dataclass(kw_only=True)
class DemoConfig:
    """Run SFT, reward-model training, T RLHF iterations, evaluation and the report on a bundled task, on a CPU."""

    output: str = option("runs/demo", help="The run directory.")
    task: TaskName = option(DEFAULT_TASK, help="The bundled task: " + "; ".join(
        f"{t.name}: {t.summary}" for t in TASKS.values()) + ".")
    algo: AlgoName = option("rebel", help=f"The RLHF algorithm (rlhf train --algo): {help_text()}.")
    iterations: int = option(3, help="RLHF iterations.")
    overlap: int = option(
        0, help="1: overlapped iterations (rlhf iterate's overlap): iteration t+1 samples, scores and filters with the "
        "policy one behind while iteration t trains, each side on half of this machine's cores."
    )
    prompts_per_iteration: int = option(
        320, help="Training prompts sampled per iteration (of the task's 640 for reviews, 480 for topics and "
        "first_word)."
    )
    n: int = option(4, help="Responses sampled per prompt.")
    max_new_tokens: int = option(48, help="Maximum tokens per response.")
    eval_prompts: int = option(160, help="Held-out prompts to evaluate on (of 160).")
    eval_n: int = option(2, help="Responses per held-out prompt in the evaluation.")
    hidden_size: int = option(128, help="Hidden size of the tiny Llama.")
    num_layers: int = option(2, help="Decoder layers of the tiny Llama.")
    sft_epochs: int = option(2, help="Epochs of supervised fine-tuning.")
    rm_epochs: int = option(2, help="Epochs of reward-model training.")
    train: dict = option(
        default_factory=dict, help="Extra options of rlhf train for every iteration, e.g. '{learning_rate: 1e-4}'."
    )
    sft: dict = option(default_factory=dict, help="Extra options of rlhf sft, e.g. '{max_steps: 10, bf16: true}'.")
    train_rm: dict = option(default_factory=dict, help="Extra options of rlhf train-rm, e.g. '{max_steps: 10}'.")
    seed: int = option(0, help="Seed of the data, the models and the sampling.")
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", help=f"Where every stage runs: auto = the CPU for a hidden size up to {CPU_UP_TO_HIDDEN} (on a GPU "
        "such a model's kernels are too small to pay for their launches, and every stage ran slower there than on "
        "the same machine's CPU; docs/benchmarks.md), else the GPU when there is one; cpu; cuda.", semantic=False,
    )
    overwrite: bool = option(False, help="Redo stages whose options changed (otherwise such a change is refused).")

    def __post_init__(self) -> None:
        for name in ("iterations", "prompts_per_iteration", "n", "max_new_tokens", "eval_prompts", "eval_n",
                     "num_layers", "sft_epochs", "rm_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.hidden_size < TINY_HEAD_DIM or self.hidden_size % TINY_HEAD_DIM:
            raise ValueError(f"--hidden-size must be a positive multiple of the tiny kit's head size {TINY_HEAD_DIM}")


def plan(config: DemoConfig, run: Path, data: dict[str, Path]):
    """The demo's steps: SFT, reward model, then the iterate loop with evaluation."""
    from rlhf_pipeline.machine import usable_cores
    from rlhf_pipeline.stages.iterate import IterateConfig, Step, count_prompts, option_args, with_dependencies
    from rlhf_pipeline.stages.iterate import plan as iterate_plan

    algorithm = get(config.algo)
    task = TASKS[config.task]
    common = {"batch_size": 16, "report_to": "none", "seed": config.seed}
    # overlapped: each side's stages get half of the cores (torch's threads), so the two run side by side
    threads = max(1, len(usable_cores()) // 2)
    lanes = {"sample": {"OMP_NUM_THREADS": threads}, "train": {"OMP_NUM_THREADS": threads}} if config.overlap else {}
    sft = Step("sft", "sft", [
        "--model", str(run / "base_policy"), "--data", str(data["sft"]), "--output", str(run / "sft"), "--resume",
        *option_args({**common, "epochs": config.sft_epochs, "learning_rate": 3e-3, "test_size": 64, **config.sft}),
        *(["--overwrite"] if config.overwrite else []),
    ], run / "sft")
    rm = None if not task.reward_model else Step("reward_model", "train-rm", [
        "--model", str(run / "sft"), "--data", str(data["preferences"]), "--output", str(run / "reward_model"),
        "--resume", *option_args({**common, "epochs": config.rm_epochs, "learning_rate": 1e-3, "test_size": 128,
                                   **config.train_rm}),
        *(["--overwrite"] if config.overwrite else []),
    ], run / "reward_model")
    loop = IterateConfig(
        output=str(run),
        overwrite=config.overwrite,
        model=str(run / "sft"),
        prompts=str(data["prompts"]),
        iterations=config.iterations,
        prompts_per_iteration=config.prompts_per_iteration,
        algo=config.algo,
        overlap=config.overlap,
        lane_env=lanes,
        # the reviews are scored by the reward model trained on them, the topics by their gold reward itself; an
        # algorithm that reads each reward source (GDPO) gets a second one beside it
        reward_model=str(run / "reward_model") if task.reward_model else None,
        reward_fn=[f for f in ([] if task.reward_model else [task.gold])
                   + ([task.second] if getattr(algorithm, "reward_sources", False) else [])] or None,
        eval_prompts=str(data["eval_prompts"]),
        generate={"n": config.n, "temperature": 0.8, "top_p": 1.0, "max_new_tokens": config.max_new_tokens,
                  "engine": "hf", "seed": config.seed, "batch_size": 64},
        score={"batch_size": 64},
        filter={"mode": algorithm.data, "test_size": 0.1, "seed": config.seed},
        train={**common, "epochs": 1, **algorithm.demo, **config.train},
        eval={"reward_fn": task.gold, "reward_model": str(run / "reward_model") if task.reward_model else None,
              "n": config.eval_n,
              "limit": config.eval_prompts, "temperature": 0.8, "top_p": 1.0, "max_new_tokens": config.max_new_tokens,
              "engine": "hf", "seed": config.seed + 1000, "batch_size": 64, "score_batch_size": 64},
    )
    count = count_prompts(loop)
    if config.prompts_per_iteration > count:  # said here with the demo's flag (iterate's key is another)
        raise PipelineError(f"--prompts-per-iteration {config.prompts_per_iteration}: the {config.task} task has "
                            f"{count} training prompts; give at most {count}")
    steps = [sft, *([rm] if rm is not None else []), *iterate_plan(loop, count)]
    return with_dependencies(steps, lanes) if config.overlap else steps


def summary(run: Path, iterations: int) -> dict:
    rows = []
    for t in range(iterations + 1):
        results = json.loads((iteration_dir(run, t) / "eval" / EVAL_RESULTS).read_text())
        gold, rm = results["scores"]["reward_fn"], results["scores"].get("reward_model") or {}
        rows.append({
            "iteration": t,
            "gold_reward_mean": gold["mean"],
            "gold_reward_stderr": gold["stderr"],
            "rm_reward_mean": rm.get("mean"),  # None for a task without a reward model
            "rm_reward_stderr": rm.get("stderr"),
            "rm_win_rate_vs_base": rm.get("win_rate"),
            "rm_lc_win_rate_vs_base": rm.get("lc_win_rate"),
            "gold_win_rate_vs_base": gold["win_rate"],
            "gold_lc_win_rate_vs_base": gold.get("lc_win_rate"),
            "response_tokens_mean": results["response_tokens_mean"],
        })
    first, last = rows[0], rows[-1]
    gain = last["gold_reward_mean"] - first["gold_reward_mean"]
    combined = ((first["gold_reward_stderr"] or 0.0) ** 2 + (last["gold_reward_stderr"] or 0.0) ** 2) ** 0.5
    # the last iteration's evaluation is against iteration 0's samples (its baseline): the gain over them, and its
    # standard error over the prompts both share
    last_gold = results["scores"]["reward_fn"]
    paired = last_gold.get("gain_stderr") if iterations else None
    return {
        "iterations": rows,
        "gold_gain": gain,
        # as if the two evaluations were independent (the learning matrices' measure in docs/algorithms.md)
        "gold_gain_in_combined_stderr": gain / combined if combined else None,
        # over the prompts both share: the test of the gain
        "gold_gain_paired_stderr": paired,
        "gold_gain_in_paired_stderr": last_gold["gain"] / paired if paired else None,
    }


def place_stages(config: DemoConfig) -> None:
    """Make every stage process run where ``--device`` says: on the CPU by hiding the GPUs from the stages (they
    inherit this process's environment), on a GPU by checking that there is one."""
    import os
    import shutil

    device = config.device
    if device == "auto":
        device = "cpu" if config.hidden_size <= CPU_UP_TO_HIDDEN else "cuda"
        if device == "cuda":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if shutil.which("nvidia-smi") and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
            print(f"[demo] hidden size {config.hidden_size}: every stage runs on the CPU, where a model this small is "
                  "fastest (--device cuda runs them on the GPU)")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return
    import torch

    if not torch.cuda.is_available():
        raise PipelineError("--device cuda: torch sees no GPU here; use --device cpu (or auto)")


def main(config: DemoConfig) -> Path:
    import time

    from rlhf_pipeline.datasets_io import atomic_directory, clean_stale, write_text_atomic
    from rlhf_pipeline.stages.iterate import check, run_lock, run_steps
    from rlhf_pipeline.stages.report import write_report
    from rlhf_pipeline.tiny import save_tiny_model

    started = time.time()
    place_stages(config)
    run = Path(config.output).expanduser()
    run.mkdir(parents=True, exist_ok=True)
    with run_lock(run, "demo"):  # before anything is written: a second demo on the run is refused first
        data = TASKS[config.task].write_data(run / "data", seed=config.seed)  # the same bytes every time
        base = run / "base_policy"
        clean_stale(base)
        if not base.exists():
            with atomic_directory(base) as tmp:
                save_tiny_model(tmp, kind="policy", seed=config.seed, hidden_size=config.hidden_size,
                                num_layers=config.num_layers)
        steps = plan(config, run, data)
        check(steps)
        run_steps(steps, run, label="demo")
        result = summary(run, config.iterations)
        write_text_atomic(run / SUMMARY, json.dumps(result, indent=2) + "\n")
        report = write_report(run, run)
    print(f"[demo] finished in {time.time() - started:.0f}s; report: {report}")
    judge = "rm" if TASKS[config.task].reward_model else "gold"  # whose win rate against the SFT policy to show
    print(f"[demo] {config.task}: {'iteration':>9} {'gold reward':>18} {'RM reward':>10} "
          f"{judge.upper() if judge == 'rm' else 'gold'} win rate {'LC':>6}")
    for row in result["iterations"]:
        win, lc = row[f"{judge}_win_rate_vs_base"], row[f"{judge}_lc_win_rate_vs_base"]
        rm = row["rm_reward_mean"]
        print(f"[demo] {config.task}: {row['iteration']:>9} {row['gold_reward_mean']:>+9.3f} ± "
              f"{row['gold_reward_stderr']:.3f} " + (f"{rm:>+10.3f}" if rm is not None else f"{'-':>10}")
              + f" {win:>12.3f} " + (f"{lc:>6.3f}" if lc is not None else f"{'-':>6}"))
    if result["gold_gain_in_combined_stderr"] is not None:
        paired = result["gold_gain_in_paired_stderr"]
        print(f"[demo] gold reward gain {result['gold_gain']:+.3f} = "
              f"{result['gold_gain_in_combined_stderr']:.1f} combined standard errors"
              + (f" ({paired:.1f} paired, over the prompts both evaluations share)" if paired else ""))
    return run


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(DemoConfig, main, "rlhf demo", argv)


if __name__ == "__main__":
    sys.exit(cli())
